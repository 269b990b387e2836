"""`meshlm bench cp [--json]`: meshlm's context parallelism against PyTorch's `context_parallel`.
Reduces: guessing; both train the same model, weights and long batches at cp=2, alternating, in one job.
Costs: about a minute of the machine with the defaults (tiny preset, seq 2048, 2 warm-up + 20 pairs).

meshlm: `apply_context_parallel` (ring attention on P2P, head-tail load balancing, RoPE at global
positions) and `ContextParallel.shard` for the batch. The reference, as torchtitan uses it:
`torch.distributed.tensor.experimental.context_parallel(mesh, buffers=[inputs, targets, rope cos,
rope sin])` around forward and backward of the plain model, whose `CoreAttention` calls
`F.scaled_dot_product_attention(is_causal=True)`; torch's CP swaps that for its DTensor ring
(head-tail load balancing on, KV rotated by `set_rotate_method`, default all-gather). Both cut the
sequence into the same 2·cp chunks, so per-token losses can be compared after
`context_parallel_unshard` / `unshard_sequence`.

Each measurement is a training step (forward, backward, the gradient sum over the cp ranks with
the same code on both sides, AdamW) on one micro-batch; tokens/s is the whole batch over the
slowest rank's time; memory is `measure_peak_bytes` of one warm step, max over ranks. Before any
timing, one step of each side is checked against the other and against the single-process loss.

torch 2.13's CP intercepts only the CUDA SDPA kernels (flash, efficient, cudnn); on CPU the SDPA
call reaches `_scaled_dot_product_flash_attention_for_cpu`, which DTensor has no rule for. The
bench tries the reference anyway and, when it raises, reports it unavailable with the reason.
`--cpu-shim` instead routes that CPU kernel through torch CP's own ring code (a row named apart:
torch's algorithm, meshlm's glue). The model has one kv head per query head unless `--gqa`
(see `model_config`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshlm.bench.report import (first_sentence, bench_row, emit, loss_check_passed, parse_checked,
                                 prepare_cpu_rank, run_on_ranks)
from meshlm.bench.report import cpu_times, load_average, steal_fraction
from meshlm.errors import OneLineErrorParser
from meshlm.train.memtrack import measure_peak_bytes

LOSS_TOLERANCE = 1e-4  # fp32, per token: the two rings only sum the same blocks in a different order


# --------------------------------------------------------------------------- the two sides (every rank)


class _Side:
    """One trainable model: `forward_backward` leaves this rank's gradients of the global mean
    token loss in `.grad` and returns its per-token losses [B, S/cp]; `finish` sums the
    gradients over the cp ranks (same weights, different tokens) and steps AdamW."""

    def __init__(self, kind: str, cfg, comm, mesh, device):
        from meshlm.model import Llama, init_weights
        from meshlm.parallel.context import apply_context_parallel

        self.kind, self.mesh = kind, mesh
        self.model = Llama(cfg)
        init_weights(self.model, 1234)
        self.model.to(device)
        self.cp = apply_context_parallel(self.model, comm) if kind == "meshlm" else None
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=False)

    def _losses(self, inputs, targets, n_tokens):
        logits = self.model(inputs)
        losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        (losses.sum() / n_tokens).backward()  # the trainer's loss: summed, over the global count
        return losses.detach().view_as(targets)

    def forward_backward(self, inputs, targets):
        n_tokens = targets.numel()
        if self.cp is not None:
            return self._losses(*self.cp.shard(inputs, targets), n_tokens)
        from torch.distributed.tensor.experimental import context_parallel

        # context_parallel shards its buffers in place (and restores them on exit unless told
        # not to): the batch is this step's copy; the rope tables are max_seq_len == seq long.
        x, y, rope = inputs.clone(), targets.clone(), self.model.rope
        with context_parallel(self.mesh, buffers=[x, y, rope.cos, rope.sin], buffer_seq_dims=[1, 1, 0, 0],
                              no_restore_buffers={x, y}):
            # Backward inside too: the SDPA backward must also dispatch to torch's ring.
            return self._losses(x, y, n_tokens)

    def finish(self):
        grads = [p.grad for p in self.model.parameters()]
        flat = torch._utils._flatten_dense_tensors(grads)  # one collective, not one per tensor
        dist.all_reduce(flat)
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def unshard(self, losses):
        """Per-token losses of the whole batch [B, S] in sequence order, from every rank's shard."""
        if self.cp is not None:
            from meshlm.parallel.context import unshard_sequence

            shards = [torch.empty_like(losses) for _ in range(dist.get_world_size())]
            dist.all_gather(shards, losses.contiguous())
            return unshard_sequence(shards)
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard

        return context_parallel_unshard(self.mesh, [losses], [1])[0]


