"""`meshlm plan`: the layouts that fit a model on a cluster, ranked by predicted throughput, each
with its per-rank memory, step time, MFU, exposed communication and bottleneck.
Reduces: trial and error on the cluster; enumerates dp x tp x pp (schedule, virtual stages) x cp x
ZeRO x recompute x micro-batch, keeps what `memory.predict` says fits, ranks by `steptime`.
Costs: a few seconds of one CPU core; its answers are as good as the two models it combines.

The search. Every layout gets a cheap optimistic step time first (steptime's lower bound on the
pipeline); candidates are then visited fastest first, and only those get a memory prediction and
a simulated pipeline. The search stops when the next candidate's optimistic time cannot beat the
K-th best nor come within SIMPLICITY_WINDOW of the best, so the answer is the same as a full
evaluation. A layout that does not fit rules out, unevaluated, every layout of its structure
that needs at least as much memory (less ZeRO below 3, less recompute, a larger micro-batch);
a (dp, tp, cp, pp) whose leanest layout (ZeRO-2 or 3, full recompute, micro-batch 1) does not fit
is dropped the first time the search reaches it.

What is not enumerated. These cannot change the answer:
- TP never crosses a node (tp <= gpus per node): its collectives run on every block and would run
  at network speed; and always with sequence parallelism (less memory, the same bytes).
- ZeRO only when something shards it (dp x cp > 1); selective recompute only without CP (ring
  attention keeps no score matrix, so there is nothing to drop: recompute.py).
- GPipe only where it has no more micro-batches than stages: beyond, 1F1B has the same bubble and
  holds at most pp micro-batches in flight instead of m, so GPipe can only lose.
- Interleaved only with whole rounds (m a multiple of pp, Megatron's rule): meshlm's relaxed
  partial rounds warm up deeper, holding more micro-batches in flight for a larger bubble.
And these are stated limits (see each constant): micro-batch sizes are powers of two up to
MAX_MICRO_BATCH; virtual stages up to MAX_VIRTUAL and MAX_CHUNKS; CP down to MIN_CP_TOKENS per
rank; pp up to MAX_PP; layers split evenly across stages (no parallel.pp_layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshlm.analysis.hardware import gpu as find_gpu
from meshlm.analysis.steptime import RECOMPUTE_MODES, Layout, StepTime, Workload, defers_weight_grads, step_time
from meshlm.config import Config, ConfigError, RunError, resolve
from meshlm.parallel.pipeline.schedules import ScheduleError, check_schedule

SIMPLICITY_WINDOW = 0.03  # the simplest layout within 3% of the best throughput is recommended
DEFAULT_BATCH_TOKENS = 2**22  # 4M tokens per step (Llama 2's batch, Llama 3's first stage)
MAX_MICRO_BATCH = 16
# Interleaving: NeMo's Llama 3 70B recipes go to 5 chunks per rank and 40 chunks in all (pp=8 x 5);
# every chunk boundary is one more P2P per micro-batch and a longer schedule to simulate.
MAX_VIRTUAL = 5
MAX_CHUNKS = 40
# CP only while each rank keeps this many tokens: below, ring attention's blocks are too small for
# attention kernels to run near the efficiency the model assumes, and per-hop latency stops hiding
# (NeMo uses cp=2 at 8K tokens, Llama 3 cp=16 at 128K: 4K and 8K per rank).
MIN_CP_TOKENS = 4096
MAX_CP = 8
# Deeper pipelines need many more micro-batches than stages to amortise their bubble, more than a
# typical global batch has per pipeline; Llama 3 405B (126 layers) ran pp=16 on 16K GPUs.
MAX_PP = 16


@dataclass
class Candidate:
    layout: Layout
    estimate_s: float  # optimistic step time (no simulation)
    time: StepTime | None = None
    memory_bytes: int | None = None


@dataclass
class Plan:
    work: Workload
    layouts: list[Candidate]  # best first: the recommended one, then by predicted throughput
    enumerated: int
    memory_checked: int  # memory predictions made (the rest were ruled out or never reached)
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- enumeration


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_ok(m, tp: int) -> bool:
    """What parallel/tensor.py can split: whole heads, kv heads split or replicated, the MLP."""
    return m.n_heads % tp == 0 and (m.n_kv_heads % tp == 0 or tp % m.n_kv_heads == 0) and m.ffn_dim % tp == 0


def structures(work: Workload) -> list[tuple[int, int, int, int]]:
    """(dp, tp, cp, pp) that meshlm can build for this model, sequence and cluster (any batch)."""
    m, n = work.model, work.n_gpus
    out = []
    for tp in _divisors(n):
        if work.gpus_per_node % tp or not _tp_ok(m, tp):  # never TP across nodes (every group inside one)
            continue
        for cp in _divisors(n // tp):
            # causal load balancing needs 2*cp chunks; SP then splits each cp shard across tp
            if cp > 1 and (cp > MAX_CP or work.seq // cp < MIN_CP_TOKENS or work.seq % (2 * cp)):
                continue
            if (work.seq // cp) % tp:
                continue
            for pp in _divisors(n // (tp * cp)):
                if pp <= MAX_PP and m.n_layers % pp == 0:
                    out.append((n // (tp * cp * pp), tp, cp, pp))
    return out


def _schedules(work: Workload, pp: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("none", 1)]
    out = [("1f1b", 1), ("gpipe", 1)]
    for v in range(2, MAX_VIRTUAL + 1):
        if work.model.n_layers % (pp * v) == 0 and pp * v <= MAX_CHUNKS:
            out.append(("interleaved", v))
    return out


def enumerate_layouts(work: Workload) -> list[Layout]:
    """Every layout meshlm could run with this workload's global batch (validity only, not fit)."""
    out = []
    for dp, tp, cp, pp in structures(work):
        if work.global_batch % dp:
            continue
        local = work.global_batch // dp
        sizes = [b for b in (2**i for i in range(MAX_MICRO_BATCH.bit_length())) if b <= MAX_MICRO_BATCH and local % b == 0]
        for kind, v in _schedules(work, pp):
            for mbs in sizes:
                if pp > 1:
                    if kind == "gpipe" and local // mbs > pp:
                        continue  # 1F1B: the same bubble, at most pp micro-batches in flight instead of m
                    if kind == "interleaved" and (local // mbs) % pp:
                        continue  # partial rounds: more in flight, a larger bubble (Megatron forbids them)
                    try:
                        check_schedule(kind, pp, local // mbs, v)
                    except ScheduleError:
                        continue
                for zero in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                    for rec in RECOMPUTE_MODES:
                        if rec == "selective" and cp > 1:
                            continue
                        out.append(Layout(dp, tp, pp, cp, zero, rec, mbs, kind, v))
    return out


# --------------------------------------------------------------------------- memory


def layout_config(work: Workload, lay: Layout, global_batch: int | None = None) -> Config:
    """The resolved meshlm config of a layout (what `meshlm train` would run)."""
    cfg = Config()
    cfg.model.preset = work.model.preset
    t, p = cfg.train, cfg.parallel
    t.seq_len, t.micro_batch_size, t.dtype, t.recompute = work.seq, lay.micro_batch_size, work.dtype, lay.recompute
    t.global_batch_size = global_batch or work.global_batch
    p.dp, p.tp, p.pp, p.cp, p.zero, p.sp = lay.dp, lay.tp, lay.pp, lay.cp, lay.zero, lay.sp
    if lay.pp > 1:
        p.pp_schedule, p.pp_virtual = lay.pp_schedule, lay.pp_virtual
    return resolve(cfg, world_size=lay.world)


def memory_bytes(work: Workload, lay: Layout) -> int:
    """The largest per-rank peak `memory.predict` gives for the layout, asked with fewer
    micro-batches where that gives the same bytes (tests/test_plan.py checks it): 1F1B's peak is
    reached with pp + 1 of them (its warm-up depth, then a backward with the first's gradients
    held: with pp, the first stage's fullest point comes before any gradient exists, up to 18%
    lower), interleaved's with 3 pp (whole rounds only; under ZeRO-3 the first stage's forwards
    after its first backward, with the root unit's gradient shard made, need the third), and
    without a pipeline the second micro-batch (forward with gradients held) is as high as it gets.
    The walk over a shorter schedule is what keeps the search within seconds."""
    from meshlm.analysis.memory import predict

    m = min(_micro_batches(work, lay), _peak_micro_batches(lay))
    return predict(layout_config(work, lay, lay.dp * lay.micro_batch_size * m)).peak_bytes


def _micro_batches(work: Workload, lay: Layout) -> int:
    return work.global_batch // (lay.dp * lay.micro_batch_size)


def _peak_micro_batches(lay: Layout) -> int:
    """How many micro-batches a step needs for its memory peak to be reached (memory_bytes):
    GPipe's grows with every one."""
    return {"none": 2, "1f1b": lay.pp + 1, "gpipe": 2**31, "interleaved": 3 * lay.pp}[lay.pp_schedule]


class _MemoryOracle:
    """memory_bytes with a cache, and the monotonicity that spares most calls: within one structure
    (dp tp pp cp), less ZeRO (among 0-2), less recompute or a larger micro-batch (see ruled_out)
    never needs less memory, so a layout that does not fit rules those out."""

    def __init__(self, work: Workload) -> None:
        self.work, self.limit = work, work.gpu.usable_bytes
        self.cache: dict[Layout, int] = {}
        self.too_big: dict[tuple, list[tuple]] = {}  # (dp tp pp cp) -> ((schedule, v), zero, recompute, mbs)

    @staticmethod
    def _key(lay: Layout) -> tuple:
        return (lay.dp, lay.tp, lay.pp, lay.cp)

    def ruled_out(self, lay: Layout) -> bool:
        """1F1B holds the fewest micro-batches in flight, so a 1F1B layout that does not fit rules
        out every schedule, unless the stages defer weight gradients (`defers_weight_grads`: a
        1F1B stage owes its whole stage's, an interleaved chunk's are a v-th of that) or run under
        autocast with full recompute (ZeRO-0 in bf16: a forward caches the bf16 copies of its
        whole chunk's weights); any other rules out its own schedule only. A larger micro-batch
        is ruled out only where the step still has the micro-batches its peak needs: with fewer
        (no accumulation, a pipeline short of its steady state) no gradients are held at the
        fullest point, and GPipe holds every micro-batch, the same tokens at any size."""
        r = RECOMPUTE_MODES.index(lay.recompute)
        sched = (lay.pp_schedule, lay.pp_virtual)
        whole = _micro_batches(self.work, lay) >= _peak_micro_batches(lay)
        chunked_leaner = _chunks_can_be_leaner(self.work, lay)
        return any((s == sched or (s == ("1f1b", 1) and not chunked_leaner))
                   and (lay.zero == z or lay.zero <= z <= 2) and r <= rz
                   and (lay.micro_batch_size == b or lay.micro_batch_size > b and whole)
                   for s, z, rz, b in self.too_big.get(self._key(lay), ()))

    def __call__(self, lay: Layout) -> int:
        if lay not in self.cache:
            self.cache[lay] = memory_bytes(self.work, lay)
            if self.cache[lay] > self.limit:
                self.too_big.setdefault(self._key(lay), []).append(
                    ((lay.pp_schedule, lay.pp_virtual), lay.zero, RECOMPUTE_MODES.index(lay.recompute),
                     lay.micro_batch_size))
        return self.cache[lay]


def _chunks_can_be_leaner(work: Workload, lay: Layout) -> bool:
    """Can an interleaved schedule need less memory than 1F1B? Where what a stage holds grows
    with its chunk's layers: weight gradients deferred over the chunk, or autocast's cache of
    the chunk's bf16 weight copies through a fully recomputed forward (ZeRO-0 in bf16); and
    under ZeRO-3, where a chunk without the embedding or head gathers no root unit (fsdp.py)."""
    return (defers_weight_grads(lay) or lay.zero == 3
            or (work.dtype == "bfloat16" and lay.zero == 0 and lay.recompute == "full"))


def _leanest(work: Workload, dp: int, tp: int, cp: int, pp: int) -> list[Layout]:
    """The structure's layouts that need the least memory: full recompute, one sequence a
    micro-batch, 1F1B (and interleaved, where its chunks can be leaner)."""
    zeros = (2, 3) if dp * cp > 1 else (0,)
    if pp == 1:
        return [Layout(dp, tp, pp, cp, z, "full", 1) for z in zeros]
    out = [Layout(dp, tp, pp, cp, z, "full", 1, "1f1b") for z in zeros]
    m = work.global_batch // dp
    for kind, v in _schedules(work, pp):
        for lay in (Layout(dp, tp, pp, cp, z, "full", 1, kind, v) for z in zeros):
            if kind == "interleaved" and _chunks_can_be_leaner(work, lay) and m % pp == 0:
                try:
                    check_schedule(kind, pp, m, v)
                except ScheduleError:
                    continue
                out.append(lay)
    return out


# --------------------------------------------------------------------------- the search


def plan(work: Workload, top: int = 5) -> Plan:
    """The `top` best layouts that fit (see the module docstring), or RunError naming what is needed."""
    layouts = enumerate_layouts(work)
    if not layouts:
        dps = sorted({s[0] for s in structures(work)})
        raise ConfigError(f"--global-batch: {work.global_batch} is not divisible by any data-parallel size a layout "
                          f"of {work.n_gpus} GPUs allows (dp in {{{', '.join(map(str, dps))}}})")
    memory = _MemoryOracle(work)
    candidates = [Candidate(lay, step_time(work, lay, simulate=False).step_time_s) for lay in layouts]
    candidates.sort(key=lambda c: (c.estimate_s, c.layout.complexity()))
    viable: dict[tuple, bool] = {}  # (dp, tp, cp, pp) -> does its leanest layout fit? (asked lazily)
    best: dict[tuple, Candidate] = {}  # structure -> its fastest fitting micro-batch size
    bar = math.inf  # no candidate slower than this (optimistically) can still enter the answer
    for cand in candidates:
        if cand.estimate_s > bar:
            break  # nothing left can enter the top K or the simplicity window
        lay = cand.layout
        group = (lay.dp, lay.tp, lay.cp, lay.pp)
        if group not in viable:
            viable[group] = min(memory(lean) for lean in _leanest(work, *group)) <= memory.limit
        if not viable[group]:
            continue
        if lay.pp_schedule == "interleaved" and not _chunks_can_be_leaner(work, lay):
            # its 1F1B twin needs less and costs 1/v the walk
            twin = Layout(lay.dp, lay.tp, lay.pp, lay.cp, lay.zero, lay.recompute, lay.micro_batch_size, "1f1b")
            if not memory.ruled_out(twin):
                memory(twin)
        if memory.ruled_out(lay):
            continue
        cand.memory_bytes = memory(cand.layout)
        if cand.memory_bytes > memory.limit:
            continue
        cand.time = step_time(work, cand.layout)
        key = cand.layout.structure()
        if key not in best or (cand.time.step_time_s, cand.layout.complexity()) < (
                best[key].time.step_time_s, best[key].layout.complexity()):
            best[key] = cand
            ranked = sorted(c.time.step_time_s for c in best.values())
            if len(ranked) >= top:
                bar = max(ranked[0] / (1 - SIMPLICITY_WINDOW), ranked[top - 1])
    if not best:  # then every structure was visited, and none's leanest layout fits
        raise RunError(_does_not_fit(work, memory))
    ordered = recommend(list(best.values()))
    notes = []
    fastest = min(c.time.step_time_s for c in ordered)
    if ordered[0].time.step_time_s > fastest:
        notes.append(f"#1 is the simplest layout within {SIMPLICITY_WINDOW:.0%} of the fastest; #2 is "
                     f"{ordered[0].time.step_time_s / fastest - 1:.1%} faster")
    return Plan(work, ordered[:top], len(layouts), len(memory.cache), notes)


def recommend(found: list[Candidate]) -> list[Candidate]:
    """Best first: the simplest layout (Layout.complexity) among those within SIMPLICITY_WINDOW of
    the fastest throughput, then the others by predicted step time. Simpler layouts are easier to
    run, debug and resume, and the models are not accurate to a few percent."""
    ordered = sorted(found, key=lambda c: (c.time.step_time_s, c.layout.complexity()))
    fastest = ordered[0].time.step_time_s
    pick = min((c for c in ordered if c.time.step_time_s <= fastest / (1 - SIMPLICITY_WINDOW)),
               key=lambda c: c.layout.complexity())
    return [pick] + [c for c in ordered if c is not pick]


def _does_not_fit(work: Workload, memory: _MemoryOracle) -> str:
    """One line: the leanest layout's bytes against the GPU's, and the smallest cluster that fits."""
    lean = min(memory.cache, key=memory.cache.get)
    need = memory.cache[lean]
    line = (f"{work.model.preset} does not fit on {work.n_gpus} x {work.gpu.name}: the leanest layout "
            f"({describe(lean)}) needs {need / 2**30:.1f} GiB per GPU, {work.gpu.usable_bytes / 2**30:.1f} GiB usable")
    n = work.n_gpus
    while n < 2**16:
        n = min(2 * n, work.node_size) if n < work.node_size else 2 * n
        bigger = Workload(work.model, work.seq, n, work.dtype, work.gpu, n, work.node_size)
        probe = _MemoryOracle(bigger)
        # Model parallelism first: the leanest structures, so the first that fits ends the probe.
        for dp, tp, cp, pp in sorted(structures(bigger), key=lambda s: (-s[1], s[2], s[3])):
            if cp == 1 and any(probe(lay) <= probe.limit for lay in _leanest(bigger, dp, tp, cp, pp)):
                fit = min(probe.cache, key=probe.cache.get)
                return line + f"; it needs at least {n} GPUs (e.g. {describe(fit)}: {probe.cache[fit] / 2**30:.1f} GiB)"
    return line


# --------------------------------------------------------------------------- the request


def describe(lay: Layout) -> str:
    pipe = f" pp={lay.pp} {lay.pp_schedule}" + (f" v={lay.pp_virtual}" if lay.pp_virtual > 1 else "") if lay.pp > 1 else ""
    return (f"dp={lay.dp} tp={lay.tp}{pipe} cp={lay.cp} zero={lay.zero} recompute={lay.recompute} "
            f"micro-batch {lay.micro_batch_size}")


def default_global_batch(n_gpus: int, seq: int) -> int:
    """DEFAULT_BATCH_TOKENS worth of sequences, rounded up to a multiple of the GPU count so that
    plain data parallelism divides it."""
    return n_gpus * max(1, math.ceil(DEFAULT_BATCH_TOKENS / seq / n_gpus))


def workload(model: str, gpus: int, gpus_per_node: int | None = None, gpu: str = "h100-80gb", seq: int | None = None,
             global_batch: int | None = None, dtype: str = "bfloat16") -> Workload:
    """The validated request; a bad value is a ConfigError naming its flag (exit 2)."""
    from meshlm.config import ModelConfig
    from meshlm.model.presets import PRESETS

    if model not in PRESETS:
        raise ConfigError(f"--model: unknown preset {model!r} (known: {', '.join(PRESETS)})")
    hw = find_gpu(gpu)
    if gpus < 1:
        raise ConfigError(f"--gpus: must be >= 1, got {gpus}")
    node = hw.gpus_per_node if gpus_per_node is None else gpus_per_node
    if node < 1:
        raise ConfigError(f"--gpus-per-node: must be >= 1, got {node}")
    if gpus > node and gpus % node:
        raise ConfigError(f"--gpus: {gpus} is not a whole number of nodes of {node} GPUs (--gpus-per-node)")
    if dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"--dtype: must be bfloat16 or float32, got {dtype!r}")
    m = ModelConfig(preset=model, **PRESETS[model])
    seq = m.max_seq_len if seq is None else seq
    if not 1 <= seq <= m.max_seq_len:
        raise ConfigError(f"--seq: must be in 1..{m.max_seq_len} (the max_seq_len of {model}), got {seq}")
    batch = default_global_batch(gpus, seq) if global_batch is None else global_batch
    if batch < 1:
        raise ConfigError(f"--global-batch: must be >= 1, got {batch}")
    return Workload(m, seq, batch, dtype, hw, gpus, node)
