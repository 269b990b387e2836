"""Tensor-parallel linear layers (Megatron-LM) and the sequence-parallel collectives around them.
Reduces: weights, gradients, optimizer state and most activations of each block by 1/tp per rank.
Costs: per block and micro-batch, 2 all-reduces of the activations forward and 2 backward (TP), or
the same volume as all-gathers + reduce-scatters (SP), on the critical path of every layer.

The pairing that makes this cheap (Shoeybi et al. 2019): a *column-parallel* linear splits its
output features, so rank r computes output columns r*out/tp.. from the full input with no
communication; a *row-parallel* linear splits its input features, so it can consume the column
layer's sharded output directly and only its partial outputs need summing: one all-reduce per
column/row pair. In autograd terms, Megatron's two conjugate operators:

    f  (enter the parallel region): forward identity,   backward all-reduce   (_CopyToTensorParallel)
    g  (leave it, after the row):   forward all-reduce, backward identity     (_ReduceFromTensorParallel)

Sequence parallelism (Korthikanti et al. 2022) replaces them: outside the region the activations
are sharded along the sequence, so f becomes an all-gather (backward: reduce-scatter) and g a
reduce-scatter (backward: all-gather). Same bytes (an all-reduce *is* a reduce-scatter plus an
all-gather), but the norms and residuals between the regions now hold 1/tp of the sequence.

Activations are [batch, seq, features]; the sequence is dimension 1. Every collective goes through
`meshlm.comm.Comm` on the "tp" axis, so it is traced and counted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.comm import Comm

TP = "tp"


# --------------------------------------------------------------------------- sequence collectives


def gather_sequence(shard: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[B, S/tp, ...] on each rank -> [B, S, ...], the shards concatenated in tp-rank order."""
    n = comm.ctx.size(TP)
    shard = shard.contiguous()
    # The collective concatenates along dim 0 (gloo wants the output shaped [n * B, ...]); one
    # copy then moves the rank index next to the sequence.
    out = torch.empty((n * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    comm.all_gather(out, shard, TP)
    return out.view(n, *shard.shape).movedim(0, 1).reshape(shard.shape[0], n * shard.shape[1], *shard.shape[2:])


def reduce_scatter_sequence(full: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[B, S, ...] partial sums on each rank -> [B, S/tp, ...]: rank r's sequence chunk, summed."""
    n = comm.ctx.size(TP)
    batch, seq = full.shape[:2]
    if seq % n:
        raise ValueError(f"sequence parallelism: sequence length {seq} is not divisible by tp={n}")
    chunks = full.reshape(batch, n, seq // n, *full.shape[2:]).movedim(1, 0).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=full.dtype, device=full.device)
    comm.reduce_scatter(out, chunks.view(n * batch, *chunks.shape[2:]), TP)
    return out


def sum_replica_gradients(param: nn.Parameter, comm: Comm, slices: int, replicas: int) -> None:
    """Sum the gradient of a slice over the tp ranks that replicate it, as it is computed (a hook
    before accumulation, so it composes with micro-batches and every data-parallel engine). One
    all-reduce over tp of a buffer with a slot per distinct slice, each rank filling its own:
    `slices` times the bytes of one gradient, but no extra process groups."""
    rank = comm.ctx.group_rank(TP)

    def reduce(grad: torch.Tensor) -> torch.Tensor:
        slots = grad.new_zeros((slices, *grad.shape))
        slots[rank // replicas] = grad
        comm.all_reduce(slots, TP)
        return slots[rank // replicas]

    param.register_hook(reduce)


# --------------------------------------------------------------------------- autograd operators


class _CopyToTensorParallel(torch.autograd.Function):
    """f: the input is replicated; each rank's gradient w.r.t. it is partial (its columns only)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()  # a fresh tensor from the GEMMs: reduced in place, as Megatron does
        ctx.comm.all_reduce(grad, TP)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: sum the row-parallel partial outputs; the gradient of a sum is the same on every rank."""

    @staticmethod
    def forward(ctx, x, comm):
        comm.all_reduce(x, TP)  # x is the GEMM's fresh output and nothing saved it: safe in place
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """SP's f: all-gather the sequence shards; backward reduce-scatters the partial gradients."""

    @staticmethod
    def forward(ctx, shard, comm):
        ctx.comm = comm
        return gather_sequence(shard, comm)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad, ctx.comm), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """SP's g: sum the partial outputs and keep this rank's sequence chunk; backward all-gathers."""

    @staticmethod
    def forward(ctx, full, comm):
        ctx.comm = comm
        return reduce_scatter_sequence(full, comm)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad, ctx.comm), None


class SequenceGather:
    """One all-gathered input shared by the column-parallel linears of a region (wq, wk, wv).

    Saving the gathered input for the weight gradients would keep a full-sequence [B, S, h] copy
    per region and undo half of what SP saves. Like Megatron, the linears save the *shard*; the
    first of them to run backward all-gathers it again, the others reuse that copy, and the last
    one drops it. Price: one extra all-gather per region in backward."""

    __slots__ = ("comm", "users", "full")

    def __init__(self, comm: Comm):
        self.comm = comm
        self.users = 0
        self.full: torch.Tensor | None = None

    def acquire(self, shard: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.full = gather_sequence(shard, self.comm)
        return self.full

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.full = None


class _ColumnLinearSavingShard(torch.autograd.Function):
    """y = full @ W^T where full = all-gather(shard), saving `shard` instead of `full`.

    `full` carries the input gradient (autograd sums it over the region's linears, then the
    gather's backward reduce-scatters it once); `shard` is only stored."""

    @staticmethod
    def forward(ctx, full, weight, shard, gather: SequenceGather):
        ctx.save_for_backward(shard, weight)
        ctx.gather = gather
        ctx.full_dtype = full.dtype
        gather.users += 1
        return F.linear(full, weight)  # under autocast, in the autocast dtype

    @staticmethod
    def backward(ctx, grad_out):
        # Backward runs outside autocast: compute in the dtype the forward GEMM used (grad_out's),
        # return each gradient in its input's dtype (fp32 master weights stay fp32).
        shard, weight = ctx.saved_tensors
        dtype = grad_out.dtype
        grad_full = (grad_out @ weight.to(dtype)).to(ctx.full_dtype)
        full = ctx.gather.acquire(shard).to(dtype)
        grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).t() @ full.reshape(-1, full.shape[-1])
        ctx.gather.release()
        return grad_full, grad_weight.to(weight.dtype), None, None


# --------------------------------------------------------------------------- parallel regions


class ParallelRegion:
    """The entry of a tensor-parallel region: where one input fans out to column-parallel linears.

    Installed on the module that owns those linears (attention: wq/wk/wv; the MLP: w1/w3) as a
    forward pre-hook, so the model's code is unchanged and the entry communicates once per
    region, not once per linear: TP applies f (backward: one all-reduce of the summed input
    gradient), SP all-gathers the sequence (backward: one reduce-scatter).
    """

    def __init__(self, comm: Comm, sequence_parallel: bool):
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.current: tuple[torch.Tensor, SequenceGather] | None = None  # during forward, under SP

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return _CopyToTensorParallel.apply(x, self.comm)
        self.current = (x, SequenceGather(self.comm))
        return _GatherFromSequence.apply(x, self.comm)

    def leave(self) -> None:
        self.current = None  # do not keep the last micro-batch's shard alive

    def linear(self, full: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A column-parallel GEMM on the region's (entered) input."""
        if not self.sequence_parallel:
            return F.linear(full, weight)
        if self.current is None:
            raise RuntimeError("a sequence-parallel column linear ran outside its region's forward")
        shard, gather = self.current
        return _ColumnLinearSavingShard.apply(full, weight, shard, gather)

    def install(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(lambda _m, args: (self.enter(args[0]), *args[1:]))
        # always_call: full recompute's rebuild stops the block's forward once it has what the
        # backward needs (torch.utils.checkpoint's early stop raises inside it); without the hook
        # the region's input, and through its autograd graph the whole rebuilt block, stayed
        # alive to the next forward
        module.register_forward_hook(lambda _m, _args, _out: self.leave(), always_call=True)


def mark_tp_sharded(param: nn.Parameter, dim: int, full_size: int, replicas: int = 1) -> nn.Parameter:
    """The grad-norm convention (parallel/data_parallel.py) plus what gathering needs: the shard
    dimension and the unpadded full size along it. `replicas` > 1: that many consecutive tp ranks
    hold the same slice (kv heads replicated when tp > n_kv_heads): `tp_slice` says which."""
    param.meshlm_tp_sharded = True
    param.meshlm_tp_dim = dim
    param.meshlm_tp_full_size = full_size
    param.meshlm_tp_replicas = replicas
    return param


def tp_slice(param: torch.Tensor, tp_rank: int) -> tuple[int, bool]:
    """(which slice of the full tensor along `meshlm_tp_dim` tp rank `tp_rank` holds, whether it
    is the first of that slice's replicas: the one that writes, gathers and counts it). For a
    parameter marked by `mark_tp_sharded`."""
    replicas = param.meshlm_tp_replicas
    return tp_rank // replicas, tp_rank % replicas == 0


def shard_rows(full: torch.Tensor, tp: int, rank: int, dim: int) -> torch.Tensor:
    """Rank `rank`'s equal slice of `full` along `dim`, zero-padded at the end to a multiple of tp."""
    size = full.shape[dim]
    padded = -(-size // tp) * tp
    if padded != size:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - size
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    return full.chunk(tp, dim=dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """y[..., out/tp] = x @ W[rank's output rows]^T. No bias (the Llama block has none).

    Inside a region (`region` given) the input has already entered the parallel region; a
    standalone layer (the output head) enters it itself: identity forward and an all-reduce of
    the input gradient in backward (TP), or an all-gather of the sequence (SP).
    """

    def __init__(self, weight_shard: torch.Tensor, comm: Comm, *, sequence_parallel: bool = False,
                 region: ParallelRegion | None = None, full_out_features: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight_shard)
        self.own_region = region is None
        self.region = region if region is not None else ParallelRegion(comm, sequence_parallel)
        mark_tp_sharded(self.weight, 0, full_out_features or weight_shard.shape[0] * comm.ctx.size(TP))

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, **kwargs) -> "ColumnParallelLinear":
        tp, rank = comm.ctx.size(TP), comm.ctx.group_rank(TP)
        if linear.out_features % tp:
            raise ValueError(f"column-parallel: {linear.out_features} output features not divisible by tp={tp}")
        return cls(shard_rows(linear.weight.detach(), tp, rank, 0), comm, **kwargs)

    @classmethod
    def replicated_heads(cls, linear: nn.Linear, comm: Comm, heads: int, **kwargs) -> "ColumnParallelLinear":
        """wk or wv when tp > n_kv_heads (tp a multiple of it), as Megatron does: each group of
        tp / heads consecutive ranks holds one whole kv head, the one its query heads use. Each
        replica's gradient covers only its own query heads, so the replicas' gradients are summed
        (`sum_replica_gradients`) and, equal from then on, keep the copies equal."""
        tp, rank = comm.ctx.size(TP), comm.ctx.group_rank(TP)
        replicas = tp // heads
        layer = cls(shard_rows(linear.weight.detach(), heads, rank // replicas, 0), comm, **kwargs)
        mark_tp_sharded(layer.weight, 0, linear.out_features, replicas)
        sum_replica_gradients(layer.weight, comm, heads, replicas)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.own_region:
            return self.region.linear(x, self.weight)
        try:
            return self.region.linear(self.region.enter(x), self.weight)
        finally:
            self.region.leave()


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[..., rank's in/tp] @ W[:, rank's input columns]^T: an all-reduce
    of the partial outputs (TP), or a reduce-scatter onto sequence shards (SP)."""

    def __init__(self, weight_shard: torch.Tensor, comm: Comm, *, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight_shard)
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        mark_tp_sharded(self.weight, 1, weight_shard.shape[1] * comm.ctx.size(TP))

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, **kwargs) -> "RowParallelLinear":
        tp, rank = comm.ctx.size(TP), comm.ctx.group_rank(TP)
        if linear.in_features % tp:
            raise ValueError(f"row-parallel: {linear.in_features} input features not divisible by tp={tp}")
        return cls(shard_rows(linear.weight.detach(), tp, rank, 1), comm, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            return _ReduceScatterToSequence.apply(partial, self.comm)
        return _ReduceFromTensorParallel.apply(partial, self.comm)
