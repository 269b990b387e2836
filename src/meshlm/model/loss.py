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
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # a target that is not a token to predict (padding, masked prompt)

# Rows per chunk: ~32 MiB of fp32 logits at a time, whatever the vocabulary.
CHUNK_BYTES = 32 * 2**20


def chunk_rows(vocab_size: int) -> int:
    """Tokens per chunk of the loss (analysis/memory.py counts the same fp32 chunk)."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


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
    def forward(ctx, logits, targets, consume, offset=0, all_reduce=None):
        rows, n = chunk_rows(logits.shape[1]), logits.shape[0]
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
            chunk = logits[lo:lo + rows] - row_max[lo:lo + rows, None]  # a new fp32 chunk, in any dtype
            sums[1, lo:lo + rows] = chunk.gather(1, local[lo:lo + rows, None]).squeeze(1)
            torch.sum(chunk.exp_(), dim=-1, out=sums[0, lo:lo + rows])
            del chunk
        sums[1].masked_fill_(~mine, 0.0)
        if all_reduce is not None:
            all_reduce(sums, torch.distributed.ReduceOp.SUM)
        ignored = targets == IGNORE_INDEX
        lse = sums[0].log_().add_(row_max)
        loss = (lse - row_max - sums[1]).masked_fill_(ignored, 0.0)
        ctx.save_for_backward(logits, local.masked_fill_(~mine, -1), ignored, lse)
        ctx.consume = consume
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local, ignored, lse = ctx.saved_tensors
        grad = logits if ctx.consume else torch.empty_like(logits)
        rows = chunk_rows(logits.shape[1])
        scale = grad_loss.float().masked_fill(ignored, 0.0)
        mine = local >= 0
        for lo in range(0, logits.shape[0], rows):
            hi = min(lo + rows, logits.shape[0])
            # An fp32 chunk of consumed fp32 logits is their storage: the softmax overwrites it.
            chunk = logits[lo:hi].float() if ctx.consume else logits[lo:hi].to(torch.float32, copy=True)
            chunk.sub_(lse[lo:hi, None]).exp_()
            chunk.scatter_add_(1, local[lo:hi, None].clamp(min=0), -mine[lo:hi, None].float())
            chunk.mul_(scale[lo:hi, None])
            if chunk.data_ptr() != grad[lo:hi].data_ptr():
                grad[lo:hi].copy_(chunk)
            del chunk
        return grad, None, None, None, None


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, consume_logits: bool = False) -> torch.Tensor:
    """Summed cross-entropy over target tokens (fp32), ignoring positions marked IGNORE_INDEX.

    `consume_logits=True` lets backward overwrite the logits with their gradient (the trainer's
    path: it drops its reference right after the loss); never read them after backward then."""
    return ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), consume_logits).sum()


def consuming_token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The trainer's loss: token_loss_sum that reuses the logits' storage for their gradient."""
    return token_loss_sum(logits, targets, consume_logits=True)