# --------------------------------------------------------------------------- opt-in: torch's ring on CPU


def _cpu_ring_handler(op_call, args, kwargs):
    """`--cpu-shim`: the CPU flash kernel and its backward routed through torch CP's own ring
    (`_templated_ring_attention[_backward]`: its rotater, merge and load-balancing pattern), as
    torch's `_sdpa_handler` does for the CUDA kernels. The glue is meshlm's, not torch's, so such
    a row is named apart from the reference torch ships."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa

    mesh = next(a for a in args if isinstance(a, DTensor)).device_mesh
    args = [a.to_local() if isinstance(a, DTensor) else a for a in args]
    names = [arg.name for arg in op_call._schema.arguments]
    named = {**dict(zip(names, args)), **kwargs}
    if op_call is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        results = cpa._templated_ring_attention(mesh.get_group(), 2, op_call, **named)
    else:
        results = cpa._templated_ring_attention_backward(mesh.get_group(), 2, op_call, grad_out_name="grad_out",
                                                         **named)
    return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in results)


def _cpu_shim_ops():
    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def _install_cpu_shim(on: bool) -> None:
    """Add (or remove) the handlers to the table torch CP installs while its context is active."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa

    for op in _cpu_shim_ops():
        if on:
            cpa.custom_ops[op] = _cpu_ring_handler
        else:
            cpa.custom_ops.pop(op, None)


def _single_process_losses(cfg, inputs, targets):
    """Per-token losses of the unparallelised model (same init) on the whole batch: the truth."""
    from meshlm.model import Llama, init_weights

    model = Llama(cfg)
    init_weights(model, 1234)
    with torch.no_grad():
        logits = model.to(inputs.device)(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:240]}"


def _agree(ok: bool, device) -> bool:
    """True on every rank only if `ok` is true on every rank (a side that failed anywhere is out)."""
    flag = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64, device=device)  # NCCL: on the GPU
    dist.all_reduce(flag)
    return flag.item() == 0


