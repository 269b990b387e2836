"""`meshlm bench dp [--zero 0,1,2,3] [--json]`: meshlm's data-parallel engines against PyTorch's.

Reduces: guessing whether meshlm's DDP / ZeRO / FSDP are as fast and as lean as PyTorch's own.
Costs: a few minutes of the machine with the defaults (world size 2, a ~4M-parameter model).

Per stage, on the same model, weights, data and world size, in one invocation, alternately
(round i runs meshlm first when i is even, last when odd; bench/timing.py):
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

import os
import statistics
import sys

import torch
import torch.distributed as dist

from meshlm.bench.report import (first_sentence, bench_row, below_minimum, parse_args, prepare_cpu_rank,
                                 run_and_emit)
from meshlm.bench.timing import alternate, exposed_share, measured_peak, random_batch
from meshlm.errors import OneLineErrorParser

REFERENCES = {0: "torch DDP", 1: "torch DDP", 2: "fully_shard(reshard=False)", 3: "fully_shard"}


def reference_label(engine: str, reference_model: str) -> str:
    """The reference column: PyTorch's engine, and the model it runs when that is not meshlm's."""
    return engine if reference_model == "meshlm" else f"{engine} + HF Llama"


# --------------------------------------------------------------------------- engines (every rank)


def model_config(opts):
    """The benchmark's model: the debug preset reshaped by the command line's dimensions."""
    from meshlm.config import load_config, resolve

    return resolve(load_config(None, [
        "model.preset=debug", f"model.dim={opts.dim}", f"model.n_layers={opts.layers}", f"model.n_heads={opts.heads}",
        f"model.n_kv_heads={opts.heads}", f"model.ffn_dim={opts.ffn}", f"model.vocab_size={opts.vocab}",
        f"model.max_seq_len={opts.seq}", f"train.seq_len={opts.seq}", "train.micro_batch_size=1",
        "train.global_batch_size=1"]))


def build_model(cfg, device):
    """`cfg.model`'s Llama with the weights every engine of a bench starts from (seed 1)."""
    from meshlm.model import Llama, init_weights

    model = Llama(cfg.model)
    init_weights(model, 1)
    return model.to(device)


def reference_optimizer(model, train, device) -> torch.optim.AdamW:
    """AdamW for the engines that are not meshlm's (torch's DDP / fully_shard and the compute-only
    step): meshlm's decay groups and the implementation meshlm's engines pick on `device`
    (SegmentAdamW), fused on CUDA. train/optim.py's per-tensor AdamW there would charge the
    reference and the compute-only time a slower optimizer than meshlm's, flattering meshlm's
    ratio and skewing the exposed-communication share."""
    from meshlm.parallel.mixed_precision import adamw_implementation, decays

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if decays(p)], "weight_decay": train.weight_decay},
              {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps,
                             **adamw_implementation(torch.device(device).type == "cuda"))


class Engine:
    """One data-parallel setup (bench/timing.py's engine): kind 'meshlm' (meshlm's engine for
    `zero`), 'reference' (torch DDP for zero 0/1, fully_shard for 2/3) or 'compute' (the model
    alone: no communication), on `cfg.model` (copied, not changed)."""

    def __init__(self, kind: str, zero: int, cfg, comm, device, bucket_mb: float = 25.0,
                 capture_buckets: bool = False, reference_model: str = "meshlm") -> None:
        import copy

        from meshlm.config import TrainConfig

        self.kind = kind
        cfg = copy.deepcopy(cfg)
        model = build_model(cfg, device)
        train = TrainConfig(lr=1e-4)
        self.n = dist.get_world_size()
        self.dp = None
        self.buckets: list[torch.Tensor] = []
        if kind == "meshlm":
            from meshlm.parallel.data_parallel import build_data_parallel

            cfg.parallel.zero = zero
            cfg.train = train
            options = {"bucket_bytes": bucket_mb * 2**20} if zero < 3 else {}
            self.dp = build_data_parallel(model, cfg, comm, **options)
            self.module = self.dp.module
        elif kind == "compute":  # no communication at all: the compute-only step
            self.module = model
        else:
            if reference_model == "transformers":  # the same weights in transformers' Llama
                from meshlm.bench.hf_twin import transformers_twin

                model = transformers_twin(model, device)
            self._wrap_reference(model, zero, bucket_mb, capture_buckets)
        self.model = model
        self.optimizer = reference_optimizer(model, train, device) if self.dp is None else None

    def _wrap_reference(self, model, zero: int, bucket_mb: float, capture_buckets: bool) -> None:
        """torch DDP (zero 0/1) or fully_shard per block, then the root (zero 2/3), around `model`."""
        if zero < 2:
            self.module = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
            if capture_buckets:  # the reducer's bucket buffers live in C++: make them visible
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                def hook(buffers, bucket):
                    buffers.append(bucket.buffer())
                    return default_hooks.allreduce_hook(None, bucket)

                self.module.register_comm_hook(self.buckets, hook)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(next(model.parameters()).device.type, (self.n,))
            blocks = model.model.layers if hasattr(model, "model") else model.layers  # transformers' or meshlm's
            for block in blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=zero == 3)
            fully_shard(model, mesh=mesh, reshard_after_forward=zero == 3)
            self.module = model

    def step(self, inputs, targets, tokens) -> None:
        from meshlm.model.loss import token_loss_sum

        # one expression: no name keeps the logits alive through backward (transformers returns
        # an output object holding them)
        loss = token_loss_sum(_logits(self.module(inputs)), targets) / tokens
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


