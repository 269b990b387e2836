"""`meshlm memory`: the memory model's per-rank breakdown for a config, against a device's
capacity, with the changes that would make it fit, and a plot of the strategies side by side.
Reduces: trial and error with real GPUs to learn whether (and why not) a layout fits.
Costs: nothing; no ranks are started, so `parallel.dp=64` works on a laptop.
"""

from __future__ import annotations

import copy
import json
import re

from meshlm.analysis.memory import RANK_FIELDS, MemoryReport, predict, rank_points
from meshlm.config import Config, ConfigError, load_config, resolve
from meshlm.errors import unwritable
from meshlm.train.metrics import format_bytes

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


PHASE_FIELDS = ("grads", "activations", "other", "peak")  # what changes along the step


def parse_bytes(text: str) -> int:
    """`80GiB`, `80GB`, `81920MiB`, `85899345920` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"--device-memory: expected a size such as 80GiB or 40GB, got {text!r}")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ConfigError(f"--device-memory: must be more than 0 bytes, got {text!r}")
    return size


def visible_device_memory() -> int | None:
    """The first visible GPU's total memory, or None without one."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def layout_config(config_path: str | None, overrides: list[str]) -> Config:
    """The config with its layout from `parallel.*` alone (dp defaults to 1): no ranks needed."""
    cfg = load_config(config_path, overrides)
    p = cfg.parallel
    if p.dp == 0:
        p.dp = 1
    return resolve(cfg, world_size=p.dp * p.tp * p.pp * p.cp)


def _variant(cfg: Config, **changes) -> Config | None:
    """A copy of `cfg` with `section__key=value` changes, or None where that layout is invalid."""
    out = copy.deepcopy(cfg)
    for key, value in changes.items():
        section, name = key.split("__")
        setattr(getattr(out, section), name, value)
    p = out.parallel
    try:
        return resolve(out, world_size=p.dp * p.tp * p.pp * p.cp)
    except ConfigError:
        return None


