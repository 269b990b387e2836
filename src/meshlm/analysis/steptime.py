"""The step-time model of a layout: FLOPs at a stated efficiency, each axis's communication from
the alpha-beta model on a two-tier topology, the pipeline bubble from the simulator.
Reduces: running a layout to learn what it costs; `meshlm plan` ranks thousands of them with it.
Costs: fidelity; one efficiency for every kernel, no compute/communication contention, and ideal
overlap where the engines overlap (all stated below; none where the topology's collectives do not
progress in the background, as meshlm's shared-memory ones), so trust differences between layouts
more than absolute times.

One step = m micro-batches through each pipeline (m = global batch / (dp x micro-batch)). Per
micro-batch, each pipeline rank spends, for its layers (the last rank also runs the LM head):

    forward    model FLOPs / (peak x COMPUTE_EFFICIENCY) + TP's collectives + CP's exposed ring
               + ZeRO-3's exposed all-gather
    backward   2 x forward FLOPs, + recompute (full: the blocks' forward again; selective: the
               attention core's), + TP's collectives (with SP's re-gathers, and a full
               recompute's forward ones) + CP's exposed ring (again for a full recompute)
               + ZeRO-2/3's exposed reduce-scatter (and ZeRO-3's all-gather of the blocks)

Which messages those are, and their sizes in each precision mode, is analysis/messages.py.

Those per-rank costs feed `pipeline_sim.simulate_schedule` (pp > 1), with the P2P send of one
micro-batch's activations as the message latency; the step ends with the gradient reduction that
did not hide under the last backward (DDP's all-reduce, ZeRO-1's reduce-scatter) and ZeRO-1/2's
parameter all-gather. Which collectives run when is what meshlm's engines do
(parallel/ddp.py, zero.py, fsdp.py, tensor.py, context.py, pipeline/).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from statistics import fmean as mean

from meshlm.analysis.flops import flops_per_token
from meshlm.analysis.hardware import GPU
from meshlm.analysis.messages import (Message, block_params, boundary_bytes, data_parallel_bytes, dtype_bytes,
                                     layer_matmul_params, rank_params, ring_block_bytes, stage_messages)
from meshlm.analysis.pipeline_sim import OpCosts, simulate_schedule
from meshlm.comm.cost import Topology, op_time
from meshlm.config import ModelConfig

# The share of the dense bf16 peak one GPU sustains on a Llama block when nothing waits on
# communication. Large bf16 GEMMs run at ~70-75% of peak, attention kernels well below that, and
# norms, RoPE, SwiGLU and the loss are memory-bound: the FLOP-weighted mix lands near 55%. Runs
# that add communication and bubbles publish 38-43% (Llama 3 405B on 16K H100s, Llama 3 paper,
# table 4), which this constant plus the modelled losses reproduces.
COMPUTE_EFFICIENCY = 0.55
# A layout whose losses (everything but useful compute) stay under this share of the step is
# called compute-bound: no single change to the layout buys much.
COMPUTE_BOUND_SHARE = 0.10
# meshlm's DDP/ZeRO bucket size (parallel/ddp.py): the last bucket cannot hide under backward.
BUCKET_BYTES = 25 * 2**20
# The sim runs at most max(this many per pp rank, SIM_MICROBATCHES_MIN) micro-batches; beyond,
# each extra one adds one steady-state cycle (1F1B's steady state is periodic;
# tests/test_plan_steptime.py checks it); short pipelines need more rounds before warm-up effects
# have died out.
SIM_MICROBATCHES_PER_STAGE = 3
SIM_MICROBATCHES_MIN = 32
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    cp: int
    zero: int
    recompute: str
    micro_batch_size: int
    pp_schedule: str = "none"  # gpipe | 1f1b | interleaved; "none" when pp == 1
    pp_virtual: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sp(self) -> bool:  # Megatron always pairs TP with sequence parallelism: less memory, same bytes
        return self.tp > 1

    def structure(self) -> tuple:
        """Everything but the micro-batch size."""
        return (self.dp, self.tp, self.pp, self.cp, self.zero, self.recompute, self.pp_schedule, self.pp_virtual)

    def complexity(self) -> tuple:
        """Orders layouts from simplest to most involved: fewer model-parallel axes (a pipeline and
        CP before TP), then no interleaving, smaller degrees, lighter ZeRO, less recompute, and a
        larger micro-batch (larger GEMMs run closer to peak, which the one efficiency ignores)."""
        axes = (self.tp > 1) + (self.pp > 1) + (self.cp > 1)
        return (axes, self.pp, self.pp_virtual, self.cp, self.tp, self.zero, RECOMPUTE_MODES.index(self.recompute),
                -self.micro_batch_size)


@dataclass(frozen=True)
class Workload:
    """What is trained on what: the model, sequence, global batch (sequences), dtype, cluster."""

    model: ModelConfig
    seq: int
    global_batch: int
    dtype: str
    gpu: GPU
    n_gpus: int
    node_size: int  # GPUs per node of the cluster (a cluster smaller than one node: all in one)

    @property
    def gpus_per_node(self) -> int:
        return min(self.node_size, self.n_gpus)

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == "bfloat16" else 4

    @functools.cached_property
    def topology(self) -> Topology:
        return self.gpu.topology(self.gpus_per_node)

    @functools.cached_property
    def _comm_cache(self) -> dict:
        return {}

    def comm_time(self, op: str, nbytes: float, size: int, stride: int, neighbours: bool = False) -> float:
        """Seconds of one collective over the axis groups of `size` ranks `stride` apart, from the
        alpha-beta model, priced on one that spans nodes if any does (the step waits for its
        slowest group: with 6 GPUs a node and cp groups of stride 2, {0, 2} stays inside node 0
        and {4, 6} does not); `neighbours`: over any `size` consecutive members of the axis (a
        pipeline's stage pairs), not its groups (a CP ring's hops stay inside its group); memoised."""
        key = (op, nbytes, size, stride, neighbours)
        if key not in self._comm_cache:
            self._comm_cache[key] = self.topology.time(op, nbytes, self._slowest_group(size, stride, neighbours))
        return self._comm_cache[key]

    def _slowest_group(self, size: int, stride: int, neighbours: bool) -> list[int]:
        """neighbours: any `size` consecutive members of the axis (a pipeline's stage pairs),
        rather than the axis groups themselves."""
        groups = ([base + i * stride for i in range(size)] for base in range(self.n_gpus - (size - 1) * stride)
                  if neighbours or base // stride % size == 0)
        return next((g for g in groups if self.topology.spans_nodes(g)), [i * stride for i in range(size)])

    @functools.cached_property
    def flop_rate(self) -> float:
        """FLOP/s one GPU sustains at COMPUTE_EFFICIENCY."""
        return self.gpu.peak_tflops(self.dtype) * 1e12 * COMPUTE_EFFICIENCY

    @property
    def model_flops(self) -> float:
        """Model FLOPs of one step (the MFU convention of analysis/flops.py)."""
        return flops_per_token(self.model, self.seq) * self.global_batch * self.seq


@dataclass
class StepTime:
    """One layout's predicted step, split into rank-averaged parts that add up to step_time_s."""

    step_time_s: float
    compute_s: float  # useful model FLOPs at COMPUTE_EFFICIENCY
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float
    pp_comm_s: float  # P2P latency on the pipeline's critical path
    dp_comm_s: float
    bubble_s: float  # pipeline fill/drain and stage imbalance
    mfu: float
    tokens_per_s: float
    microbatches: int

    @property
    def exposed_comm_s(self) -> float:
        return self.tp_comm_s + self.cp_comm_s + self.pp_comm_s + self.dp_comm_s

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.step_time_s

    def losses(self) -> dict[str, float]:
        """What the step spends on anything but useful compute, by cause. Recompute is charged
        to memory: it is paid only because the activations did not fit."""
        return {"memory": self.recompute_s, "tp comm": self.tp_comm_s, "cp comm": self.cp_comm_s,
                "pp comm": self.pp_comm_s, "dp comm": self.dp_comm_s, "bubble": self.bubble_s}

    @property
    def bottleneck(self) -> str:
        losses = self.losses()
        if sum(losses.values()) < COMPUTE_BOUND_SHARE * self.step_time_s:
            return "compute"
        return max(losses, key=losses.get)


@dataclass
class _Rank:
    """One pipeline rank's seconds per micro-batch (all its chunks together), by part and pass."""

    fwd: float = 0.0  # model FLOPs of the forward
    bwd: float = 0.0  # model FLOPs of the backward
    recompute: float = 0.0  # in the backward pass
    tp_fwd: float = 0.0
    tp_bwd: float = 0.0
    cp_fwd: float = 0.0
    cp_bwd: float = 0.0
    dp_fwd: float = 0.0  # ZeRO-3's exposed all-gather
    dp_bwd: float = 0.0  # ZeRO-2/3's exposed collectives of every backward
    dp_end: float = 0.0  # once per step, after the pipeline drains
    weight_grads: float = 0.0  # the weight-gradient half of bwd (deferrable in pipelines)

    @property
    def forward(self) -> float:
        return self.fwd + self.tp_fwd + self.cp_fwd + self.dp_fwd

    @property
    def backward(self) -> float:
        return self.bwd + self.recompute + self.tp_bwd + self.cp_bwd + self.dp_bwd

    @property
    def busy(self) -> float:
        return self.forward + self.backward


def rank_costs(work: Workload, lay: Layout) -> list[_Rank]:
    """Per pipeline rank, the seconds of one micro-batch by part; see the module docstring."""
    m, rate, item = work.model, work.flop_rate, work.itemsize
    seq_local = work.seq // lay.cp
    tokens = lay.micro_batch_size * seq_local
    layers = m.n_layers // lay.pp
    attn_fwd = 4 * tokens * work.seq * m.dim / lay.tp  # q.k and p.v against every key (flops.py)
    layer_fwd = 2 * tokens * layer_matmul_params(m) / lay.tp + attn_fwd
    head_fwd = 2 * tokens * m.vocab_size * m.dim / lay.tp

    # TP + SP: every collective of analysis/messages.py (per block: the sequence all-gathers and
    # reduce-scatters of forward, their mirrors and SP's re-gathers in backward, the norms'
    # all-reduces; the embedding, head and loss on the end stages), on the critical path: meshlm
    # does not overlap them with the GEMMs. Axis order tp-cp-dp-pp, tp fastest (mesh.py): tp ranks
    # are adjacent, cp ones tp apart, dp ones tp*cp.
    def tp_seconds(messages: list[Message], part: str) -> float:
        return sum(getattr(msg, part) * work.comm_time(msg.op, msg.nbytes, lay.tp, 1)
                   for msg in messages if msg.axis == "tp")

    # CP: K and V go around the ring, one hop per block of attention; a hop hides under the
    # attention to the block that just arrived. Backward sends K, V and their fp32 gradients,
    # whose last hop (back to their owner) follows the last block: exposed. A full recompute runs
    # the forward's ring again.
    cp_fwd = cp_bwd = 0.0
    if lay.cp > 1:
        block = ring_block_bytes(work, lay)
        hop_f = work.comm_time("p2p", block * item, lay.cp, lay.tp)
        hop_b = work.comm_time("p2p", block * (item + 4), lay.cp, lay.tp)  # a block and a gradient at once
        step_f = attn_fwd / lay.cp / rate
        cp_fwd = layers * (lay.cp - 1) * max(0.0, hop_f - step_f)
        cp_bwd = layers * ((lay.cp - 1) * max(0.0, hop_b - 2 * step_f) + work.comm_time("p2p", block * 4, lay.cp, lay.tp))
        if lay.recompute == "full":
            cp_bwd += cp_fwd

    ranks = []
    for r in range(lay.pp):
        last = r == lay.pp - 1
        fwd = (layers * layer_fwd + (head_fwd if last else 0.0)) / rate
        rec = {"none": 0.0, "selective": layers * attn_fwd / rate if lay.cp == 1 else 0.0,
               "full": layers * layer_fwd / rate}[lay.recompute]
        messages = stage_messages(work, lay, r)
        ranks.append(_Rank(fwd=fwd, bwd=2 * fwd, recompute=rec, tp_fwd=tp_seconds(messages, "forward"),
                           tp_bwd=tp_seconds(messages, "backward"), cp_fwd=cp_fwd, cp_bwd=cp_bwd, weight_grads=fwd))
    _add_dp(work, lay, ranks)
    return ranks


def _add_dp(work: Workload, lay: Layout, ranks: list[_Rank]) -> None:
    """Gradient reduction and parameter gathering over dp x cp (the ranks that hold the same
    weights), by ZeRO stage: the bytes of analysis/messages.py, when they run and what hides them."""
    n = lay.dp * lay.cp
    if n == 1:
        return

    def t(op: str, nbytes: float) -> float:  # cp and dp are contiguous above tp: stride tp, size dp x cp
        return work.comm_time(op, nbytes, n, lay.tp)

    for r, rank in enumerate(ranks):
        sizes = data_parallel_bytes(work, lay, r)
        grads = 4 * rank_params(work, lay, r)
        last_bucket = t("all_reduce" if lay.zero == 0 else "reduce_scatter", min(BUCKET_BYTES, grads))
        # one micro-batch's backward (no dp part yet) to hide under, if collectives progress meanwhile
        background = work.topology.background
        window = rank.backward if background else 0.0
        if lay.zero == 0:  # DDP: one all-reduce, hidden under the last micro-batch's backward
            rank.dp_end = max(last_bucket, t("all_reduce", grads) - window)
        elif lay.zero == 1:  # reduce-scatter hidden like DDP's; the all-gather after AdamW is not
            rank.dp_end = max(last_bucket, t("reduce_scatter", grads) - window) + t("all_gather", sizes["step"]["all_gather"])
        elif lay.zero == 2:  # every micro-batch reduce-scatters (no no_sync), then the all-gather
            rank.dp_bwd = max(last_bucket, t("reduce_scatter", grads) - window)
            rank.dp_end = t("all_gather", sizes["step"]["all_gather"])
        else:  # ZeRO-3: gather before forward (prefetched), the blocks again before backward, reduce-scatter
            first_unit = t("all_gather", dtype_bytes(work, lay)[1] * block_params(work, lay))
            rank.dp_fwd = max(first_unit, t("all_gather", sizes["forward"]["all_gather"])
                              - (rank.forward if background else 0.0))
            rank.dp_bwd = max(last_bucket, t("all_gather", sizes["backward"]["all_gather"]) + t("reduce_scatter", grads)
                              - window)


def p2p_seconds(work: Workload, lay: Layout) -> float:
    """One micro-batch's activations (or their gradient) from one pipeline stage to the next; under
    SP each tp rank sends its sequence shard (pipeline/engine.py's sequence_shards)."""
    if lay.pp == 1:
        return 0.0
    return work.comm_time("p2p", boundary_bytes(work, lay), 2, lay.tp * lay.cp * lay.dp,  # pp: the outermost axis
                          neighbours=True)


def _pipeline(kind: str, pp: int, m: int, v: int, fwd: tuple, bwd: tuple, p2p: float, wf: float) -> float:
    """Step time of the pipeline's compute (per-chunk costs per rank) from the simulator, for m
    micro-batches: simulated up to m_sim (see SIM_MICROBATCHES_*), then extended at the steady
    state's own pace, measured over the second half of the simulated micro-batches (it is the
    slowest rank's busy time per micro-batch plus whatever P2P latency its loop waits on)."""
    m_sim = min(m, pp * max(SIM_MICROBATCHES_PER_STAGE, -(-SIM_MICROBATCHES_MIN // pp)))
    unit = max(fwd)

    def sim(n: int) -> float:  # cached on costs normalised to the slowest forward: layouts share shapes
        return _simulate(kind, pp, n, v, tuple(round(f / unit, 3) for f in fwd),
                         tuple(round(b / unit, 3) for b in bwd), round(p2p / unit, 3), round(wf, 2)) * unit

    if m == m_sim:
        return sim(m)
    half = m_sim // pp // 2 * pp  # whole rounds of pp (interleaved runs in rounds)
    per_microbatch = (sim(m_sim) - sim(m_sim - half)) / half
    return sim(m_sim) + (m - m_sim) * per_microbatch


@functools.lru_cache(maxsize=4096)
def _simulate(kind: str, pp: int, m: int, v: int, fwd: tuple, bwd: tuple, p2p: float, wf: float) -> float:
    return simulate_schedule(kind, pp, m, v, OpCosts(list(fwd), list(bwd), p2p, wf)).step_time


def defers_weight_grads(lay: Layout) -> bool:
    """Do the stages after the first defer their weight gradients to a flush (the default
    parallel.pp_defer_wgrad; tensor-parallel linears and ZeRO-2/3 never do; the memory model's
    memory_terms.deferred_wgrad_bytes says the same of a Config)?"""
    return lay.pp > 1 and lay.tp == 1 and lay.zero <= 1


def step_time(work: Workload, lay: Layout, simulate: bool = True) -> StepTime:
    """The predicted step. simulate=False: the pipeline's fill and drain from the lower bound
    max over ranks k of (k x (F+B)_min + busy_k), which the simulator's time never undercuts
    (without P2P latency); the planner orders candidates by it and simulates the promising ones."""
    ranks = rank_costs(work, lay)
    m = work.global_batch // (lay.dp * lay.micro_batch_size)
    v = lay.pp_virtual
    busy = [m * r.busy for r in ranks]
    pp_comm = 0.0
    if lay.pp == 1:
        pipe = busy[0]
    elif not simulate:
        # Rank k starts after k chunk forwards upstream; once its last input gradient is sent, the
        # k ranks upstream still run one chunk backward each (the deferring ones only its
        # input-gradient part; the first stage's, last of all, never defers), while rank k
        # flushes the weight gradients it deferred (one chunk of one micro-batch) beside them.
        defers = defers_weight_grads(lay)
        deferred = [r.weight_grads / v if defers else 0.0 for r in ranks]
        f_min = min(r.forward / v for r in ranks)
        b_min = min((r.busy - r.forward) / v - w for r, w in zip(ranks, deferred))
        pipe = max(busy[0], max(k * f_min + busy[k] - deferred[k] + max(k * b_min + deferred[0], deferred[k])
                                for k in range(1, lay.pp)))
    else:
        fwd = tuple(r.forward / v for r in ranks)
        bwd = tuple(r.backward / v for r in ranks)
        # meshlm defers weight gradients in pipelines with ZeRO 0/1 (parallel.pp_defer_wgrad),
        # of plain linears only (tensor-parallel layers keep their own backward)
        wf = ranks[0].weight_grads / ranks[0].backward if defers_weight_grads(lay) else 0.0
        p2p = p2p_seconds(work, lay)
        pipe = _pipeline(lay.pp_schedule, lay.pp, m, v, fwd, bwd, p2p, wf)
        # (max: deferred weight gradients can fill a P2P wait that would otherwise idle)
        pp_comm = max(0.0, pipe - _pipeline(lay.pp_schedule, lay.pp, m, v, fwd, bwd, 0.0, wf)) if p2p else 0.0
    dp_end = max(r.dp_end for r in ranks)
    total = pipe + dp_end
    parts = dict(compute_s=mean([m * (r.fwd + r.bwd) for r in ranks]),
                 recompute_s=mean([m * r.recompute for r in ranks]),
                 tp_comm_s=mean([m * (r.tp_fwd + r.tp_bwd) for r in ranks]),
                 cp_comm_s=mean([m * (r.cp_fwd + r.cp_bwd) for r in ranks]),
                 dp_comm_s=mean([m * (r.dp_fwd + r.dp_bwd) for r in ranks]) + dp_end)
    bubble = max(0.0, pipe - pp_comm - mean(busy))
    tokens = work.global_batch * work.seq
    peak = work.gpu.peak_tflops(work.dtype) * 1e12
    return StepTime(step_time_s=total, pp_comm_s=pp_comm, bubble_s=bubble,
                    mfu=work.model_flops / (total * work.n_gpus * peak), tokens_per_s=tokens / total,
                    microbatches=m, **parts)

