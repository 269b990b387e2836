"""`meshlm bench comm`: measure the collectives on this backend and world size, fit alpha and beta.

Reduces: guessing; it calibrates the cost model and shows prediction next to measurement.
Costs: about half a minute of the machine with the default sizes (1 KiB to 64 MiB).

Run as `meshlm bench comm [--nproc N] [--json]` (forks N local ranks on gloo) or under torchrun
(`torchrun --nproc-per-node 8 -m meshlm.comm.bench`), which uses that world and its backend.
`--transport meshlm` times what meshlm's `Comm` runs instead of the library's ops (on gloo: the
shared-memory collectives on one host, the P2P rings across hosts).
Timing: each trial starts with a barrier and runs up to `--max-iters` ops back to back, each
timed on its own; a rank's time is the median over all its ops, and the reported time is the
slowest rank's (a collective ends when its last rank does). Medians, not nccl-tests' means,
because a shared 2-core machine stalls a few ops for whole scheduler ticks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist

from meshlm.comm.cost import (HARDWARE, Link, Topology, bus_factor, fit_alpha_beta, load_profile, op_time,
                              save_profile, steps)
from meshlm.comm.recorder import FlightRecorder
from meshlm.errors import OneLineErrorParser, unwritable
from meshlm.comm.traced import P2P, Comm, all_gather_single, reduce_scatter_single
from meshlm.mesh import Layout, ParallelContext, default_backend

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
FIT_CHECK_MIN_BYTES = 64 * 1024  # the fit is judged on messages >= 64 KiB (below, latency noise rules)
# A fitted (alpha, beta) passes through any two sizes exactly: judged on the sizes it was fitted
# to, it needs a third before its error says anything (a saved --profile is judged on any).
FIT_CHECK_MIN_SIZES = 3


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64K, 1M)")
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()]


def default_sizes(lo: int, hi: int) -> list[int]:
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= 2
    return sizes


# --------------------------------------------------------------------------- measuring (every rank)


def _make_op(op: str, nbytes: int, n: int, rank: int, device: torch.device, comm: Comm | None = None):
    """A closure running one `op` with message size ~nbytes (float32, rounded to a multiple of n):
    the library's op, or with `comm` what meshlm's `Comm` runs for it (the transport option)."""
    numel = max(n, nbytes // 4 // n * n)
    x = torch.randn(numel, device=device)
    y = torch.empty(numel, device=device)
    part = torch.empty(numel // n, device=device)
    if comm is not None:
        return {"all_reduce": lambda: comm.all_reduce(x, "world"),
                "all_gather": lambda: comm.all_gather(y, part, "world"),
                "reduce_scatter": lambda: comm.reduce_scatter(part, x, "world"),
                "all_to_all": lambda: comm.all_to_all(y, x, "world"),
                "p2p": lambda: comm.batch_isend_irecv([P2P("send", x, (rank + 1) % n),
                                                       P2P("recv", y, (rank - 1) % n)]).wait()}[op], numel
    if op == "all_reduce":
        return (lambda: dist.all_reduce(x)), numel
    if op == "all_gather":
        return (lambda: all_gather_single(y, part)), numel
    if op == "reduce_scatter":
        return (lambda: reduce_scatter_single(part, x)), numel
    if op == "all_to_all":
        return (lambda: dist.all_to_all_single(y, x)), numel
    if op == "p2p":  # every rank sends S to the next and receives S from the previous, at once
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % n), dist.P2POp(dist.irecv, y, (rank - 1) % n)]
        return (lambda: [w.wait() for w in dist.batch_isend_irecv(ops)]), numel
    raise ValueError(op)


def _timed(fn, iters: int, trials: int, device: torch.device) -> float:
    """Median of every op's own time on this rank, then the slowest rank's median.

    nccl-tests averages back-to-back iterations; on a shared 2-core VM a few ops stall for a
    4 ms scheduler tick and an average would report the stalls, so each op is timed on its own
    and the median kept. On a GPU each op is synchronised, which adds the launch latency."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up: connections, buffers, NCCL communicators
    sync()
    samples = []
    for _ in range(trials):
        dist.barrier()
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - t0)
    mine = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
    return mine.item()