def suggestions(cfg: Config, capacity: int, backend: str) -> list[tuple[str, int]]:
    """Single changes that bring the peak under `capacity`: (the override, its predicted peak),
    the cheapest in throughput first (memory-only changes before more ranks)."""
    t, p = cfg.train, cfg.parallel
    candidates = []
    for zero in range(p.zero + 1, 4):
        candidates.append((f"parallel.zero={zero}", dict(parallel__zero=zero)))
    for recompute in ("selective", "full"):
        if t.recompute != recompute and not (t.recompute == "full" and recompute == "selective"):
            candidates.append((f"train.recompute={recompute}", dict(train__recompute=recompute)))
    if t.micro_batch_size > 1:
        candidates.append((f"train.micro_batch_size={t.micro_batch_size // 2}",
                           dict(train__micro_batch_size=t.micro_batch_size // 2)))
    if t.dtype == "float32":
        candidates.append(("train.dtype=bfloat16", dict(train__dtype="bfloat16")))
    candidates.append((f"parallel.tp={p.tp * 2} parallel.sp=true", dict(parallel__tp=p.tp * 2, parallel__sp=True)))
    candidates.append((f"parallel.pp={p.pp * 2}", dict(parallel__pp=p.pp * 2)))
    candidates.append((f"parallel.cp={p.cp * 2}", dict(parallel__cp=p.cp * 2)))
    out = []
    for text, changes in candidates:
        variant = _variant(cfg, **changes)
        if variant is not None:
            peak = predict(variant, backend).peak_bytes
            if peak <= capacity:
                out.append((text, peak))
    return out


def format_report(cfg: Config, report: MemoryReport, capacity: int | None) -> str:
    p, t = cfg.parallel, cfg.train
    lines = [f"{cfg.model.preset} ({cfg.model.dim}d x {cfg.model.n_layers}L), dp={p.dp} tp={p.tp} pp={p.pp} "
             f"cp={p.cp} zero={p.zero} sp={str(p.sp).lower()}, {t.dtype}, recompute {t.recompute}, "
             f"micro-batch {t.micro_batch_size} x {t.seq_len}",
             f"{'role':<11}{'ranks':>6}" + "".join(f"{f.removesuffix('_bytes'):>13}" for f in RANK_FIELDS)
             + "  peak at"]
    for r in report.ranks:
        lines.append(f"{r.role:<11}{r.ranks:>6}" + "".join(f"{format_bytes(getattr(r, f)):>13}" for f in RANK_FIELDS)
                     + f"  {r.phase}")
    if capacity is not None:
        fits = report.peak_bytes <= capacity
        lines.append(f"peak {format_bytes(report.peak_bytes)} per rank of {format_bytes(capacity)}: "
                     + ("fits" if fits else "does NOT fit")
                     + f" ({report.peak_bytes / capacity:.0%})")
    return "\n".join(lines)


def format_phases(cfg: Config, backend: str) -> str:
    """Each role's walk: every point where memory can peak, with the instruction it lies in."""
    lines = []
    for pp_rank in range(cfg.parallel.pp):
        points = rank_points(cfg, pp_rank, backend)
        lines.append(f"{points[0][1].role}: {'instr':>5}  {'phase':<20}" + "".join(f"{f:>13}" for f in PHASE_FIELDS))
        lines += [f"{'':<{len(r.role) + 2}}{at:>5}  {r.phase:<20}"
                  + "".join(f"{format_bytes(getattr(r, f + '_bytes')):>13}" for f in PHASE_FIELDS)
                  for at, r in points]
    return "\n".join(lines)


def plot_strategies(cfg: Config, path: str, backend: str) -> None:
    """Stacked bars of the largest rank's breakdown for zero 0-3, recompute none and full."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, stacks = [], []
    for recompute in ("none", "full"):
        for zero in range(4):
            variant = _variant(cfg, parallel__zero=zero, train__recompute=recompute)
            if variant is None:
                continue
            report = predict(variant, backend)
            worst = max(report.ranks, key=lambda r: r.peak_bytes)
            labels.append(f"zero {zero}\n{'recompute' if recompute == 'full' else 'no recompute'}")
            stacks.append([getattr(worst, f) / 2**30 for f in RANK_FIELDS[:-1]])
    fig, ax = plt.subplots(figsize=(1.3 * len(labels) + 2, 4.5))
    bottoms = [0.0] * len(labels)
    for i, field in enumerate(RANK_FIELDS[:-1]):
        values = [s[i] for s in stacks]
        ax.bar(labels, values, bottom=bottoms, label=field.removesuffix("_bytes"))
        bottoms = [b + v for b, v in zip(bottoms, values)]
    p = cfg.parallel
    ax.set_ylabel("GiB per rank (the largest rank)")
    ax.set_title(f"{cfg.model.preset}: dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}, {cfg.train.dtype}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    backend = args.backend
    cfg = layout_config(args.config, args.overrides)
    capacity = parse_bytes(args.device_memory) if args.device_memory else visible_device_memory()
    problem = unwritable(args.plot, "--plot")
    if problem:
        raise ConfigError(problem)
    report = predict(cfg, backend)
    fits = capacity is None or report.peak_bytes <= capacity
    advice = [] if fits else suggestions(cfg, capacity, backend)
    if args.plot:
        plot_strategies(cfg, args.plot, backend)
    if args.json:
        out = report.as_dict()
        out.update(device_memory_bytes=capacity, fits=fits,
                   suggestions=[{"overrides": text, "peak_bytes": peak} for text, peak in advice])
        if args.phases:
            out["phases"] = [[{"instruction": at, **r.as_dict()} for at, r in rank_points(cfg, pp_rank, backend)]
                             for pp_rank in range(cfg.parallel.pp)]
        print(json.dumps(out))
        return 0 if fits else 1
    print(format_report(cfg, report, capacity))
    if args.phases:
        print(format_phases(cfg, backend))
    if not fits:
        if advice:
            print("would fit with one change (cheapest first):")
            for text, peak in advice:
                print(f"  {text:<36} peak {format_bytes(peak)}")
        else:
            print("no single change fits: combine them (meshlm plan searches all layouts)")
    if args.plot:
        print(f"plot: {args.plot}")
    # as `meshlm plan` exits 1 when nothing fits: a script can gate a launch on the verdict
    # (bad input stays 2; with no capacity known, on a machine without a GPU, there is no verdict)
    return 0 if fits else 1
