"""Checkpoint save and load: time training is blocked, bytes on disk, against PyTorch's DCP.

    .venv/bin/python benchmarks/checkpoint_io.py [--presets tiny,125m] [--repeats 3] [--dir /tmp/ckpt-bench]

For each preset, after one training step (so AdamW has its state), on one process:
- meshlm: `save_checkpoint` (sharded files, sha256 of every byte, manifest, rename) and
  `load_checkpoint` into a fresh trainer;
- DCP: `torch.distributed.checkpoint.save`/`load` of the same model and optimizer state dicts;
and meshlm under dp2-zero3 (2 forked ranks, each writing its half). Medians over `--repeats`.
Then `checkpoint.async_save`: the time training is blocked, and what the overlapped steps lose.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def trainer_for(preset: str, run_dir: Path, world: int, *extra: str):
    from helpers import build_trainer, write_offline_corpus
    from meshlm.config import load_config, resolve

    corpus = write_offline_corpus(Path("/tmp/meshlm-bench-corpus"))
    overrides = [f"model.preset={preset}", f"data.path={corpus / 'topics.txt'}", f"data.cache_dir={corpus / 'cache'}",
                 "train.seq_len=64", "train.micro_batch_size=1", f"train.global_batch_size={world}",
                 "train.track_memory=false", f"run.dir={run_dir}", *extra]
    trainer = build_trainer(resolve(load_config(None, overrides), world_size=world))
    trainer.train_step()
    return trainer


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def meshlm_times(preset: str, root: Path, repeats: int, world: int = 1, *extra: str) -> dict:
    from meshlm.train.checkpoint import load_checkpoint, save_checkpoint

    trainer = trainer_for(preset, root / "run", world, *extra)
    saves, loads = [], []
    for _ in range(repeats):
        report = save_checkpoint(trainer, root / "run" / "checkpoints", keep=1)
        saves.append(report.seconds)
        t0 = time.perf_counter()
        load_checkpoint(trainer, report.path)
        loads.append(time.perf_counter() - t0)
    return {"save_s": statistics.median(saves), "load_s": statistics.median(loads), "bytes": report.bytes,
            "params": sum(p.numel() for p in trainer.model.parameters()), "rank": trainer.ctx.rank}


def async_times(preset: str, root: Path) -> dict:
    """checkpoint.async_save: training blocked for the copy only; the steps that overlap the
    background write, against steps without one."""
    from meshlm.train.checkpoint.state import save_checkpoint, wait_for_save

    trainer = trainer_for(preset, root / "run", 1)

    def step_time() -> float:
        t0 = time.perf_counter()
        trainer.train_step()
        return time.perf_counter() - t0

    quiet = statistics.median(step_time() for _ in range(3))
    t0 = time.perf_counter()
    report = save_checkpoint(trainer, root / "run" / "checkpoints", keep=1, background=True)
    overlapped = []
    while trainer.pending_save.thread.is_alive():
        overlapped.append(step_time())
    written = time.perf_counter() - t0
    wait_for_save(trainer)
    sync = save_checkpoint(trainer, root / "run" / "checkpoints", keep=1).seconds
    extra = sum(overlapped) - quiet * len(overlapped)  # what the steps lost to the writer thread
    return {"blocked_s": report.seconds, "sync_s": sync, "written_s": written, "steps": len(overlapped),
            "step_s": quiet, "slowdown_s": extra}


def dcp_times(preset: str, root: Path, repeats: int) -> dict:
    import torch.distributed.checkpoint as dcp

    trainer = trainer_for(preset, root / "run", 1)
    state = {"model": trainer.model.state_dict(), "optim": trainer.dp.optim.optimizer.state_dict()}
    saves, loads = [], []
    for i in range(repeats):
        path = root / f"dcp{i}"
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
        loads.append(time.perf_counter() - t0)
    return {"save_s": statistics.median(saves), "load_s": statistics.median(loads), "bytes": dir_bytes(root / "dcp0")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,125m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/meshlm-ckpt-bench")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from meshlm.testing import run_ranks

    print("| preset | parameters | layout | meshlm save s | meshlm load s | meshlm MiB | DCP save s | DCP load s | DCP MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        root = Path(args.dir) / preset
        shutil.rmtree(root, ignore_errors=True)
        ours = meshlm_times(preset, root / "one", args.repeats)
        theirs = dcp_times(preset, root / "dcp", args.repeats)
        print(f"| {preset} | {ours['params'] / 1e6:.1f}M | 1 process | {ours['save_s']:.3f} | {ours['load_s']:.3f} | "
              f"{ours['bytes'] / 2**20:.1f} | {theirs['save_s']:.3f} | {theirs['load_s']:.3f} | "
              f"{theirs['bytes'] / 2**20:.1f} |", flush=True)
        zero3 = run_ranks(meshlm_times, 2, preset, root / "zero3", args.repeats, 2, "parallel.zero=3", timeout=1800)[0]
        print(f"| {preset} | {ours['params'] / 1e6:.1f}M | dp2-zero3 (2 ranks) | {zero3['save_s']:.3f} | "
              f"{zero3['load_s']:.3f} | {zero3['bytes'] / 2**20:.1f} | | | |", flush=True)
        shutil.rmtree(root, ignore_errors=True)
    print("\n| preset | sync save: blocked s | async save: blocked s | written after s | steps overlapped | "
          "their extra time s | step s |")
    print("|---|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        root = Path(args.dir) / preset
        a = async_times(preset, root / "async")
        print(f"| {preset} | {a['sync_s']:.3f} | {a['blocked_s']:.3f} | {a['written_s']:.3f} | {a['steps']} | "
              f"{a['slowdown_s']:.3f} | {a['step_s']:.3f} |", flush=True)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
