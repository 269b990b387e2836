"""Saving and loading a Trainer's whole state, each rank writing and reading only what it owns.

What a checkpoint holds, and why exact resume needs each piece:
- fp32 master weights and AdamW's two moments (`exp_avg`, `exp_avg_sq`) of every element, in
  single-process coordinates: the next update depends on all three;
- the step: AdamW's bias correction, the LR schedule (`lr_at(step)` is a pure function of it) and
  the data position (batch k is a pure function of (seed, k): consumed samples = step x global batch);
- every rank's RNG states: meshlm's step draws no random numbers today (initialisation is by
  parameter name, data order by (seed, step)), so they are restored for code that will;
- the resolved config, the layout, the tokenizer and the meshlm version: to check a resume
  against the model it continues, to export, and to explain a checkpoint without the run.
bf16 parameters are not stored: they are the master weights rounded, and are recomputed so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import meshlm
from meshlm.config_toml import to_toml
from meshlm.train.tokenizer import TOKENIZER_CONFIG
from meshlm.train.checkpoint.pieces import (Placement, Piece, canonical_shapes, check_shapes,  # noqa: F401
                                            placements, segment_pieces)
from meshlm.train.checkpoint.store import (META, CheckpointError, CheckpointReader, clear_stale_temporaries, finalize,
                                           rank_file, rotate, step_dir_name, write_bytes_synced,
                                           write_tensors_synced)

KINDS = ("model", "exp_avg", "exp_avg_sq")  # the fp32 master weights and AdamW's moments
OPTIMIZER_KINDS = KINDS[1:]


@dataclass
class SaveReport:
    path: Path
    seconds: float  # training was blocked this long
    bytes: int  # all ranks' files together


def _segments(dp) -> list:
    optim = getattr(dp, "optim", None)  # a pipeline stage without parameters has none
    return optim.segments if optim is not None else []


def owned_pieces(trainer) -> list[tuple[object, Placement, list[Piece]]]:
    """(MasterSegment, its Placement, its pieces) for everything this rank's optimizer updates."""
    shapes = canonical_shapes(trainer.cfg.model)
    where = placements(trainer.dp.module, trainer.ctx, shapes, getattr(trainer.dp, "dp_sharded", False))
    out = []
    for seg in _segments(trainer.dp):
        placement = where[id(seg.param)]
        out.append((seg, placement, segment_pieces(placement, seg.segment.p_lo, seg.segment.p_hi)))
    return out


def _kind_data(optimizer, seg, kind: str) -> torch.Tensor | None:
    if kind == "model":
        return seg.master
    state = optimizer.state.get(seg.master)
    return None if state is None else state.get(kind)


def layout_of(cfg, world_size: int) -> dict:
    p = cfg.parallel
    return {"world_size": world_size, "dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "zero": p.zero, "sp": p.sp,
            "pp_schedule": p.pp_schedule, "pp_virtual": p.pp_virtual, "pp_layers": p.pp_layers,
            "dtype": cfg.train.dtype}


def _meta(trainer, shapes, metrics_row: dict | None) -> dict:
    from meshlm.train.metrics import jsonable
    from meshlm.train.optim import lr_at

    cfg = trainer.cfg
    return {"step": trainer.step, "nonfinite_skipped": trainer.nonfinite_skipped,
            "empty_skipped": trainer.empty_skipped, "next_lr": lr_at(trainer.step, cfg.train),
            "data": trainer.loader.state_dict(), "seed": cfg.run.seed,
            "layout": layout_of(cfg, trainer.ctx.world_size), "model": dataclasses.asdict(cfg.model),
            "shapes": {k: list(v) for k, v in shapes.items()}, "meshlm_version": meshlm.__version__,
            "torch_version": torch.__version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            # the step's metrics.jsonl row (without checkpoint_s, not known yet): logged after the save
            **({"metrics_row": jsonable(metrics_row)} if metrics_row else {})}


def _rank_payload(trainer, snapshot: bool) -> tuple[dict[str, torch.Tensor], list]:
    """This rank's tensors (the pieces it writes, its RNG states) and their index. `snapshot`:
    copies that training may not change (an async save), else views where they are on the CPU."""
    tensors, index = {}, []
    optimizer = trainer.dp.optim.optimizer if _segments(trainer.dp) else None
    for seg, placement, pieces in owned_pieces(trainer):
        if not placement.written_here:
            continue
        for kind in KINDS:
            data = _kind_data(optimizer, seg, kind)
            for piece in pieces:
                key = f"{kind}/{piece.name}/{piece.rect.row},{piece.rect.col}"
                value = piece.view(data) if data is not None else torch.zeros(piece.rect.rows, piece.rect.cols)
                copy = value.detach().to("cpu", torch.float32)  # from a GPU: already a copy
                tensors[key] = copy.clone() if snapshot and copy.data_ptr() == value.data_ptr() else copy
                index.append([key, kind, piece.name, piece.rect.row, piece.rect.col, piece.rect.rows, piece.rect.cols])
    tensors["rng/cpu"] = torch.get_rng_state()
    if trainer.device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(trainer.device)
    return tensors, index


