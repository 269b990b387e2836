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


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed -log softmax(x)[target] over rows of x [N, V], fp32 maths, chunk by chunk.

    d loss / d x_j = softmax_j - [j == target] (times the incoming scalar gradient); rows whose
    target is IGNORE_INDEX contribute no loss and a zero gradient."""

    @staticmethod
    def forward(ctx, logits, targets, consume):
        rows = chunk_rows(logits.shape[1])
        keep = targets != IGNORE_INDEX
        safe_targets = targets.masked_fill(~keep, 0)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        target_logit = torch.empty_like(lse)
        for lo in range(0, logits.shape[0], rows):
            chunk = logits[lo:lo + rows].float()
            torch.logsumexp(chunk, dim=-1, out=lse[lo:lo + rows])
            target_logit[lo:lo + rows] = chunk.gather(1, safe_targets[lo:lo + rows, None]).squeeze(1)
            del chunk
        loss = (lse - target_logit).masked_fill_(~keep, 0.0).sum()
        ctx.save_for_backward(logits, safe_targets, keep, lse)
        ctx.consume = consume
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, keep, lse = ctx.saved_tensors
        grad = logits if ctx.consume else torch.empty_like(logits)
        rows = chunk_rows(logits.shape[1])
        scale = (grad_loss * keep).float()  # zero for ignored rows
        for lo in range(0, logits.shape[0], rows):
            hi = min(lo + rows, logits.shape[0])
            # An fp32 chunk of consumed fp32 logits is their storage: the softmax overwrites it.
            chunk = logits[lo:hi].float() if ctx.consume else logits[lo:hi].to(torch.float32, copy=True)
            chunk.sub_(lse[lo:hi, None]).exp_()
            chunk.scatter_add_(1, targets[lo:hi, None], -torch.ones((hi - lo, 1), device=chunk.device))
            chunk.mul_(scale[lo:hi, None])
            if chunk.data_ptr() != grad[lo:hi].data_ptr():
                grad[lo:hi].copy_(chunk)
            del chunk
        return grad, None, None


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, consume_logits: bool = False) -> torch.Tensor:
    """Summed cross-entropy over target tokens (fp32), ignoring positions marked IGNORE_INDEX.

    `consume_logits=True` lets backward overwrite the logits with their gradient (the trainer's
    path: it drops its reference right after the loss); never read them after backward then."""
    return _ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), consume_logits)


def consuming_token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The trainer's loss: token_loss_sum that reuses the logits' storage for their gradient."""
    return token_loss_sum(logits, targets, consume_logits=True)
