"""What every model benchmark shares: where its ranks come from, the shape of its result
(DESIGN.md's `--json` contract) and its table.

Each bench runs meshlm and the PyTorch reference alternately on the same model, data and world
size, and reports medians of the paired runs: ratios > 1 in tokens/s and < 1 in memory favour
meshlm.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any, Callable


def bench_row(name: str, world_size: int, reference: str, meshlm_tokens_per_s: list[float],
              reference_tokens_per_s: list[float], meshlm_peak_bytes: int, reference_peak_bytes: int,
              **extra: Any) -> dict[str, Any]:
    """One row: medians of the paired measurements and their ratios (meshlm / reference).

    The tokens/s ratio is the median of per-pair ratios, so a slow spell of the machine that hits
    both members of a pair cancels out."""
    if len(meshlm_tokens_per_s) != len(reference_tokens_per_s) or not meshlm_tokens_per_s:
        raise ValueError("need the same, non-zero number of meshlm and reference measurements")
    ratios = [m / r for m, r in zip(meshlm_tokens_per_s, reference_tokens_per_s)]
    return {
        "name": name, "world_size": world_size,
        "meshlm_tokens_per_s": statistics.median(meshlm_tokens_per_s),
        "reference": reference, "reference_tokens_per_s": statistics.median(reference_tokens_per_s),
        "tokens_per_s_ratio": statistics.median(ratios),
        # The spread of the paired ratios: a median above 1 means little if its quartiles straddle it.
        "tokens_per_s_ratio_quartiles": _quartiles(ratios),
        "meshlm_peak_bytes": int(meshlm_peak_bytes), "reference_peak_bytes": int(reference_peak_bytes),
        "memory_ratio": meshlm_peak_bytes / reference_peak_bytes if reference_peak_bytes else None,
        "pairs": len(ratios), **extra,
    }


def loss_check_passed(values: dict[str, float | None], diff_keys: tuple[str, ...], tolerance: float) -> bool:
    """A bench's loss check: every value (losses and differences) a finite number, and each
    difference in `diff_keys` within `tolerance`. Explicit, because NaN compares false with
    everything: `max(d, nan)` returns d and `nan > tol` is false, so a NaN side would pass."""
    if any(v is None or not math.isfinite(v) for v in values.values()):
        return False
    return all(values[k] <= tolerance for k in diff_keys if k in values)


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4, method="inclusive")  # within the values, however few
    return [q[0], q[2]]


def format_rows(rows: list[dict[str, Any]]) -> str:
    header = f"{'name':<22} {'ws':>3} {'meshlm tok/s':>13} {'reference':<28} {'ref tok/s':>11} {'ratio':>6} " \
             f"{'(quartiles)':>13} {'meshlm MiB':>11} {'ref MiB':>9} {'mem ratio':>9}"
    lines = [header]
    for r in rows:
        mem = "n/a" if r["memory_ratio"] is None else f"{r['memory_ratio']:.3f}"
        q1, q3 = r["tokens_per_s_ratio_quartiles"]
        lines.append(f"{r['name']:<22} {r['world_size']:>3} {r['meshlm_tokens_per_s']:>13,.0f} "
                     f"{r['reference']:<28} {r['reference_tokens_per_s']:>11,.0f} {r['tokens_per_s_ratio']:>6.3f} "
                     f"{f'({q1:.3f}-{q3:.3f})':>13} "
                     f"{r['meshlm_peak_bytes'] / 2**20:>11.1f} {r['reference_peak_bytes'] / 2**20:>9.1f} {mem:>9}")
    return "\n".join(lines)


def emit(rows: list[dict[str, Any]], as_json: bool, **extra: Any) -> None:
    """Print `{"rows": [...], ...}` for --json, else the table and a line of context (`extra`)."""
    if as_json:
        print(json.dumps({"rows": rows, **extra}, indent=2))
    else:
        print(format_rows(rows))
        context = ", ".join(f"{k.replace('_', ' ')} {_short(v)}" for k, v in extra.items() if v is not None)
        if context:
            print(context)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, (list, tuple)):
        return "/".join(_short(v) for v in value)
    return str(value)


def run_on_ranks(rank_fn: Callable[[Any], list[dict]], params: Any, nproc: int) -> list[dict] | None:
    """`rank_fn(params)` on every rank; rank 0's rows, or None on the other ranks of a torchrun job.

    Inside an initialised process group: that world. Under torchrun (RANK set): join its world
    (NCCL on GPUs). Otherwise: fork `nproc` local gloo ranks (meshlm.testing.run_ranks)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return rank_fn(params)
    if "RANK" in os.environ:
        from meshlm.mesh import default_backend

        dist.init_process_group(default_backend())
        try:
            rows = rank_fn(params)
        finally:
            dist.destroy_process_group()
        return rows if int(os.environ["RANK"]) == 0 else None
    from meshlm.testing import run_ranks

    return run_ranks(rank_fn, nproc, params, timeout=3600)[0]


