"""Out of memory, explained: which rank, in which phase, the memory by category at that point
against the memory model's prediction, and the changes that would fit.

Reduces: a 20-line allocator traceback to one block that says why and what to change.
Costs: nothing until an allocation fails (then a few calls of the memory model).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from meshlm.train.metrics import format_bytes

CATEGORIES = ("params", "grads", "optimizer", "master", "activations", "other")
FITS = 0.9  # a predicted peak under this share of the rank's memory leaves room for the allocator's slack


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA raises torch.OutOfMemoryError; the CPU allocator a RuntimeError (or MemoryError)."""
    return (isinstance(error, (torch.OutOfMemoryError, MemoryError))
            or (isinstance(error, RuntimeError) and "can't allocate memory" in str(error)))


def device_capacity(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def local_ranks(cfg) -> int:
    """How many ranks share this host's memory: torchrun's LOCAL_WORLD_SIZE, else every rank
    (forked ranks of one process, as the tests run them)."""
    p = cfg.parallel
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", p.dp * p.tp * p.cp * p.pp)))


def rank_capacity(device: torch.device, ranks_here: int) -> int | None:
    """The memory one rank can count on: its GPU, or on the CPU its share of the host's RAM (the
    local ranks all allocate from it; the prediction is per rank)."""
    capacity = device_capacity(device)
    return capacity // ranks_here if capacity is not None and device.type != "cuda" else capacity


def measured_by_category(engine, device: torch.device) -> dict[str, int]:
    """What this rank holds now: model state from the engine, the rest (activations and
    transients) from the CUDA allocator where there is one."""
    state = engine.model_state_bytes() if engine is not None and hasattr(engine, "model_state_bytes") else {}
    out = {k: int(state.get(k, 0)) for k in ("params", "grads", "optimizer", "master")}
    if device.type == "cuda":
        out["allocated"] = torch.cuda.memory_allocated(device)
        out["peak"] = torch.cuda.max_memory_allocated(device)
        out["activations+other"] = max(0, out["allocated"] - sum(out[k] for k in ("params", "grads", "optimizer", "master")))
    return out


def _predicted_peak(cfg, backend: str) -> int | None:
    from meshlm.analysis.memory import predict

    try:
        return predict(cfg, backend=backend).peak_bytes
    except Exception:  # a layout the model cannot describe: no figure rather than a second failure
        return None


def _with(cfg, section: str, **changes):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def candidate_changes(cfg) -> list[tuple[str, object]]:
    """Each change that lowers per-rank memory, with the config it gives; cheapest to try first."""
    p, t = cfg.parallel, cfg.train
    out = []
    if p.zero < 3 and p.dp > 1:
        out.append((f"parallel.zero={p.zero + 1}", _with(cfg, "parallel", zero=p.zero + 1)))
    if t.recompute != "full":
        out.append(("train.recompute=full", _with(cfg, "train", recompute="full")))
    if t.micro_batch_size > 1:
        half = t.micro_batch_size // 2
        out.append((f"train.micro_batch_size={half}", _with(cfg, "train", micro_batch_size=half)))
    more = _with(cfg, "parallel", dp=p.dp * 2, zero=max(p.zero, 1))
    out.append((f"twice the ranks: parallel.dp={p.dp * 2} parallel.zero={max(p.zero, 1)} "
                f"(--nproc x2)", more))
    if cfg.model.n_heads % (p.tp * 2) == 0 and cfg.model.n_kv_heads % (p.tp * 2) == 0:
        out.append((f"parallel.tp={p.tp * 2} (--nproc x2)", _with(cfg, "parallel", tp=p.tp * 2)))
    return out


def oom_report(cfg, rank: int, step: int, phase: str, engine, device: torch.device) -> list[str]:
    """The report's lines; the first says what happened, the last what to change."""
    from meshlm.analysis.memory import runtime_backend

    p = cfg.parallel
    backend = runtime_backend(device.type, p.dp * p.tp * p.cp * p.pp)
    here = local_ranks(cfg)
    capacity = rank_capacity(device, here)
    measured = measured_by_category(engine, device)
    share = f" per rank: {format_bytes(device_capacity(device))} over {here} local ranks" if (
        capacity and device.type != "cuda" and here > 1) else ""
    lines = [f"out of memory on rank {rank} in the {phase} of step {step}"
             + (f" ({device}, {format_bytes(capacity)}{share})" if capacity else "")]
    mine = None
    try:
        from meshlm.analysis.memory import predict

        from meshlm.mesh import Layout

        predicted = predict(cfg, backend=backend)  # one role per pipeline stage: this rank's stage's
        mine = predicted.ranks[Layout.from_config(p).coords(rank)["pp"]]
        lines.append(f"  {'category':<20} {'measured now':>14} {'predicted at peak':>18}")
        for name in CATEGORIES:
            now = measured.get(name)
            lines.append(f"  {name:<20} {format_bytes(now) if now is not None else '-':>14} "
                         f"{format_bytes(getattr(mine, name + '_bytes')):>18}")
        if "allocated" in measured:
            lines.append(f"  {'activations+other':<20} {format_bytes(measured['activations+other']):>14}")
        lines.append(f"  {'peak':<20} {format_bytes(measured.get('peak')) if 'peak' in measured else '-':>14} "
                     f"{format_bytes(mine.peak_bytes):>18} ({mine.phase})")
    except Exception as e:  # the report must not fail where the run already has
        lines.append(f"  (no prediction: {e})")
    fits = []
    for change, changed in candidate_changes(cfg):
        peak = _predicted_peak(changed, backend)
        if peak is not None:
            fits.append((peak, change))
    fits.sort()
    if mine is not None and capacity is not None and mine.peak_bytes < FITS * capacity:
        # The layout is not what ran out: more of it would only hide the cause.
        lines.append(f"  the predicted peak ({format_bytes(mine.peak_bytes)}) fits this rank's "
                     f"{format_bytes(capacity)}: look elsewhere: other processes holding memory, allocator "
                     f"fragmentation, a leak (memory growing step after step), or a transient (an unusually "
                     f"large batch or allocation)")
    elif fits:
        fitting = [f"{change} (predicted peak {format_bytes(peak)})" for peak, change in fits
                   if capacity is None or peak < FITS * capacity]
        lines.append("  to fit: " + ("; or ".join(fitting[:3]) if fitting else
                                     f"no single change fits; the lowest is {fits[0][1]} "
                                     f"(predicted peak {format_bytes(fits[0][0])}): combine them, or `meshlm plan`"))
    return lines
