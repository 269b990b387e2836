"""`meshlm bench dp [--zero 0,1,2,3] [--json]`: meshlm's data-parallel engines against PyTorch's.

Reduces: guessing whether meshlm's DDP / ZeRO / FSDP are as fast and as lean as PyTorch's own.
Costs: a few minutes of the machine with the defaults (world size 2, a ~4M-parameter model).

Per stage, on the same model, weights, data and world size, in one invocation, alternately
(pair i runs meshlm first when i is even, the reference first when odd):
  zero 0 and 1 -> torch DistributedDataParallel, zero 2 -> fully_shard(reshard_after_forward=False),
  zero 3 -> fully_shard. A third, communication-free step (the same model trained locally with
  AdamW) gives the compute-only time; exposed communication = (step - compute-only) / step.
A step's time is the slowest rank's; tokens/s count the global batch. Peak memory is measured on
one extra step per engine: CUDA's allocator peak on GPU; on CPU a dispatch-mode count of live
tensor storages that re-reads every storage's size after each op (FSDP frees unsharded
parameters by resizing storages, which a count of allocations alone would miss).
Runs under torchrun with that world (`torchrun --nproc-per-node 2 -m meshlm.bench.dp`), otherwise
forks `--nproc` ranks on gloo.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from meshlm.bench.report import bench_row, pin_rank_to_core, run_and_emit
from meshlm.train.memtrack import measure_peak_bytes

REFERENCES = {0: "torch DDP", 1: "torch DDP", 2: "fully_shard(reshard=False)", 3: "fully_shard"}


# --------------------------------------------------------------------------- engines (every rank)


def _model(opts, device):
    from meshlm.config import load_config, resolve
    from meshlm.model import Llama, init_weights

    cfg = resolve(load_config(None, [
        "model.preset=debug", f"model.dim={opts.dim}", f"model.n_layers={opts.layers}", f"model.n_heads={opts.heads}",
        f"model.n_kv_heads={opts.heads}", f"model.ffn_dim={opts.ffn}", f"model.vocab_size={opts.vocab}",
        f"model.max_seq_len={opts.seq}", f"train.seq_len={opts.seq}", "train.micro_batch_size=1",
        "train.global_batch_size=1"]))
    model = Llama(cfg.model)
    init_weights(model, 1)
    return model.to(device), cfg


class Engine:
    """One trainable setup with a uniform `step(inputs, targets, tokens)` and `state()`."""

    def __init__(self, kind: str, zero: int, opts, comm, device, capture_buckets: bool = False) -> None:
        from meshlm.config import TrainConfig
        from meshlm.train.optim import build_optimizer

        self.kind = kind
        model, cfg = _model(opts, device)
        train = TrainConfig(lr=1e-4)
        self.n = dist.get_world_size()
        self.dp = None
        self.buckets: list[torch.Tensor] = []
        if kind == "meshlm":
            from meshlm.parallel.data_parallel import build_data_parallel

            cfg.parallel.zero = zero
            cfg.train = train
            options = {"bucket_bytes": opts.bucket_mb * 2**20} if zero < 3 else {}
            self.dp = build_data_parallel(model, cfg, comm, **options)
            self.module = self.dp.module
        elif kind == "compute":  # no communication at all: the compute-only step
            self.module = model
        elif zero < 2:
            self.module = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=opts.bucket_mb)
            if capture_buckets:  # the reducer's bucket buffers live in C++: make them visible
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                def hook(buffers, bucket):
                    buffers.append(bucket.buffer())
                    return default_hooks.allreduce_hook(None, bucket)

                self.module.register_comm_hook(self.buckets, hook)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (self.n,))
            for block in model.layers:
                fully_shard(block, mesh=mesh, reshard_after_forward=zero == 3)
            fully_shard(model, mesh=mesh, reshard_after_forward=zero == 3)
            self.module = model
        self.model = model
        self.optimizer = build_optimizer(model, train) if self.dp is None else None

    def step(self, inputs, targets, tokens) -> None:
        from meshlm.model.loss import token_loss_sum

        loss = token_loss_sum(self.module(inputs), targets) / tokens
        if self.dp is not None:
            loss.backward()
            self.dp.finish_backward()
            self.dp.clip_and_step(1e-4, 1.0)
            self.dp.zero_grad()
            return
        (loss * (self.n if self.kind == "reference" else 1)).backward()  # torch DDP/FSDP average
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self):
        if self.dp is not None:
            return list(self.dp.state_tensors())
        out = [p for p in self.model.parameters()] + [p.grad for p in self.model.parameters() if p.grad is not None]
        out += self.buckets
        for st in self.optimizer.state.values():
            out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        return out


def _batch(step, opts, device):
    g = torch.Generator().manual_seed(step)
    rows = torch.randint(0, opts.vocab, (opts.batch * dist.get_world_size(), opts.seq + 1), generator=g)
    r = dist.get_rank()
    mine = rows[r * opts.batch: (r + 1) * opts.batch].to(device)
    return mine[:, :-1], mine[:, 1:], float(rows.shape[0] * opts.seq)


def _timed(engine: Engine, step: int, opts, comm, device) -> float:
    inputs, targets, tokens = _batch(step, opts, device)
    comm.barrier()
    t0 = time.perf_counter()
    engine.step(inputs, targets, tokens)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    comm.all_reduce(slowest, "world", op=dist.ReduceOp.MAX)
    return slowest.item()


def _peak_bytes(kind: str, zero: int, opts, comm, device) -> int:
    """Peak bytes of one step of a fresh engine after one warm-up step (optimizer state exists)."""
    engine = Engine(kind, zero, opts, comm, device, capture_buckets=True)
    engine.step(*_batch(1, opts, device))
    inputs, targets, tokens = _batch(0, opts, device)
    # ZeRO-3 frees gathered parameters by resizing storages in place: follow resizes.
    peak = measure_peak_bytes(lambda: engine.step(inputs, targets, tokens), engine.state(), device,
                              track_resizes=True)
    biggest = torch.tensor([float(peak)], dtype=torch.float64, device=device)
    comm.all_reduce(biggest, "world", op=dist.ReduceOp.MAX)
    return int(biggest.item())


def _bench_rank(opts) -> list[dict]:
    from meshlm.comm import Comm
    from meshlm.mesh import Layout, ParallelContext

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    ctx = ParallelContext(Layout(dp=dist.get_world_size()))
    comm = Comm(ctx)
    device = ctx.device
    pin_rank_to_core(ctx.rank, device)
    rows = []
    n_params = sum(p.numel() for p in _model(opts, "cpu")[0].parameters())
    for zero in opts.zero:
        engines = {k: Engine(k, zero, opts, comm, device) for k in ("meshlm", "reference", "compute")}
        times = {k: [] for k in engines}
        for i in range(opts.warmup + opts.steps):
            order = ("meshlm", "reference", "compute") if i % 2 == 0 else ("reference", "meshlm", "compute")
            for k in order:
                t = _timed(engines[k], i, opts, comm, device)
                if i >= opts.warmup:
                    times[k].append(t)
        del engines
        peaks = {k: _peak_bytes(k, zero, opts, comm, device) for k in ("meshlm", "reference")}
        tokens = opts.batch * opts.seq * dist.get_world_size()
        compute = statistics.median(times["compute"])

        def exposed(k):
            step = statistics.median(times[k])
            return max(0.0, (step - compute) / step)

        rows.append(bench_row(
            f"zero{zero}", dist.get_world_size(), REFERENCES[zero], [tokens / t for t in times["meshlm"]],
            [tokens / t for t in times["reference"]], peaks["meshlm"], peaks["reference"],
            zero=zero, parameters=n_params, meshlm_step_s=statistics.median(times["meshlm"]),
            reference_step_s=statistics.median(times["reference"]), compute_only_step_s=compute,
            meshlm_exposed_comm_share=exposed("meshlm"), reference_exposed_comm_share=exposed("reference")))
    return rows


# --------------------------------------------------------------------------- command line


def _parse(argv):
    p = argparse.ArgumentParser(prog="meshlm bench dp", description=__doc__.splitlines()[0])
    p.add_argument("--zero", default="0,1,2,3", help="comma-separated stages (0 = DDP)")
    p.add_argument("--nproc", type=int, default=2, help="ranks to fork (ignored under torchrun)")
    p.add_argument("--steps", type=int, default=6, help="timed pairs per stage")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP/ZeRO bucket size for both sides")
    p.add_argument("--json", action="store_true")
    opts = p.parse_args(argv)
    try:
        opts.zero = [int(z) for z in opts.zero.split(",")]
    except ValueError:
        p.error(f"--zero: expected a comma-separated list of 0..3, got {opts.zero!r}")
    if not opts.zero or any(z not in (0, 1, 2, 3) for z in opts.zero):
        p.error(f"--zero: stages are 0, 1, 2, 3, got {opts.zero}")
    for key in ("nproc", "steps", "dim", "layers", "heads", "ffn", "vocab", "seq", "batch"):
        if getattr(opts, key) < 1:
            p.error(f"--{key}: must be >= 1")
    if opts.dim % opts.heads or (opts.dim // opts.heads) % 2 or opts.vocab < 260:
        p.error("--dim must split into --heads heads of even size, and --vocab must be >= 260")
    return opts


def main(argv: list[str] | None = None) -> int:
    try:
        opts = _parse(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if "RANK" not in os.environ and opts.nproc < 2:
        print("meshlm bench dp: --nproc must be >= 2 (data parallelism needs ranks)", file=sys.stderr)
        return 2
    run_and_emit(_bench_rank, opts, opts.nproc, opts.json, bench="dp")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
