"""The language-modelling loss: summed next-token cross-entropy over the target tokens.
Reduces: the loss's memory from three fp32 [tokens, vocab] buffers (upcast logits, log-softmax,
its gradient) to the logits themselves plus one fp32 chunk; costs a second pass over the logits.

Summed, not averaged: the trainer divides by the global target-token count, so every layout
(data, context, pipeline parallel, any micro-batch split) computes the gradient of the same mean.

Why not `F.cross_entropy(logits.float())`: for the `1b` preset at seq 2048 and micro-batch 4 the
fp32 upcast alone is 4.2 GB, and autograd keeps the fp32 log-softmax for backward and then makes
two more [tokens, vocab] gradients. Here the logits stay in their own dtype (bf16 under mixed
precision), each chunk of rows is upcast, reduced to its log-sum-exp and dropped; backward
recomputes the softmax chunk by chunk from the saved logits and the per-token log-sum-exp.
With `consume_logits`, backward writes the gradient into the logits' own storage (Megatron's
trick in its vocab-parallel loss): the caller promises never to read the logits again.

The per-chunk maths lives in two functions (`ChunkKernels`): run eagerly they allocate fp32 chunks
and pass over them several times (~56 bytes of memory traffic per bf16 logit, forward and
backward); compiled (train.compile, parallel/compile.py) each becomes one fused kernel that reads
the logits and writes their gradient in the logits' dtype (~12 bytes, with the row maxima and the
copy of the gradient into the logits' storage).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

IGNORE_INDEX = -100  # a target that is not a token to predict (padding, masked prompt)

# Rows per chunk: ~32 MiB of fp32 logits at a time, whatever the vocabulary, and at most a
# quarter of the rows: the chunk is the loss's transient beside the logits, so with fewer rows
# than one chunk holds it would be as large as fp32 logits (a third more memory at the loss of a
# tp bench's 4 MiB logits). Rows are independent, so the result is the same at any chunking.
CHUNK_BYTES = 32 * 2**20
MIN_CHUNKS = 4
# Compiled (fused) chunk maths make no fp32 chunk: its only transient is backward's gradient chunk
# in the logits' dtype, so its chunks may be far larger, and must be on a GPU: every chunk costs a
# few launches and two compiled calls of host time (~0.1 ms each), and 32 MiB chunks made the 125m
# preset's loss (8,192 x 32,000 logits) 32 chunks and 8.8 ms on an H100, host-bound; 512 MiB
# (MIN_CHUNKS chunks there) 2.3 ms (benchmarks/gpu_profile.py, RESULTS.md "Session 21").
FUSED_CHUNK_BYTES = 512 * 2**20


def chunk_rows(vocab_size: int, tokens: int, fused: bool = False) -> int:
    """Tokens per chunk of the loss: rows of CHUNK_BYTES of fp32 logits (FUSED_CHUNK_BYTES for
    compiled chunk maths), at most a MIN_CHUNKS-th of them (analysis/memory.py counts the same
    fp32 chunk)."""
    per_chunk = (FUSED_CHUNK_BYTES if fused else CHUNK_BYTES) // (4 * vocab_size)
    return max(1, min(per_chunk, -(-tokens // MIN_CHUNKS)))


def exp_sum_and_target(chunk: torch.Tensor, local: torch.Tensor, row_max: torch.Tensor):
    """Forward, one chunk of rows: (sum_j exp(x_j - m), x_target - m), fp32, logits in any dtype."""
    shifted = chunk - row_max[:, None]  # a new fp32 chunk, in any dtype
    target = shifted.gather(1, local[:, None]).squeeze(1)
    return shifted.exp_().sum(-1), target


def softmax_minus_target(chunk: torch.Tensor, local: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                         mine: torch.Tensor, in_place: bool) -> torch.Tensor:
    """Backward, one chunk of rows: (softmax - onehot(target)) x the incoming gradient, fp32.
    `in_place` (consumed logits): an fp32 chunk is overwritten instead of copied."""
    g = chunk.float() if in_place else chunk.to(torch.float32, copy=True)
    g.sub_(lse[:, None]).exp_()
    g.scatter_add_(1, local[:, None].clamp(min=0), -mine[:, None].float())
    return g.mul_(scale[:, None])


def softmax_minus_target_fused(chunk: torch.Tensor, local: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                               mine: torch.Tensor) -> torch.Tensor:
    """`softmax_minus_target` for a compiler, in the logits' dtype: the same arithmetic written
    pointwise, the target's one-hot from a comparison with the column index instead of a scatter,
    so inductor makes it one kernel that reads the logits and writes their gradient (a scatter
    splits it in two around an fp32 intermediate). Eagerly this would allocate [rows, V] masks."""
    columns = torch.arange(chunk.shape[1], device=chunk.device)
    target = ((columns[None, :] == local[:, None]) & mine[:, None]).float()
    return ((chunk.float() - lse[:, None]).exp() - target).mul(scale[:, None]).to(chunk.dtype)


class ChunkKernels(NamedTuple):
    """The per-chunk maths of ChunkedCrossEntropy: `exp_sum_and_target(chunk, local, row_max)` and
    `grad(chunk, local, lse, scale, mine, in_place)`, whose result backward copies into the
    gradient unless it already is the gradient's storage; `chunk_rows(vocab, tokens)`, the rows
    of a chunk they are given."""

    exp_sum_and_target: Callable
    grad: Callable
    chunk_rows: Callable[[int, int], int] = chunk_rows


EAGER_KERNELS = ChunkKernels(exp_sum_and_target, softmax_minus_target)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token -log softmax(x)[target] over rows of x [N, V], fp32 maths, chunk by chunk.

    d loss / d x_j = softmax_j - [j == target] (times the incoming gradient); rows whose target is
    IGNORE_INDEX have loss 0 and a zero gradient. The row maximum m keeps exp from overflowing:
    log sum_j exp(x_j) = m + log sum_j exp(x_j - m).

    A vocabulary split across ranks (parallel/vocab_parallel.py) passes `all_reduce(t, op)` to
    combine the row maxima (MAX) and the sums of exponentials and target logits (SUM) over the
    ranks, and `offset`, the first vocabulary row of this rank; the target of a row then lives on
    exactly one rank. One process: no reduction, offset 0."""

    @staticmethod
    def forward(ctx, logits, targets, consume, offset=0, all_reduce=None, kernels=None):
        kernels = kernels or EAGER_KERNELS
        rows, n = kernels.chunk_rows(logits.shape[1], logits.shape[0]), logits.shape[0]
        local = targets - offset
        mine = (local >= 0) & (local < logits.shape[1]) & (targets != IGNORE_INDEX)
        local = local.masked_fill_(~mine, 0)
        row_max = torch.empty(n, dtype=torch.float32, device=logits.device)
        for lo in range(0, n, rows):
            row_max[lo:lo + rows] = torch.amax(logits[lo:lo + rows], dim=-1)  # exact in any dtype
        if all_reduce is not None:
            all_reduce(row_max, torch.distributed.ReduceOp.MAX)
        sums = torch.empty((2, n), dtype=torch.float32, device=logits.device)  # exp sums, target logits
        for lo in range(0, n, rows):
            sums[0, lo:lo + rows], sums[1, lo:lo + rows] = kernels.exp_sum_and_target(
                logits[lo:lo + rows], local[lo:lo + rows], row_max[lo:lo + rows])
        sums[1].masked_fill_(~mine, 0.0)
        if all_reduce is not None:
            all_reduce(sums, torch.distributed.ReduceOp.SUM)
        ignored = targets == IGNORE_INDEX
        lse = sums[0].log_().add_(row_max)
        loss = (lse - row_max - sums[1]).masked_fill_(ignored, 0.0)
        ctx.save_for_backward(logits, local.masked_fill_(~mine, -1), ignored, lse)
        ctx.consume, ctx.kernels = consume, kernels
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local, ignored, lse = ctx.saved_tensors
        grad = logits if ctx.consume else torch.empty_like(logits)
        rows = ctx.kernels.chunk_rows(logits.shape[1], logits.shape[0])
        scale = grad_loss.float().masked_fill(ignored, 0.0)
        mine = local >= 0
        for lo in range(0, logits.shape[0], rows):
            hi = min(lo + rows, logits.shape[0])
            chunk = ctx.kernels.grad(logits[lo:hi], local[lo:hi], lse[lo:hi], scale[lo:hi], mine[lo:hi], ctx.consume)
            if chunk.data_ptr() != grad[lo:hi].data_ptr():
                grad[lo:hi].copy_(chunk)
            del chunk
        return grad, None, None, None, None, None


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, consume_logits: bool = False,
                   kernels: ChunkKernels | None = None) -> torch.Tensor:
    """Summed cross-entropy over target tokens (fp32), ignoring positions marked IGNORE_INDEX.

    `consume_logits=True` lets backward overwrite the logits with their gradient (the trainer's
    path: it drops its reference right after the loss); never read them after backward then.
    `kernels`: the chunk maths, eager by default (compiled ones: parallel/compile.py)."""
    return ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), consume_logits,
                                     0, None, kernels).sum()