def run_and_emit(rank_fn: Callable[[Any], list[dict]], params: Any, nproc: int, as_json: bool, **extra: Any) -> None:
    """`run_on_ranks`, then `emit` rank 0's rows with the machine's load and the CPU steal while
    the ranks ran: the context without which a ratio on a shared machine cannot be read."""
    before = cpu_times()
    rows = run_on_ranks(rank_fn, params, nproc)
    if rows is not None:
        emit(rows, as_json, **extra, load_average=load_average(), cpu_steal_fraction=steal_fraction(before, cpu_times()))


def first_sentence(doc: str) -> str:
    """A bench module's docstring up to the end of its first sentence (the lines up to the first
    one ending in a full stop), for its --help: `bench gpu` and `bench scaling` wrap that sentence
    over two lines, and their first line alone stopped mid-sentence."""
    lines = []
    for line in doc.strip().splitlines():
        lines.append(line.strip())
        if not line.strip() or line.rstrip().endswith("."):
            break
    return " ".join(part for part in lines if part)


def below_minimum(opts: Any, minimums: dict[str, int]) -> str | None:
    """The first option of `minimums` ({attribute: least value}) below its least value, as
    '--name: must be >= m, got v'; None if all are in range."""
    for key, least in minimums.items():
        value = getattr(opts, key)
        if value < least:
            return f"--{key.replace('_', '-')}: must be >= {least}, got {value}"
    return None


def parse_args(parse: Callable[[Any], Any], argv) -> tuple[Any, int | None]:
    """(`parse(argv)`, None), or (None, the exit code argparse asked for: 2 on bad usage, 0 for
    --help), so a bench's `main` returns the code instead of raising SystemExit."""
    try:
        return parse(argv), None
    except SystemExit as e:
        return None, int(e.code or 0)


def parse_checked(parser: argparse.ArgumentParser, argv, command: str, minimums: dict[str, int],
                  check: Callable[[Any], str | None] | None = None) -> tuple[Any, int | None]:
    """`parse_args`, then `below_minimum` and `check(args)` (a further problem, or None): (args,
    None), or (None, the exit code) with the problem printed as one line."""
    args, code = parse_args(parser.parse_args, argv)
    if code is not None:
        return None, code
    problem = below_minimum(args, minimums) or (check(args) if check else None)
    if problem:
        print(f"meshlm bench {command}: error: {problem}", file=sys.stderr, flush=True)
        return None, 2
    return args, None


def load_average() -> list[float] | None:
    """The machine's 1/5/15-minute load: benchmark numbers on a shared machine need it beside them."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def cpu_times() -> list[int] | None:
    """The machine's cumulative CPU ticks (Linux /proc/stat: user nice system idle iowait irq softirq
    steal), for `steal_fraction`; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def steal_fraction(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of CPU time the hypervisor gave to other guests between two `cpu_times()`: on a
    shared virtual machine the noise floor of every timing taken in between."""
    if before is None or after is None:
        return None
    delta = [b - a for a, b in zip(before, after)]
    return delta[7] / sum(delta) if sum(delta) else 0.0


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask where the OS has one (a container or
    `taskset` limit, which os.cpu_count() does not see), else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def prepare_cpu_rank(rank: int, device) -> None:
    """A CPU rank of a benchmark set up as `meshlm train` sets up its ranks: glibc malloc keeps
    what a step frees (train/host_memory.py; without it, a buffer freed and allocated again every
    step can fault all its pages in each time). Forked ranks also get one core each (when there are
    enough), so the OS never migrates a rank or stacks two on one core mid-step. Both sides of a
    paired benchmark run in the same process, so under the same settings."""
    if device.type != "cpu":
        return
    from meshlm.train.host_memory import keep_freed_host_memory

    keep_freed_host_memory()
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        if rank < len(cores) and "LOCAL_WORLD_SIZE" not in os.environ:
            os.sched_setaffinity(0, {cores[rank]})
