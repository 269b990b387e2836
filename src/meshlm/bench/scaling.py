"""`meshlm bench scaling --nproc 1,2,4,8 [--mode weak|strong] [--json] [--plot FILE.png]`: how
meshlm's DDP, ZeRO-3 and TP scale with the world size, beside PyTorch's own and the cost model.
Reduces: guessing where scaling breaks and whose fault it is (the engine, the machine, the model).
Costs: about a minute of the machine per W (tiny preset, 8 x 128 tokens per rank, 6 pairs).

At each world size W (forked gloo ranks on the CPU, one thread each, a fresh process group per W)
three pairs run, each alternating meshlm and the reference step by step (bench/timing.py):
  ddp    meshlm DDP (zero=0)   vs torch DistributedDataParallel   (bench dp's engines)
  zero3  meshlm ZeRO-3         vs fully_shard                      (bench dp's engines)
  tp     meshlm TP+SP (tp=W)   vs DTensor TP+SequenceParallel      (bench tp's engines), where W
         divides the heads; other W are skipped with the reason.
Weak scaling (default): a fixed batch per rank, the global batch grows with W (a TP group of W
ranks trains the W x batch sequences together). Strong: a fixed global batch split over W.

Per point: tokens/s (the global batch over the slowest rank's step, median of the pairs);
scaling efficiency = tokens/s / (W x the one-rank tokens/s), the one-rank point being the plain
model with AdamW on one rank (no wrapper, no communication) at W=1's batch, the same for every
series, so efficiencies compare like throughputs (for strong scaling this is speedup / W); the
same for that plain model on every rank at W (compute only: the machine's ceiling); the exposed-
communication share (meshlm: host seconds blocked in collectives, from the flight recorder, over
the step; torch's collectives are invisible to the host, so for DDP/fully_shard the share is
bounded by the step minus its compute-only twin, and for DTensor it is null); the alpha-beta
model's prediction (analysis/steptime.py, comm/cost.py's links, compute calibrated on the
one-rank point: FLOP/s = model FLOPs per step / its time). A CPU point with W > the cores this
process may run on (`usable_cores`) is oversubscribed: ranks share cores, which the model does not
know; the output says so.
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass

import torch.distributed as dist

from meshlm.bench.dp import reference_label
from meshlm.bench.report import (first_sentence, bench_row, below_minimum, cpu_times, emit, load_average,
                                  parse_args, prepare_cpu_rank, steal_fraction, usable_cores)
from meshlm.bench.timing import alternate, exposed_share, measured_peak, random_batch
from meshlm.errors import OneLineErrorParser, unwritable

# engine -> (meshlm's label, the reference, the ZeRO stage of bench dp's engines; None: TP)
ENGINES = {"ddp": ("meshlm DDP", "torch DDP", 0), "zero3": ("meshlm ZeRO-3", "fully_shard", 3),
           "tp": ("meshlm TP+SP", "DTensor TP+SequenceParallel", None)}
DTENSOR_EXPOSED_REASON = ("DTensor's collectives run inside its dispatch, out of the host's sight, and a TP rank has "
                          "no compute-only twin to subtract (each computes 1/W of the model)")


# --------------------------------------------------------------------------- pure arithmetic


def scaling_efficiency(tokens_per_s: float, world_size: int, one_rank_tokens_per_s: float) -> float:
    """tokens/s / (W x one-rank tokens/s). Weak scaling (fixed batch per rank): 1.0 when W ranks
    do W times the work of one in the same time. Strong (fixed global batch; the one-rank point
    trains that whole batch): the same ratio is speedup / W."""
    return tokens_per_s / (world_size * one_rank_tokens_per_s)


def oversubscribed(world_size: int, cores: int | None) -> bool:
    """More ranks than CPU cores: they take turns on cores, so the point measures the CPU."""
    return cores is not None and world_size > cores


def oversubscription_note(world_sizes: list[int], cores: int | None) -> str | None:
    """One line naming the oversubscribed world sizes, or None when every W has its core(s)."""
    over = [w for w in world_sizes if oversubscribed(w, cores)]
    if not over:
        return None
    return (f"W={', '.join(map(str, over))} > {cores} CPU cores: oversubscribed (ranks share cores); tokens/s and "
            f"efficiency there measure the CPU, not the parallelism, and the model assumes a core per rank")


def global_rows(mode: str, world_size: int, batch: int, global_batch: int) -> int:
    """Sequences per step, all ranks together: batch x W (weak) or the fixed global batch (strong)."""
    return batch * world_size if mode == "weak" else global_batch


# --------------------------------------------------------------------------- the model's prediction


@dataclass(frozen=True)
class CalibratedDevice:
    """What steptime.Workload asks of a GPU, from measurements: a 'peak' that the model's
    COMPUTE_EFFICIENCY scales back to the measured FLOP rate, and the links (a comm profile)."""

    flop_rate: float
    links: object  # comm.cost.Topology

    def peak_tflops(self, dtype: str = "float32") -> float:
        from meshlm.analysis.steptime import COMPUTE_EFFICIENCY

        return self.flop_rate / COMPUTE_EFFICIENCY / 1e12

    def topology(self, gpus_per_node: int | None = None):
        return self.links


def predict(engine: str, model_cfg, seq: int, rows: int, world: int, device: CalibratedDevice):
    """analysis/steptime.py's StepTime of one point (fp32; TP is priced with SP, as it runs)."""
    from meshlm.analysis.steptime import Layout, Workload, step_time

    tp = world if engine == "tp" else 1
    dp = world // tp
    lay = Layout(dp=dp, tp=tp, pp=1, cp=1, zero=ENGINES[engine][2] or 0, recompute="none",
                 micro_batch_size=rows // dp)
    return step_time(Workload(model_cfg, seq, rows, "float32", device, world, world), lay)


# --------------------------------------------------------------------------- one world size (every rank)


def _world_rank(p: dict) -> dict:
    """Every engine pair at this world size; rank 0's measurements (seconds, blocked, peaks)."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshlm.bench.dp import Engine, fresh_peak_bytes
    from meshlm.bench.tp import TensorParallelEngine
    from meshlm.comm import Comm
    from meshlm.mesh import Layout, ParallelContext

    world, rank = dist.get_world_size(), dist.get_rank()
    ctx = ParallelContext(Layout(dp=world))
    comm, device, cfg = Comm(ctx), ctx.device, p["cfg"]
    prepare_cpu_rank(rank, device)
    vocab, seq, rows, bucket = cfg.model.vocab_size, p["seq"], p["rows"], p["bucket_mb"]

    def dp_batch(i):
        return random_batch(i, rows, seq, vocab, device, (rank, world))

    out = {}
    compute = {"compute": Engine("compute", 0, cfg, comm, device)}  # timed beside the first DP pair
    for name in [e for e in p["engines"] if e != "tp"]:
        zero = ENGINES[name][2]
        engines = {k: Engine(k, zero, cfg, comm, device, bucket, reference_model=p["reference_model"])
                   for k in ("meshlm", "reference")}
        out[name] = alternate({**engines, **compute}, dp_batch, comm, device, p["warmup"], p["steps"])
        if compute:
            out["compute"], compute = out[name].pop("compute"), {}
        del engines
        out[name]["peaks"] = {k: fresh_peak_bytes(k, zero, cfg, comm, device, bucket, dp_batch(1), dp_batch(0),
                                                  p["reference_model"]) for k in ("meshlm", "reference")}
    if compute:  # TP alone still needs the compute-only step (at W=1: the baseline)
        out["compute"] = alternate(compute, dp_batch, comm, device, p["warmup"], p["steps"])["compute"]
    if p["tp"]:
        ctx_tp = ParallelContext(Layout(tp=world))
        comm_tp = Comm(ctx_tp)
        mesh = init_device_mesh(device.type, (world,))
        engines = {k: TensorParallelEngine(k + "+sp", cfg.model, comm_tp, mesh, device) for k in ("meshlm", "dtensor")}

        def tp_batch(i):
            return random_batch(i, rows, seq, vocab, device)

        out["tp"] = alternate(engines, tp_batch, comm_tp, device, p["warmup"], p["steps"])
        out["tp"]["reference"] = out["tp"].pop("dtensor")
        out["tp"]["peaks"] = {k: measured_peak(e, tp_batch(0), comm_tp, device)
                              for k, e in zip(("meshlm", "reference"), engines.values())}
    return out if rank == 0 else {}


# --------------------------------------------------------------------------- rows


def point_rows(world: int, raw: dict, opts, base_tokens_per_s: float, device: CalibratedDevice,
               cores: int | None) -> list[dict]:
    """DESIGN.md bench rows for one world size from `_world_rank`'s measurements."""
    rows_ = global_rows(opts.mode, world, opts.batch, opts.global_batch)
    tokens = rows_ * opts.seq
    compute_s = statistics.median(t.step_s for t in raw["compute"])
    out = []
    for engine in [e for e in opts.engines if e in raw]:
        r = raw[engine]
        label, reference, _ = ENGINES[engine]
        if engine != "tp":  # DTensor TP always runs meshlm's Llama (its plan names meshlm's modules)
            reference = reference_label(reference, opts.reference_model)
        m_s, r_s = statistics.median(t.step_s for t in r["meshlm"]), statistics.median(t.step_s for t in r["reference"])
        predicted = predict(engine, opts.cfg.model, opts.seq, rows_, world, device)
        row = bench_row(
            f"{engine}-w{world}", world, reference, [tokens / t.step_s for t in r["meshlm"]],
            [tokens / t.step_s for t in r["reference"]], r["peaks"]["meshlm"], r["peaks"]["reference"],
            engine=engine, meshlm=label, mode=opts.mode, preset=opts.preset, seq_len=opts.seq, global_batch=rows_,
            oversubscribed=oversubscribed(world, cores), cpu_count=cores,
            meshlm_step_s=m_s, reference_step_s=r_s, compute_only_step_s=compute_s)
        dp_engine = engine != "tp"
        row.update(
            meshlm_efficiency=scaling_efficiency(row["meshlm_tokens_per_s"], world, base_tokens_per_s),
            reference_efficiency=scaling_efficiency(row["reference_tokens_per_s"], world, base_tokens_per_s),
            meshlm_exposed_comm_share=statistics.median(t.blocked_s / t.step_s for t in r["meshlm"]),
            meshlm_exposed_comm_method="flight recorder blocked_s / step",
            # Of which at the shared-memory barriers: mostly waiting for the slowest rank (skew
            # between ranks, which the alpha-beta prediction leaves out), not moving bytes.
            meshlm_peer_wait_share=statistics.median(t.peer_wait_s / t.step_s for t in r["meshlm"]),
            meshlm_exposed_comm_share_by_subtraction=exposed_share(m_s, compute_s) if dp_engine else None,
            reference_exposed_comm_share=exposed_share(r_s, compute_s) if dp_engine else None,
            reference_exposed_comm_method=("(step - compute-only step) / step, an upper bound" if dp_engine
                                           else f"null: {DTENSOR_EXPOSED_REASON}"),
            predicted_tokens_per_s=predicted.tokens_per_s,
            predicted_efficiency=scaling_efficiency(predicted.tokens_per_s, world, base_tokens_per_s),
            predicted_exposed_comm_share=predicted.exposed_comm_s / predicted.step_time_s,
            # The same per-rank work with no communication at all: the machine's own ceiling at W.
            compute_only_tokens_per_s=tokens / compute_s,
            compute_only_efficiency=scaling_efficiency(tokens / compute_s, world, base_tokens_per_s))
        out.append(row)
    return out


def format_table(rows: list[dict]) -> str:
    def pct(v):
        return "   n/a" if v is None else f"{100 * v:5.1f}%"

    lines = [f"{'W':>2} {'engine':<6} {'meshlm tok/s':>12} {'eff':>6} {'exposed':>7} {'(skew)':>6} | {'reference':<27} "
             f"{'tok/s':>9} {'eff':>6} {'exposed':>7} | {'ratio':>5} | {'predicted':>9} {'eff':>6} {'exposed':>7} | note"]
    for r in rows:
        lines.append(
            f"{r['world_size']:>2} {r['engine']:<6} {r['meshlm_tokens_per_s']:>12,.0f} {pct(r['meshlm_efficiency'])} "
            f"{pct(r['meshlm_exposed_comm_share']):>7} {pct(r['meshlm_peer_wait_share'])} | {r['reference']:<27} "
            f"{r['reference_tokens_per_s']:>9,.0f} {pct(r['reference_efficiency'])} "
            f"{pct(r['reference_exposed_comm_share']):>7} | "
            f"{r['tokens_per_s_ratio']:>5.2f} | {r['predicted_tokens_per_s']:>9,.0f} {pct(r['predicted_efficiency'])} "
            f"{pct(r['predicted_exposed_comm_share']):>7} | " + ("oversubscribed" if r["oversubscribed"] else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def _parse(argv):
    p = OneLineErrorParser(prog="meshlm bench scaling", description=first_sentence(__doc__))
    p.add_argument("--nproc", default="1,2,4,8", help="comma-separated world sizes (W=1 is always measured)")
    p.add_argument("--mode", choices=("weak", "strong"), default="weak")
    p.add_argument("--engines", default="ddp,zero3,tp", help="comma-separated: ddp, zero3, tp")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank (weak scaling)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step, all ranks (strong scaling; default batch x the largest W)")
    p.add_argument("--steps", type=int, default=6, help="timed pairs per engine and W")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--profile", help="links for the prediction: a `meshlm bench comm --save-profile` file "
                                     "(default: the cpu-shm preset; cpu-loopback with MESHLM_SHM_DISABLE=1)")
    p.add_argument("--reference-model", choices=("meshlm", "transformers"), default="meshlm",
                   help="the model torch DDP and fully_shard run (DTensor TP keeps meshlm's Llama): meshlm's "
                        "(default) or transformers' LlamaForCausalLM with the same weights")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--json", action="store_true")
    opts = p.parse_args(argv)
    try:
        worlds = sorted({int(w) for w in opts.nproc.split(",")})
    except ValueError:
        p.error(f"--nproc: expected comma-separated world sizes, got {opts.nproc!r}")
    names = opts.engines.split(",")
    if not names or any(n not in ENGINES for n in names):
        p.error(f"--engines: choose from {', '.join(ENGINES)}, got {opts.engines!r}")
    opts.engines = [e for e in ENGINES if e in names]
    if worlds[0] < 1:
        p.error(f"--nproc: world sizes must be >= 1, got {opts.nproc!r}")
    problem = below_minimum(opts, {"steps": 1, "batch": 1, "seq": 1, "warmup": 0})
    if problem is None and opts.global_batch is not None:  # 0 would once silently become the default
        problem = below_minimum(opts, {"global_batch": 1})
    if problem:
        p.error(problem)
    problem = unwritable(opts.plot, "--plot")
    if problem:
        p.error(problem)
    opts.added_one = 1 not in worlds
    opts.worlds = sorted({1, *worlds})
    if opts.global_batch is None:
        opts.global_batch = opts.batch * opts.worlds[-1]
    if opts.mode == "strong":
        bad = [w for w in opts.worlds if opts.global_batch % w]
        if bad:
            p.error(f"--global-batch: {opts.global_batch} sequences do not split over W={bad[0]} ranks")
    return opts


def _preload(reference_model: str) -> None:
    """Import what the ranks use before forking them: each W's ranks inherit it instead of
    importing it again."""
    if reference_model == "transformers":
        import transformers.models.llama  # noqa: F401  (seconds per rank otherwise)
    import torch._dynamo  # noqa: F401  (torch.optim's first optimizer imports it: 1-2 s per rank)
    import torch.distributed.algorithms.ddp_comm_hooks  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import meshlm.bench.dp  # noqa: F401
    import meshlm.bench.tp  # noqa: F401
    import meshlm.parallel.data_parallel  # noqa: F401
    import meshlm.parallel.ddp  # noqa: F401
    import meshlm.parallel.fsdp  # noqa: F401
    import meshlm.parallel.tensor  # noqa: F401


def _tp_skips(opts, base: list[str]) -> dict[int, str]:
    """W -> why meshlm TP cannot run at W (config validation's own words); W=1 always can."""
    from meshlm.config import ConfigError, load_config, resolve

    skips = {}
    for w in (w for w in opts.worlds if w > 1 and "tp" in opts.engines):
        try:
            resolve(load_config(None, base + [f"parallel.tp={w}", "parallel.sp=true"]), world_size=w)
        except ConfigError as e:
            skips[w] = str(e)
    return skips


def main(argv: list[str] | None = None) -> int:
    opts, code = parse_args(_parse, argv)
    if opts is None:
        return code
    if "RANK" in os.environ:
        print("meshlm bench scaling: it starts its own ranks for each world size; run it without torchrun",
              file=sys.stderr)
        return 2
    from meshlm.analysis.flops import flops_per_token
    from meshlm.comm.cost import HARDWARE, load_profile
    from meshlm.config import ConfigError, load_config, resolve
    from meshlm.testing import run_ranks

    base = [f"model.preset={opts.preset}", "model.tie_embeddings=false", f"train.seq_len={opts.seq}"]
    try:  # untied embeddings for every engine: DTensor cannot keep one Parameter sharded for two modules
        opts.cfg = resolve(load_config(None, base))
        # forked ranks share this host: meshlm's collectives go through shared memory, unless disabled
        local = "cpu-shm" if os.environ.get("MESHLM_SHM_DISABLE", "0") in ("", "0") else "cpu-loopback"
        try:
            links = load_profile(opts.profile) if opts.profile else HARDWARE[local]
        except (OSError, KeyError, ValueError) as e:
            raise ConfigError(f"--profile: cannot read {opts.profile}: {e}") from None
    except ConfigError as e:
        print(f"meshlm bench scaling: error: {e}", file=sys.stderr)
        return 2
    skips = _tp_skips(opts, base)
    cores = usable_cores()
    _preload(opts.reference_model)
    before, raw = cpu_times(), {}
    for w in opts.worlds:
        params = dict(cfg=opts.cfg, seq=opts.seq, rows=global_rows(opts.mode, w, opts.batch, opts.global_batch),
                      bucket_mb=opts.bucket_mb, engines=opts.engines, warmup=opts.warmup, steps=opts.steps,
                      tp="tp" in opts.engines and w not in skips, reference_model=opts.reference_model)
        raw[w] = run_ranks(_world_rank, w, params, timeout=3600)[0]
    steal = steal_fraction(before, cpu_times())
    rows1 = global_rows(opts.mode, 1, opts.batch, opts.global_batch)
    base_tps = rows1 * opts.seq / statistics.median(t.step_s for t in raw[1]["compute"])
    device = CalibratedDevice(flops_per_token(opts.cfg.model, opts.seq) * base_tps, links)
    rows = [row for w in opts.worlds for row in point_rows(w, raw[w], opts, base_tps, device, cores)]
    notes = [f"one-rank point (every efficiency's denominator): the plain model + AdamW on 1 rank, {rows1} x "
             f"{opts.seq} tokens per step, {base_tps:,.0f} tokens/s"
             + (" (W=1 was added to --nproc for it)" if opts.added_one else ""),
             f"predicted: analysis/steptime.py, compute calibrated on the one-rank point "
             f"({device.flop_rate / 1e9:.2f} GFLOP/s of model FLOPs), links '{links.name}'",
             "exposed communication: meshlm from its flight recorder (time blocked in collectives / step; "
             "(skew): the part spent at the shared-memory barriers, mostly waiting for the slowest rank, which "
             "the prediction leaves out); torch DDP / fully_shard: (step - compute-only step) / step, an upper "
             "bound; DTensor: null"]
    ceiling = {r["world_size"]: r["compute_only_efficiency"] for r in rows}
    notes.append("compute-only efficiency (each rank's work with no communication, the machine's own ceiling): "
                 + ", ".join(f"W={w} {100 * e:.1f}%" for w, e in ceiling.items()))
    notes += [f"tp skipped at W={w}: {why}" for w, why in skips.items()]
    over = oversubscription_note(opts.worlds, cores)
    notes += [over] if over else []
    extra = dict(bench="scaling", mode=opts.mode, preset=opts.preset, seq_len=opts.seq,
                 batch_per_rank=opts.batch if opts.mode == "weak" else None,
                 global_batch=opts.global_batch if opts.mode == "strong" else None, cpu_count=cores,
                 baseline_tokens_per_s=base_tps, prediction={"flop_rate": device.flop_rate, "links": links.name},
                 notes=notes, plot=opts.plot, load_average=load_average(), cpu_steal_fraction=steal)
    if opts.json:
        emit(rows, True, **extra)
    else:
        print(format_table(rows))
        for line in notes + ([f"plot: {opts.plot}"] if opts.plot else []):
            print(f"note: {line}")
        load = extra["load_average"]
        print(f"note: load average {' '.join(f'{v:.2f}' for v in load) if load else 'n/a'}, CPU steal "
              f"{'n/a' if steal is None else f'{100 * steal:.1f}%'}")
    if opts.plot:  # last: a plotting failure must not lose the measurements printed above
        title = (f"meshlm bench scaling, {opts.mode} ({opts.preset}, "
                 + (f"{opts.batch} x {opts.seq} tokens per rank" if opts.mode == "weak"
                    else f"{opts.global_batch} x {opts.seq} tokens per step") + f", {cores} CPU cores)")
        from meshlm.bench.scaling_plot import plot

        plot(rows, opts.plot, cores, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