def _logits(out):
    """A model's logits: meshlm's Llama returns them, transformers' an object holding them."""
    return getattr(out, "logits", out)


def _batch(step, opts, device):
    return random_batch(step, opts.batch * dist.get_world_size(), opts.seq, opts.vocab, device,
                        (dist.get_rank(), dist.get_world_size()))


def fresh_peak_bytes(kind: str, zero: int, cfg, comm, device, bucket_mb: float, warm_batch, batch,
                     reference_model: str = "meshlm") -> int:
    """Peak bytes of one step of a fresh engine after one warm-up step (optimizer state exists);
    fresh, because seeing torch DDP's bucket buffers takes a Python comm hook, too slow to time."""
    engine = Engine(kind, zero, cfg, comm, device, bucket_mb, capture_buckets=True, reference_model=reference_model)
    engine.step(*warm_batch)
    # ZeRO-3 frees gathered parameters by resizing storages in place: follow resizes.
    return measured_peak(engine, batch, comm, device, track_resizes=True)


def _bench_rank(opts) -> list[dict]:
    from meshlm.comm import Comm
    from meshlm.mesh import Layout, ParallelContext

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    ctx = ParallelContext(Layout(dp=dist.get_world_size()))
    comm = Comm(ctx)
    device = ctx.device
    prepare_cpu_rank(ctx.rank, device)
    rows = []
    cfg = model_config(opts)
    n_params = sum(p.numel() for p in build_model(cfg, "cpu").parameters())
    for zero in opts.zero:
        engines = {k: Engine(k, zero, cfg, comm, device, opts.bucket_mb, reference_model=opts.reference_model)
                   for k in ("meshlm", "reference", "compute")}
        timed = alternate(engines, lambda i: _batch(i, opts, device), comm, device, opts.warmup, opts.steps)
        times = {k: [t.step_s for t in v] for k, v in timed.items()}
        del engines
        peaks = {k: fresh_peak_bytes(k, zero, cfg, comm, device, opts.bucket_mb, _batch(1, opts, device),
                                     _batch(0, opts, device), opts.reference_model) for k in ("meshlm", "reference")}
        tokens = opts.batch * opts.seq * dist.get_world_size()
        compute = statistics.median(times["compute"])

        def exposed(k):
            return exposed_share(statistics.median(times[k]), compute)

        rows.append(bench_row(
            f"zero{zero}", dist.get_world_size(), reference_label(REFERENCES[zero], opts.reference_model),
            [tokens / t for t in times["meshlm"]],
            [tokens / t for t in times["reference"]], peaks["meshlm"], peaks["reference"],
            zero=zero, parameters=n_params, meshlm_step_s=statistics.median(times["meshlm"]),
            reference_step_s=statistics.median(times["reference"]), compute_only_step_s=compute,
            meshlm_exposed_comm_share=exposed("meshlm"), reference_exposed_comm_share=exposed("reference")))
    return rows


# --------------------------------------------------------------------------- command line


def _parse(argv):
    p = OneLineErrorParser(prog="meshlm bench dp", description=first_sentence(__doc__))
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
    p.add_argument("--reference-model", choices=("meshlm", "transformers"), default="meshlm",
                   help="the model PyTorch's engines run: meshlm's Llama (engine against engine, default) or "
                        "transformers' LlamaForCausalLM with the same weights (stack against stack)")
    p.add_argument("--json", action="store_true")
    opts = p.parse_args(argv)
    try:
        opts.zero = [int(z) for z in opts.zero.split(",")]
    except ValueError:
        p.error(f"--zero: expected a comma-separated list of 0..3, got {opts.zero!r}")
    if not opts.zero or any(z not in (0, 1, 2, 3) for z in opts.zero):
        p.error(f"--zero: stages are 0, 1, 2, 3, got {opts.zero}")
    # --warmup 0 is allowed (as by every bench): peak memory is weighed on a fresh engine's warm step anyway
    problem = below_minimum(opts, {**dict.fromkeys(("nproc", "steps", "dim", "layers", "heads", "ffn", "vocab", "seq",
                                                     "batch"), 1), "warmup": 0})
    if problem:
        p.error(problem)
    if opts.dim % opts.heads or (opts.dim // opts.heads) % 2 or opts.vocab < 260:
        p.error("--dim must split into --heads heads of even size, and --vocab must be >= 260")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts, code = parse_args(_parse, argv)
    if opts is None:
        return code
    if "RANK" not in os.environ and opts.nproc < 2:
        print("meshlm bench dp: --nproc must be >= 2 (data parallelism needs ranks)", file=sys.stderr)
        return 2
    run_and_emit(_bench_rank, opts, opts.nproc, opts.json, bench="dp")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
