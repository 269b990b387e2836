"""`meshlm bench tp [--json]`: meshlm's tensor (+sequence) parallelism against PyTorch's DTensor TP.
Reduces: guessing; both run the same model, weights and batches at tp=2, alternating, in one job.
Costs: about a minute of the machine with the defaults (tiny preset, seq 128, 6 pairs per row).

The reference is `torch.distributed.tensor.parallel.parallelize_module` with ColwiseParallel /
RowwiseParallel (+ SequenceParallel on the norms, PrepareModuleInput at the attention and MLP
entries: torchtitan's Llama plan) and `loss_parallel` for a vocabulary-sharded cross-entropy.
Embeddings are untied in both (DTensor cannot keep one Parameter sharded for two modules).

Each measurement is a training step (forward, backward, AdamW) on one micro-batch; tokens/s is
the whole batch over the slowest rank's time; memory is the per-rank peak (CUDA's allocator on
GPU, less what is resident before the step plus this model's own state; on CPU live tensor
bytes from a fresh counter, with DTensors counted by their local shards). Rows follow
DESIGN.md's bench schema (meshlm.bench.report).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshlm.bench.report import first_sentence, bench_row, parse_checked, prepare_cpu_rank, run_and_emit
from meshlm.bench.timing import alternate, measured_peak, random_batch
from meshlm.errors import OneLineErrorParser

IGNORE_INDEX = -100


# --------------------------------------------------------------------------- the reference


def dtensor_parallelize(model, mesh, sequence_parallel: bool) -> None:
    """PyTorch's TP on meshlm's Llama, in place: torchtitan's plan, names as in meshlm.parallel.tensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    outside = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    layer_plan = {
        "attention": PrepareModuleInput(input_layouts=(outside, None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=outside),
        "feed_forward": PrepareModuleInput(input_layouts=(outside,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=outside),
    }
    top_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=outside),
        "output": ColwiseParallel(input_layouts=outside, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        layer_plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        top_plan["norm"] = SequenceParallel()
    for block in model.layers:
        parallelize_module(block, mesh, layer_plan)
    parallelize_module(model, mesh, top_plan)


def dtensor_loss_sum(logits, targets):
    """The trainer's summed token loss on Shard(-1) DTensor logits; call inside `loss_parallel()`."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


# --------------------------------------------------------------------------- measuring (every rank)


class TensorParallelEngine:
    """Tensor parallelism over the whole world (bench/timing.py's engine): kind 'meshlm' or
    'dtensor', '+sp' for sequence parallelism, on ModelConfig `cfg`; AdamW on this rank's shards."""

    def __init__(self, kind: str, cfg, comm, mesh, device, max_norm: float = 1.0) -> None:
        import contextlib

        from meshlm.model import Llama, init_weights
        from meshlm.model.loss import token_loss_sum
        from meshlm.parallel.tensor import apply_tensor_parallel

        model = Llama(cfg)
        init_weights(model, 1234)
        model.to(device)
        sp = kind.endswith("+sp")
        if kind.startswith("meshlm"):
            tp = apply_tensor_parallel(model, comm, sp)  # None at tp=1: the plain model
            self.loss_fn, self.loss_ctx = (tp.loss_sum if tp else token_loss_sum), contextlib.nullcontext
        else:
            from torch.distributed.tensor.parallel import loss_parallel

            dtensor_parallelize(model, mesh, sp)
            self.loss_fn, self.loss_ctx = dtensor_loss_sum, loss_parallel
        self.model, self.comm, self.max_norm, self.meshlm = model, comm, max_norm, kind.startswith("meshlm")
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def step(self, inputs, targets, tokens) -> None:
        with self.loss_ctx():
            loss = self.loss_fn(self.model(inputs), targets) / tokens
            loss.backward()
        # Clipped to the global norm, as bench dp's engines (and so bench scaling's one-rank
        # baseline) are: both sides of a TP point then do the baseline's work.
        if self.meshlm:  # every distinct gradient element once over the tp ranks
            from meshlm.parallel.grad_norm import counts_toward_norm, global_grad_norm

            params = [p for p in self.model.parameters() if p.grad is not None]
            grads = [p.grad for p in params]
            squares = sum((p.grad.float().pow(2).sum() for p in params if counts_toward_norm(p, self.comm.ctx)),
                          torch.zeros((), device=grads[0].device))
            scale = (self.max_norm / (global_grad_norm(squares, self.comm) + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, scale)
        else:  # DTensors' norms reduce over the mesh; the plain (replicated) ones count once, as they are
            from torch.distributed.tensor import DTensor

            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            squares = sum(g.float().pow(2).sum().full_tensor() if isinstance(g, DTensor) else g.float().pow(2).sum()
                          for g in grads)
            scale = (self.max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
            for g in grads:  # one by one: torch's clip_grad_norm_ refuses a mix of DTensor and plain gradients
                g.mul_(scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self):
        return [*self.model.parameters(), *(v for s in self.optimizer.state.values() for v in s.values())]


def _bench_rank(args_dict: dict) -> list[dict]:
    """Run on every rank: alternate meshlm and DTensor steps, return rank 0's rows."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshlm.comm import Comm
    from meshlm.config import load_config, resolve
    from meshlm.mesh import Layout, ParallelContext

    a = argparse.Namespace(**args_dict)
    world = dist.get_world_size()
    ctx = ParallelContext(Layout(tp=world))
    comm = Comm(ctx)
    prepare_cpu_rank(ctx.rank, ctx.device)
    mesh = init_device_mesh(ctx.device.type, (world,))
    cfg = resolve(load_config(None, [f"model.preset={a.preset}", "model.tie_embeddings=false",
                                     f"train.seq_len={a.seq_len}", f"parallel.tp={world}"]), world_size=world).model
    batch = random_batch(0, a.batch, a.seq_len, cfg.vocab_size, ctx.device)
    rows = []
    for sp in a.sp_modes:
        pair = {kind: TensorParallelEngine(kind, cfg, comm, mesh, ctx.device)
                for kind in (("meshlm+sp", "dtensor+sp") if sp else ("meshlm", "dtensor"))}
        timed = alternate(pair, lambda i: batch, comm, ctx.device, a.warmup, a.pairs)
        times = {k: [t.step_s for t in v] for k, v in timed.items()}
        peak = {k: measured_peak(e, batch, comm, ctx.device) for k, e in pair.items()}  # warm: optimizer state exists
        mine, ref = list(pair)
        tokens_per_step = a.batch * a.seq_len
        rows.append(bench_row(
            f"tp{world}" + ("+sp" if sp else ""), world, "DTensor " + ("TP+SequenceParallel" if sp else "TP"),
            [tokens_per_step / t for t in times[mine]], [tokens_per_step / t for t in times[ref]],
            peak[mine], peak[ref], preset=a.preset, seq_len=a.seq_len, micro_batch=a.batch,
            device=ctx.device.type, backend=ctx.backend))
        del pair
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="meshlm bench tp", description=first_sentence(__doc__))
    parser.add_argument("--json", action="store_true", help="print DESIGN.md's JSON rows")
    parser.add_argument("--nproc", type=int, default=2, help="tp ranks to fork when not under torchrun")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sp", choices=("both", "on", "off"), default="both")
    # --warmup 0 is allowed (as by every bench): memory is weighed after the timed steps, warm
    args, code = parse_checked(parser, argv, "tp", {"nproc": 2, "pairs": 1, "warmup": 0, "batch": 1, "seq_len": 1})
    if code is not None:
        return code
    from meshlm.config import ConfigError, load_config, resolve

    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    try:
        resolve(load_config(None, [f"model.preset={args.preset}", f"train.seq_len={args.seq_len}",
                                   f"parallel.tp={world}", "parallel.sp=true"]), world_size=world)
    except ConfigError as e:
        print(f"meshlm bench tp: error: {e}", file=sys.stderr, flush=True)
        return 2
    params = {**vars(args), "sp_modes": {"both": [False, True], "on": [True], "off": [False]}[args.sp]}
    run_and_emit(_bench_rank, params, args.nproc, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
