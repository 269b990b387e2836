"""`meshlm plan`'s output: the ranked table, the JSON object, the `meshlm train` keys of a layout.
Reduces: reading a plan; every number the search produced, per layout, with the command to run it.
Costs: nothing (formatting).
"""

from __future__ import annotations

from meshlm.analysis.plan import Candidate, Plan, plan, workload
from meshlm.analysis.steptime import COMPUTE_EFFICIENCY, Layout, Workload
from meshlm.config import ConfigError


def overrides(work: Workload, lay: Layout) -> list[str]:
    """The `meshlm train` keys that run this layout."""
    out = [f"model.preset={work.model.preset}", f"train.seq_len={work.seq}",
           f"train.global_batch_size={work.global_batch}", f"train.micro_batch_size={lay.micro_batch_size}",
           f"train.dtype={work.dtype}", f"parallel.dp={lay.dp}",
           f"parallel.tp={lay.tp}", f"parallel.pp={lay.pp}", f"parallel.cp={lay.cp}", f"parallel.zero={lay.zero}"]
    if lay.recompute != "none":  # (the default; `key=none` would be read as an unset value)
        out.append(f"train.recompute={lay.recompute}")
    if lay.sp:
        out.append("parallel.sp=true")
    if lay.pp > 1:
        out.append(f"parallel.pp_schedule={lay.pp_schedule}")
        if lay.pp_virtual > 1:
            out.append(f"parallel.pp_virtual={lay.pp_virtual}")
    return out


def as_dict(c: Candidate, work: Workload, recommended: bool = False) -> dict:
    lay, t = c.layout, c.time
    return {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "zero": lay.zero, "recompute": lay.recompute,
            "micro_batch_size": lay.micro_batch_size, "memory_bytes": c.memory_bytes,
            "step_time_s": round(t.step_time_s, 4), "mfu": round(t.mfu, 4), "bottleneck": t.bottleneck,
            "recommended": recommended, "sp": lay.sp,
            "pp_schedule": lay.pp_schedule, "pp_virtual": lay.pp_virtual, "microbatches": t.microbatches,
            "tokens_per_s": round(t.tokens_per_s, 1), "exposed_comm_s": round(t.exposed_comm_s, 4),
            "bubble": round(t.bubble_fraction, 4),
            "breakdown_s": {k: round(v, 4) for k, v in (("compute", t.compute_s), ("recompute", t.recompute_s),
                            ("tp_comm", t.tp_comm_s), ("cp_comm", t.cp_comm_s), ("pp_comm", t.pp_comm_s),
                            ("dp_comm", t.dp_comm_s), ("bubble", t.bubble_s))},
            "overrides": overrides(work, lay)}


def to_json(p: Plan) -> dict:
    w = p.work
    return {"model": w.model.preset, "gpus": w.n_gpus, "gpus_per_node": w.gpus_per_node, "gpu": w.gpu.name,
            "seq": w.seq, "global_batch": w.global_batch, "dtype": w.dtype,
            "compute_efficiency": COMPUTE_EFFICIENCY, "peak_tflops": w.gpu.peak_tflops(w.dtype),
            "memory_limit_bytes": w.gpu.usable_bytes, "enumerated": p.enumerated, "memory_checked": p.memory_checked,
            "layouts": [as_dict(c, w, i == 0) for i, c in enumerate(p.layouts)]}


def format_plan(p: Plan) -> str:
    w = p.work
    gib = 2**30
    lines = [f"meshlm plan: {w.model.preset} on {w.n_gpus} x {w.gpu.name} ({w.gpus_per_node} per node), "
             f"seq {w.seq}, global batch {w.global_batch} ({w.global_batch * w.seq / 1e6:.1f}M tokens), {w.dtype}",
             f"compute at {COMPUTE_EFFICIENCY:.0%} of {w.gpu.peak_tflops(w.dtype):.0f} TFLOP/s; memory limit "
             f"{w.gpu.usable_bytes / gib:.1f} of {w.gpu.memory_bytes / gib:.1f} GiB per GPU; {p.enumerated} layouts, "
             f"{p.memory_checked} memory-checked",
             f"{'#':>2} {'dp':>3} {'tp':>2} {'pp':>2} {'cp':>2} {'schedule':<15} {'zero':>4} {'recompute':<9} {'mbs':>3} "
             f"{'memory':>9} {'step':>8} {'MFU':>6} {'tokens/s':>9} {'exposed comm':>13} {'bubble':>6}  bottleneck"]
    for i, c in enumerate(p.layouts):
        lay, t = c.layout, c.time
        sched = "-" if lay.pp == 1 else lay.pp_schedule + (f" v={lay.pp_virtual}" if lay.pp_virtual > 1 else "")
        comm = f"{t.exposed_comm_s:.2f}s {t.exposed_comm_s / t.step_time_s:>3.0%}"
        lines.append(f"{i + 1:>2} {lay.dp:>3} {lay.tp:>2} {lay.pp:>2} {lay.cp:>2} {sched:<15} {lay.zero:>4} "
                     f"{lay.recompute:<9} {lay.micro_batch_size:>3} {c.memory_bytes / gib:>5.1f} GiB "
                     f"{t.step_time_s:>7.2f}s {t.mfu:>6.1%} {_si(t.tokens_per_s):>9} {comm:>13} "
                     f"{t.bubble_fraction:>6.1%}  {t.bottleneck}")
    lines += [f"note: {n}" for n in p.notes]
    lines.append("run #1: meshlm train " + " ".join(overrides(w, p.layouts[0].layout)))
    return "\n".join(lines)


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def run(args) -> int:
    """`meshlm plan` (cli.py parses the flags): print the plan, or its JSON with --json."""
    import json

    if args.top < 1:
        raise ConfigError(f"--top: must be >= 1, got {args.top}")
    work = workload(args.model, args.gpus, args.gpus_per_node, args.gpu, args.seq, args.global_batch, args.dtype)
    result = plan(work, args.top)
    print(json.dumps(to_json(result), indent=2) if args.json else format_plan(result))
    return 0