def _tracing_overhead(ctx: ParallelContext, iters: int = 400) -> dict:
    """Two numbers: the Python bookkeeping the traced layer adds per op (measured without the
    communication, so it is exact) and traced minus raw for a 4-byte all_reduce (which includes
    the machine's noise). Interleaved blocks, so both see the same machine state."""
    x = torch.zeros(1, device=ctx.device)
    # Tracing around the library's op, as the raw loop below calls it (not meshlm's shared memory).
    traced_comm = Comm(ctx, FlightRecorder(ctx.rank, capacity=64), shared_memory_ok=False)
    # The traced path with the library call replaced by a no-op, in this rank process only and only
    # for this loop: exactly the work tracing adds, with no communication noise in it.
    with mock.patch.object(dist, "all_reduce", lambda *args, **kwargs: None):
        t0 = time.perf_counter()
        for _ in range(20000):
            traced_comm.all_reduce(x, "world")
        bookkeeping = (time.perf_counter() - t0) / 20000
    traced, raw = [], []
    for _ in range(iters // 20):
        for samples, call in ((raw, lambda: dist.all_reduce(x)), (traced, lambda: traced_comm.all_reduce(x, "world"))):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(20):
                call()
            samples.append((time.perf_counter() - t0) / 20)
    q1, _, q3 = statistics.quantiles(raw, n=4)
    return {"bookkeeping_s": bookkeeping, "raw_all_reduce_s": statistics.median(raw),
            "traced_all_reduce_s": statistics.median(traced),
            "traced_minus_raw_s": statistics.median(traced) - statistics.median(raw),
            "raw_iqr_s": q3 - q1}


def _bench_rank(opts: dict) -> dict:
    ctx = ParallelContext(Layout(dp=dist.get_world_size()))
    n, rank, device = ctx.world_size, ctx.rank, ctx.device
    rows = []
    comm = Comm(ctx, FlightRecorder(rank, capacity=64)) if opts["transport"] == "meshlm" else None
    for op in opts["ops"]:
        for nbytes in opts["sizes"]:
            fn, numel = _make_op(op, nbytes, n, rank, device, comm)
            # More samples of the cheap, noisy small messages; one op per trial for the large ones.
            iters = max(1, min(opts["max_iters"], (4 << 20) // (numel * 4)))
            seconds = _timed(fn, iters, opts["trials"], device)
            rows.append({"op": op, "bytes": numel * 4, "count": numel, "world_size": n, "time_s": seconds})
            del fn
    overhead = _tracing_overhead(ctx) if opts["overhead"] else None
    return {"rows": rows, "backend": ctx.backend, "device": str(device), "tracing_overhead": overhead,
            "transport": "library" if comm is None else "meshlm",
            "meshlm_ops": 0 if comm is None else sum(r["count"] for r in comm.summary()),
            "shared_memory": comm is not None and comm.uses_shared_memory("world")}


# --------------------------------------------------------------------------- fitting and reporting


def analyse(result: dict, model: Topology | None = None) -> dict:
    """Fit (alpha, beta) per op, predict every row (with `model` instead, if given), and score."""
    rows = result["rows"]
    n = rows[0]["world_size"]
    fits = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        fits[op] = fit_alpha_beta(op, n, [r["bytes"] for r in mine], [r["time_s"] for r in mine])
    link = fits.get("p2p")
    for r in rows:
        S, t = r["bytes"], r["time_s"]
        r["name"] = f"{r['op']}/{S}"
        r["algbw"] = S / t
        r["busbw"] = r["algbw"] * bus_factor(r["op"], n)
        r["predicted_time_s"] = model.time(r["op"], S, n) if model else op_time(r["op"], S, n, fits[r["op"]])
        r["rel_err"] = (r["predicted_time_s"] - t) / t
        # What an ideal ring on the measured P2P link would take: the gap is the library's own cost.
        r["ideal_ring_time_s"] = op_time(r["op"], S, n, link) if link else None
        # The bench schema every `meshlm bench --json` row carries (DESIGN.md): a collective moves
        # bytes, not tokens, and is compared with the cost model, not with another implementation,
        # so the paired fields are present and null.
        r.update(dict.fromkeys(("meshlm_tokens_per_s", "reference", "reference_tokens_per_s", "tokens_per_s_ratio",
                                "meshlm_peak_bytes", "reference_peak_bytes", "memory_ratio")))

    def median_err(rs):
        judged = [r for r in rs if r["bytes"] >= FIT_CHECK_MIN_BYTES]
        if model is None:  # in sample: only ops with enough sizes above the floor
            sizes = {op: {q["bytes"] for q in judged if q["op"] == op} for op in fits}
            judged = [r for r in judged if len(sizes[r["op"]]) >= FIT_CHECK_MIN_SIZES]
        errs = [abs(r["rel_err"]) for r in judged]
        return statistics.median(errs) if errs else None

    return {
        "rows": rows, "world_size": n, "backend": result["backend"], "device": result["device"],
        "transport": result.get("transport", "library"), "meshlm_ops": result.get("meshlm_ops", 0),
        "shared_memory": result.get("shared_memory", False),
        "model": model.name if model else "fit",
        "fit": {op: {"alpha_s": f.alpha_s, "beta_s_per_byte": 1 / f.bandwidth_Bps, "busbw_Bps": f.bandwidth_Bps}
                for op, f in fits.items()},
        "median_rel_err_ge_64KiB": median_err(rows),
        "median_rel_err_ge_64KiB_by_op": {op: median_err([r for r in rows if r["op"] == op]) for op in fits},
        "tracing_overhead": result["tracing_overhead"], "load_average": result.get("load_average"),
        "cpu_count": os.cpu_count(), "_links": fits,
    }


def format_table(report: dict) -> str:
    n = report["world_size"]
    transport = " (meshlm's Comm)" if report.get("transport") == "meshlm" else ""
    lines = [f"# meshlm bench comm: {report['backend']}{transport} on {report['device']}, {n} ranks, float32",
             "# time: slowest rank's median op time; algbw = size/time; busbw = algbw * bus factor",
             f"# pred: {'per-op alpha-beta fit' if report['model'] == 'fit' else 'model ' + report['model']}"
             "; ring: ideal ring on the fitted p2p link"]
    load = report.get("load_average")
    if load is not None and load > 0.5 * (report["cpu_count"] or 1):
        lines.append(f"# warning: load average {load:.2f} on {report['cpu_count']} cores before the run: other "
                     "processes compete for the CPU, timings are noisy (run on an idle machine)")
    for op, f in report["fit"].items():
        lines += ["#", f"# {op}: alpha {f['alpha_s'] * 1e6:.1f} us/step x {steps(op, n)} steps, "
                       f"beta 1/({f['busbw_Bps'] / 1e9:.3f} GB/s) x {bus_factor(op, n):.3f} S",
                  f"# {'size(B)':>10} {'count':>10} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} "
                  f"{'pred(us)':>11} {'err(%)':>8} {'ring(us)':>11}"]
        for r in (r for r in report["rows"] if r["op"] == op):
            ring = f"{r['ideal_ring_time_s'] * 1e6:>11.1f}" if r["ideal_ring_time_s"] is not None else f"{'-':>11}"
            lines.append(f"  {r['bytes']:>10} {r['count']:>10} {r['time_s'] * 1e6:>11.1f} {r['algbw'] / 1e9:>12.3f} "
                         f"{r['busbw'] / 1e9:>12.3f} {r['predicted_time_s'] * 1e6:>11.1f} "
                         f"{r['rel_err'] * 100:>+8.1f} {ring}")
    by_op = ", ".join(f"{op} {e * 100:.1f}%" for op, e in report["median_rel_err_ge_64KiB_by_op"].items()
                      if e is not None)
    err = report["median_rel_err_ge_64KiB"]
    lines += ["#", f"# fit quality: median |pred - time| / time over messages >= 64 KiB: "
                   f"{'n/a' if err is None else f'{err * 100:.1f}%'} ({by_op})"]
    o = report["tracing_overhead"]
    if o:
        lines.append(f"# tracing overhead: {o['bookkeeping_s'] * 1e6:.1f} us of Python bookkeeping per op; end to end, "
                     f"traced - raw all_reduce(4 B) = {o['traced_minus_raw_s'] * 1e6:+.1f} us on "
                     f"{o['raw_all_reduce_s'] * 1e6:.0f} us (interquartile range of raw: {o['raw_iqr_s'] * 1e6:.0f} us)")
    return "\n".join(lines)


def profile_of(report: dict, command: str) -> Topology:
    """The measured model for the planner: the p2p fit as the link, one effective link per op.
    One measurement cannot separate two tiers, so both tiers get the measured link."""
    links: dict[str, Link] = report["_links"]
    link = links.get("p2p") or next(iter(links.values()))
    n = report["world_size"]
    name = f"measured-{report['backend']}{'-meshlm' if report.get('transport') == 'meshlm' else ''}-{n}"
    return Topology(name=name, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", n)),
                    intra=link, inter=link, op_links={op: l for op, l in links.items() if op != "p2p"},
                    note=f"fitted by `{command}` on {time.strftime('%Y-%m-%d')}",
                    background=not report.get("shared_memory", False))


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    from meshlm.bench.report import first_sentence

    p = OneLineErrorParser(prog="meshlm bench comm", description=first_sentence(__doc__))
    p.add_argument("--nproc", type=int, default=2, help="local ranks to fork (ignored under torchrun)")
    p.add_argument("--json", action="store_true", help='print {"rows": [...], "fit": {...}, ...}')
    p.add_argument("--sizes", help="comma-separated message sizes, e.g. 64K,1M,16M (default: powers of 2)")
    p.add_argument("--min-bytes", default="1K", help="smallest message (default 1K)")
    p.add_argument("--max-bytes", default="64M", help="largest message (default 64M)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--trials", type=int, default=7, help="timed trials per size; the median is reported")
    p.add_argument("--max-iters", type=int, default=20, help="most back-to-back ops in one trial")
    p.add_argument("--save-profile", metavar="PATH", help="write the fitted model as JSON for the planner")
    p.add_argument("--profile", metavar="PATH", help="predict with a saved profile instead of fitting")
    p.add_argument("--preset", choices=sorted(HARDWARE), help="predict with a hardware preset instead of fitting")
    p.add_argument("--no-overhead", action="store_true", help="skip the tracing-overhead measurement")
    p.add_argument("--transport", choices=("library", "meshlm"), default="library",
                   help="library: torch.distributed's ops (default); meshlm: what meshlm's Comm runs for them "
                        "(on gloo: shared memory on one host, P2P rings across hosts)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    flag = "--sizes" if args.sizes else "--min-bytes"
    try:
        if args.sizes:
            sizes = [parse_size(s) for s in args.sizes.split(",")]
        else:
            lo = parse_size(args.min_bytes)
            if lo < 1:  # doubling 0 would never reach the largest size
                raise ValueError(f"must be at least 1 byte, got {args.min_bytes!r}")
            flag = "--max-bytes"
            sizes = default_sizes(lo, parse_size(args.max_bytes))
    except ValueError as e:
        print(f"meshlm bench comm: error: {flag}: {e}", file=sys.stderr)
        return 2
    ops = args.ops.split(",")
    bad = [o for o in ops if o not in OPS]
    problems = ([f"--ops: unknown {bad} (known: {', '.join(OPS)})"] if bad else []) + \
               (["--nproc: needs at least 2 ranks"] if args.nproc < 2 else []) + \
               (["--trials and --max-iters: must be >= 1"] if min(args.trials, args.max_iters) < 1 else []) + \
               (["--sizes: no message sizes"] if not sizes else []) + \
               (["--profile and --preset: choose one"] if args.profile and args.preset else []) + \
               [problem for problem in [unwritable(args.save_profile, "--save-profile")] if problem]
    if not sizes and not args.sizes:  # the range is empty: name the options that made it so
        problems.insert(0, f"--max-bytes: {args.max_bytes!r} is below --min-bytes {args.min_bytes!r}: no message sizes")
    if problems:
        print(f"meshlm bench comm: error: {problems[0]}", file=sys.stderr)
        return 2
    try:
        model = load_profile(args.profile) if args.profile else HARDWARE.get(args.preset)
    except (OSError, KeyError, ValueError) as e:
        print(f"meshlm bench comm: error: --profile: cannot read {args.profile}: {e}", file=sys.stderr)
        return 2
    opts = {"ops": ops, "sizes": sizes, "trials": args.trials, "max_iters": args.max_iters,
            "overhead": not args.no_overhead, "transport": args.transport}

    load_before = os.getloadavg()[0]  # other processes on the machine make every timing noisy
    try:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun: use its world
            created = not dist.is_initialized()
            if created:
                dist.init_process_group(default_backend())
            result = _bench_rank(opts)
            is_root = dist.get_rank() == 0
            if created:
                dist.destroy_process_group()
            if not is_root:
                return 0
        else:
            from meshlm.testing import run_ranks
            result = run_ranks(_bench_rank, args.nproc, opts, timeout=1200)[0]
    except Exception as e:  # noqa: BLE001 - a runtime failure is exit 1 with its reason
        print(f"meshlm bench comm: failed: {e}", file=sys.stderr)
        return 1

    result["load_average"] = load_before
    report = analyse(result, model)
    command = "meshlm bench comm " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.save_profile:
        save_profile(profile_of(report, command.strip()), args.save_profile,
                     fit_median_rel_err_ge_64KiB=report["median_rel_err_ge_64KiB"])
    report.pop("_links")
    print(json.dumps(report, indent=1) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