def _rank0_files(trainer, metrics_row: dict | None) -> dict[str, bytes]:
    """The files only rank 0 writes, as bytes taken now (the step they describe)."""
    shapes = canonical_shapes(trainer.cfg.model)
    tokenizer = Path(trainer.data.tokenizer_path)
    return {META: json.dumps(_meta(trainer, shapes, metrics_row), indent=1).encode(),
            "config.toml": to_toml(trainer.cfg).encode(), "tokenizer.json": tokenizer.read_bytes(),
            # a pretrained tokenizer's end-of-text choice (tokenizer.run_end_token), where the cache has one
            **({TOKENIZER_CONFIG: (tokenizer.parent / TOKENIZER_CONFIG).read_bytes()}
               if (tokenizer.parent / TOKENIZER_CONFIG).is_file() else {})}


def _entries_file(tmp: Path, rank: int) -> Path:
    return tmp / f"rank{rank:05d}.entries.json"


def _write_rank(tmp: Path, rank: int, tensors, metadata, extra_files: dict[str, bytes]) -> None:
    """This rank's files, then its manifest entries (renamed into place: rank 0 may be polling).
    The entries reach rank 0 through the shared checkpoint directory, not a collective, so this
    can run on a background thread."""
    entries = {rank_file(rank): write_tensors_synced(tmp / rank_file(rank), tensors, metadata)}
    for name, data in extra_files.items():
        entries[name] = write_bytes_synced(tmp / name, data)
    part = _entries_file(tmp, rank).with_suffix(".part")
    write_bytes_synced(part, json.dumps(entries).encode())
    os.replace(part, _entries_file(tmp, rank))


def _finish(tmp: Path, final: Path, world_size: int, step: int, keep: int, timeout_s: float) -> int:
    """Rank 0: wait for every rank's entries, write the manifest, rename, rotate. Returns bytes."""
    deadline = time.monotonic() + timeout_s
    paths = [_entries_file(tmp, r) for r in range(world_size)]
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            raise CheckpointError(f"{tmp}: no {missing[0]} after {timeout_s:.0f} s (a rank failed mid-save)")
        time.sleep(0.01)
    everything = {}
    for p in paths:
        everything.update(json.loads(p.read_text()))
        p.unlink()
    finalize(tmp, final, everything, step)
    rotate(final.parent, keep)
    return sum(e["bytes"] for e in everything.values())


class BackgroundSave:
    """A save finishing on a thread (`checkpoint.async_save`): files, hashes, fsyncs and (rank 0)
    the manifest and rename, while training goes on. At most one is in flight per rank."""

    def __init__(self, work, path: Path) -> None:
        self.path = path
        self.error: BaseException | None = None
        self.result = 0
        self.seconds = 0.0  # how long the writing took, once done
        self.reported = False  # the trainer put `seconds` in a metrics row
        start = time.perf_counter()

        def run():
            try:
                self.result = work()
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread by wait()
                self.error = e
            self.seconds = time.perf_counter() - start

        self.thread = threading.Thread(target=run, name="meshlm-checkpoint", daemon=True)
        self.thread.start()

    def wait(self) -> int:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


def save_checkpoint(trainer, root: Path, keep: int, background: bool = False,
                    timeout_s: float = 1800.0, metrics_row: dict | None = None) -> SaveReport:
    """Write the trainer's state at its current step into `root/step_NNNNNNN/` (collective).
    Every rank writes its own file; rank 0 writes the rest and, last, the manifest.

    `background`: return once the state is copied; the writing finishes on a thread (call
    `wait_for_save(trainer)` before exiting). The report's `seconds` is the time training was
    blocked either way; `bytes` is this rank's share for a background save (the total is not
    known yet)."""
    t0 = time.perf_counter()
    wait_for_save(trainer, barrier=False)  # one save in flight at a time
    ctx, comm, step = trainer.ctx, trainer.comm, trainer.step
    tmp, final = root / f".tmp_{step_dir_name(step)}", root / step_dir_name(step)
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        clear_stale_temporaries(root)
        tmp.mkdir()
    comm.barrier()
    tensors, index = _rank_payload(trainer, snapshot=background)
    metadata = {"pieces": json.dumps(index), "rank": str(ctx.rank), "coords": json.dumps(ctx.coords)}
    extra = _rank0_files(trainer, metrics_row) if ctx.rank == 0 else {}

    def work() -> int:
        _write_rank(tmp, ctx.rank, tensors, metadata, extra)
        return _finish(tmp, final, ctx.world_size, step, keep, timeout_s) if ctx.rank == 0 else 0

    if background:
        trainer.pending_save = BackgroundSave(work, final)
        mine = sum(t.numel() * t.element_size() for t in tensors.values())
        return SaveReport(final, time.perf_counter() - t0, mine)
    _write_rank(tmp, ctx.rank, tensors, metadata, extra)
    # Every rank's part is written before rank 0 finishes: a rank that died writing fails this
    # collective on the others at once (a lost peer, which the failure analysis names). Rank 0
    # polling the directory for its entries instead heard of it only from torchrun's SIGTERM,
    # then sat out the stop deadline (25 s) and left no dump.
    comm.barrier()
    total = _finish(tmp, final, ctx.world_size, step, keep, timeout_s) if ctx.rank == 0 else 0
    # every rank returns once the checkpoint is in place: this all-reduce waits for rank 0's rename
    bytes_total = torch.tensor([float(total)], dtype=torch.float64, device=trainer.device)
    comm.all_reduce(bytes_total, "world")
    return SaveReport(final, time.perf_counter() - t0, int(bytes_total.item()))