def _max_over_ranks(value: float, device) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _bench_rank(args_dict: dict) -> list[dict]:
    """Run on every rank: check, then alternate meshlm and torch CP steps; rank 0's rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    from meshlm.comm import Comm
    from meshlm.mesh import Layout, ParallelContext

    a = argparse.Namespace(**args_dict)
    world = dist.get_world_size()
    ctx = ParallelContext(Layout(cp=world))
    comm = Comm(ctx)
    prepare_cpu_rank(ctx.rank, ctx.device)
    mesh = init_device_mesh(ctx.device.type, (world,))
    # Head-tail load balancing on (it is torch's default; meshlm always balances), the rotation
    # method as asked: the options torch 2.13 has (its old `_set_cp_global_var` is gone).
    _cp_options.enable_load_balance = True
    set_rotate_method(a.rotate)
    shim = a.cpu_shim and ctx.device.type == "cpu"
    _install_cpu_shim(shim)
    try:
        return _measure(a, ctx, comm, mesh, shim)
    finally:
        _install_cpu_shim(False)


def _measure(a, ctx, comm, mesh, shim: bool) -> list[dict]:
    cfg = model_config(a.preset, a.seq, ctx.world_size, a.gqa)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=gen).to(ctx.device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    sides = {kind: _Side(kind, cfg, comm, mesh, ctx.device) for kind in ("meshlm", "torch")}
    check, unavailable = _check(sides, cfg, inputs, targets, ctx.device)
    times, peaks = _time(sides, inputs, targets, a.warmup, a.steps, ctx.device)

    tokens_per_step = a.batch * a.seq
    mine = [tokens_per_step / t for t in times["meshlm"]]
    extra = dict(preset=a.preset, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, seq_len=a.seq,
                 micro_batch=a.batch, rotate_method=a.rotate, cpu_shim=shim, device=ctx.device.type,
                 backend=ctx.backend, loss_tolerance=LOSS_TOLERANCE, **check)
    name, reference = f"cp{ctx.world_size}", f"torch context_parallel ({a.rotate})"
    if shim:
        name, reference = name + "-cpu-shim", f"torch CP ring, CPU shim ({a.rotate})"
    if unavailable is None:
        row = bench_row(name, ctx.world_size, reference, mine, [tokens_per_step / t for t in times["torch"]],
                        peaks["meshlm"], peaks["torch"], **extra)
    else:
        # DESIGN.md's fields all present; the reference's are null, never a made-up number.
        import statistics

        row = {"name": name, "world_size": ctx.world_size, "meshlm_tokens_per_s": statistics.median(mine),
               "reference": reference, "reference_tokens_per_s": None, "tokens_per_s_ratio": None,
               "tokens_per_s_ratio_quartiles": None, "meshlm_peak_bytes": peaks["meshlm"],
               "reference_peak_bytes": None, "memory_ratio": None, "pairs": 0, "meshlm_steps": len(mine),
               "reference_unavailable": f"torch context_parallel on {ctx.device.type}/{ctx.backend}: {unavailable}",
               **extra}
    row["loss_check_passed"] = loss_check_passed(check, ("meshlm_vs_single_max_abs_diff", "loss_max_abs_diff"),
                                                 LOSS_TOLERANCE)
    return [row]


def _check(sides: dict, cfg, inputs, targets, device) -> tuple[dict, str | None]:
    """One step of each side (also a warm-up) from the same weights on the same batch: per-token
    losses against each other and against the single-process model. A reference that raises is
    dropped from `sides` and its reason returned."""
    truth = _single_process_losses(cfg, inputs, targets)
    losses, unavailable = {}, None
    for kind, side in list(sides.items()):
        try:
            local = side.forward_backward(inputs, targets)
            ok = True
        except Exception as error:  # noqa: BLE001 - reported, never hidden: see the module doc
            ok, unavailable = False, _reason(error)
        if not _agree(ok, device):
            if kind == "meshlm":
                raise RuntimeError(f"meshlm's context parallel step failed: {unavailable}")
            del sides[kind]
            return _summary(losses, truth), unavailable or "failed on another rank"
        losses[kind] = side.unshard(local)
        side.finish()
    return _summary(losses, truth), None


def _summary(losses: dict, truth) -> dict:
    check = {"single_process_loss": truth.mean().item(), "meshlm_loss": losses["meshlm"].mean().item(),
             "meshlm_vs_single_max_abs_diff": (losses["meshlm"] - truth).abs().max().item()}
    if "torch" in losses:
        check.update(reference_loss=losses["torch"].mean().item(),
                     loss_max_abs_diff=(losses["meshlm"] - losses["torch"]).abs().max().item())
    return check


def _time(sides: dict, inputs, targets, warmup: int, steps: int, device) -> tuple[dict, dict]:
    """Alternating training steps: per side, the timed steps (slowest rank's seconds) and the
    per-rank peak bytes of one warm, untimed step (max over ranks)."""
    times = {kind: [] for kind in sides}
    peaks = {}
    # Memory on the last untimed step; with --warmup 0 one is added (the loss check's step before
    # it already created each side's optimizer state).
    warmup = max(warmup, 1)
    for i in range(warmup + steps):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]  # alternate who goes first
        for kind in order:
            side = sides[kind]

            def step():
                side.forward_backward(inputs, targets)
                side.finish()

            if i == warmup - 1:  # memory once, warm (optimizer state exists), not timed
                state = [*side.model.parameters(), *(v for s in side.opt.state.values() for v in s.values())]
                peaks[kind] = int(_max_over_ranks(measure_peak_bytes(step, state, device), device))
                continue
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = _max_over_ranks(time.perf_counter() - t0, device)  # a step ends when its slowest rank does
            if i >= warmup:
                times[kind].append(elapsed)
    return times, peaks


def model_config(preset: str, seq: int, world: int, gqa: bool = False):
    """The bench's ModelConfig: the preset with max_seq_len == seq (torch's CP shards the rope
    tables as sequence buffers, whole) and, unless `gqa`, as many kv heads as query heads: on
    CUDA in fp32 SDPA runs GQA only in its math kernel, which torch's CP does not intercept
    (flash needs fp16/bf16, the memory-efficient kernel has no GQA)."""
    from meshlm.config import load_config, resolve

    overrides = [f"model.preset={preset}", f"model.max_seq_len={seq}", f"train.seq_len={seq}",
                 "train.micro_batch_size=1", "train.global_batch_size=1", f"parallel.cp={world}"]
    cfg = resolve(load_config(None, overrides), world_size=world).model
    if not gqa and cfg.n_kv_heads != cfg.n_heads:
        cfg = resolve(load_config(None, [*overrides, f"model.n_kv_heads={cfg.n_heads}"]), world_size=world).model
    return cfg


# --------------------------------------------------------------------------- the command


def _print(rows: list[dict], as_json: bool, **context) -> None:
    """report.emit, but a row whose reference could not run gets its own line (format_rows needs
    the reference's numbers), and the loss check is spelled out."""
    if as_json or all(r["reference_tokens_per_s"] is not None for r in rows):
        emit(rows, as_json, **context)
    else:
        for r in rows:
            print(f"{r['name']:<6} ws {r['world_size']}  meshlm {r['meshlm_tokens_per_s']:,.0f} tok/s, "
                  f"{r['meshlm_peak_bytes'] / 2**20:.1f} MiB per rank  |  reference: {r['reference_unavailable']}")
        load, steal = context.get("load_average"), context.get("cpu_steal_fraction")
        print(f"load average {'/'.join(f'{v:.2f}' for v in load) if load else 'n/a'}, "
              f"cpu steal fraction {'n/a' if steal is None else f'{steal:.3f}'}")
    if as_json:
        return
    for r in rows:
        versus = (f"torch {r['reference_loss']:.6f} (max |meshlm - torch| per token {r['loss_max_abs_diff']:.2e})"
                  if "reference_loss" in r else "torch n/a")
        print(f"loss check {'passed' if r['loss_check_passed'] else 'FAILED'}: single process "
              f"{r['single_process_loss']:.6f}, meshlm {r['meshlm_loss']:.6f} (max |diff| per token "
              f"{r['meshlm_vs_single_max_abs_diff']:.2e}), {versus}")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="meshlm bench cp", description=first_sentence(__doc__))
    parser.add_argument("--json", action="store_true", help="print DESIGN.md's JSON rows")
    parser.add_argument("--nproc", type=int, default=2, help="cp ranks to fork when not under torchrun")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq", "--seq-len", dest="seq", type=int, default=2048, help="full sequence length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", "--pairs", dest="steps", type=int, default=20, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gqa", action="store_true", help="keep the preset's kv heads (default: one per query head)")
    parser.add_argument("--cpu-shim", action="store_true",
                        help="on CPU, route the CPU flash kernel through torch CP's own ring (a labelled stand-in)")
    parser.add_argument("--rotate", choices=("allgather", "alltoall"), default="allgather",
                        help="torch CP's KV rotation (set_rotate_method)")
    # --warmup 0 is allowed (as by every bench): the loss check's step warms both sides first
    args, code = parse_checked(parser, argv, "cp", {"nproc": 2, "steps": 1, "warmup": 0, "batch": 1, "seq": 1})
    if code is not None:
        return code
    from meshlm.config import ConfigError

    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    try:
        model_config(args.preset, args.seq, world, args.gqa)
    except ConfigError as e:
        print(f"meshlm bench cp: error: {e}", file=sys.stderr, flush=True)
        return 2
    before = cpu_times()
    rows = run_on_ranks(_bench_rank, vars(args), args.nproc)
    if rows is not None:
        _print(rows, args.json, load_average=load_average(), cpu_steal_fraction=steal_fraction(before, cpu_times()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
