"""One rank of a training job: what torchrun starts (`python -m meshlm.train.worker --config F`),
and what `meshlm train` runs in-process when the world is a single rank.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.config import Config, load_config, resolve
from meshlm.mesh import ParallelContext, default_backend, default_device
from meshlm.train.data import prepare_data
from meshlm.train.host_memory import keep_freed_host_memory
from meshlm.train.trainer import Trainer
from meshlm.train.weights import save_final


def train_rank(cfg: Config) -> list[dict]:
    """Train on this rank (process group, if any, already initialised); rank 0 saves the result."""
    ctx = ParallelContext.from_config(cfg.parallel)
    if ctx.device.type == "cpu" and cfg.train.keep_host_memory:
        keep_freed_host_memory()
    # The launcher prepared the data before starting ranks, so this is a cache hit.
    data = prepare_data(cfg.data, cfg.model.vocab_size, log=lambda *a, **k: None)
    trainer = Trainer(cfg, ctx, data)
    rows = trainer.fit()
    state = trainer.full_state_dict()  # collective for sharded layouts: every rank takes part
    if ctx.rank == 0:
        final = save_final(state, cfg, data.tokenizer_path, Path(cfg.run.dir))
        trainer.metrics.print(f"saved final weights to {final}")
    trainer.metrics.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshlm.train.worker")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    cfg = resolve(load_config(args.config), world_size=world_size)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    backend = default_backend()
    device = default_device(backend)  # this rank's GPU (LOCAL_RANK) under NCCL, else the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL initialises, so it binds to the right GPU
    dist.init_process_group(backend)
    try:
        train_rank(cfg)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