def wait_for_save(trainer, barrier: bool = True) -> None:
    """Finish a background save on this rank; with `barrier`, on every rank (collective): after
    it the checkpoint is complete on disk."""
    pending = getattr(trainer, "pending_save", None)
    if pending is not None:
        trainer.pending_save = None
        pending.wait()
    if barrier and pending is not None:
        trainer.comm.barrier()


# --------------------------------------------------------------------------- loading


def _new_adam_state(master: torch.Tensor, step: int, group: dict) -> dict:
    """AdamW's state for `master` as torch's own `_init_group` would make it: `step` lives on the
    parameter's device under the fused (CUDA) or capturable kernels, which read it there, and on
    the CPU otherwise."""
    from torch.optim.optimizer import _get_scalar_dtype

    on_device = bool(group.get("fused") or group.get("capturable"))
    return {"step": torch.tensor(float(step), dtype=_get_scalar_dtype(is_fused=group.get("fused")),
                                 device=master.device if on_device else "cpu"),
            "exp_avg": torch.zeros_like(master, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(master, memory_format=torch.preserve_format)}


@torch.no_grad()
def load_weights(trainer, reader, optimizer_state: bool) -> None:
    """Fill this rank's master weights (and AdamW state) with the rectangles it owns, then let the
    engine rebuild what derives from them (bf16 copies, other ranks' ZeRO slices)."""
    # AdamW steps once per training step it applied: not on steps train.on_nonfinite=skip dropped,
    # nor on steps without a target token (its bias correction reads the count). Checkpoints
    # before the keys skipped none or did not say.
    step = (reader.meta["step"] - reader.meta.get("nonfinite_skipped", 0) - reader.meta.get("empty_skipped", 0)
            if optimizer_state else 0)
    optimizer = trainer.dp.optim.optimizer if _segments(trainer.dp) else None
    group_of = ({id(p): g for g in optimizer.param_groups for p in g["params"]}
                if optimizer_state and optimizer is not None else {})  # None: a stage without parameters
    for seg, _placement, pieces in owned_pieces(trainer):
        for piece in pieces:
            reader.read("model", piece.name, piece.rect, piece.view(seg.master))
        if not optimizer_state:
            continue
        state = optimizer.state[seg.master] = _new_adam_state(seg.master, step, group_of[id(seg.master)])
        for kind in OPTIMIZER_KINDS:
            for piece in pieces:
                reader.read(kind, piece.name, piece.rect, piece.view(state[kind]))
    trainer.dp.refresh_from_masters()


def restore_rng(trainer, reader: CheckpointReader) -> None:
    """Each rank takes its own saved RNG states when the layout is unchanged, else every rank takes
    saved rank 0's (no rank-to-rank correspondence exists then)."""
    same = reader.meta["layout"] == layout_of(trainer.cfg, trainer.ctx.world_size)
    source = trainer.ctx.rank if same else 0
    cpu = reader.rank_tensor(source, "rng/cpu")
    if cpu is not None:
        torch.set_rng_state(cpu)
    cuda = reader.rank_tensor(source, "rng/cuda")
    if cuda is not None and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(cuda, trainer.device)


def load_checkpoint(trainer, path: Path) -> dict:
    """Resume `trainer` from checkpoint `path` under whatever layout it runs now: weights, AdamW
    state, step (so LR), data position, RNG. Returns the checkpoint's meta."""
    reader = CheckpointReader(path)
    check_shapes(reader, trainer.cfg.model)
    load_weights(trainer, reader, optimizer_state=True)
    trainer.loader.load_state_dict(reader.meta["data"])
    trainer.step = reader.meta["step"]
    trainer.nonfinite_skipped = reader.meta.get("nonfinite_skipped", 0)
    trainer.empty_skipped = reader.meta.get("empty_skipped", 0)
    if trainer.loader.next_step != trainer.step:
        raise CheckpointError(f"{path}: data position {reader.meta['data']['consumed_samples']} samples does not "
                              f"match step {trainer.step}")
    restore_rng(trainer, reader)
    return reader.meta
