"""Vocabulary-parallel embedding, output head and cross-entropy: each tp rank owns vocab/tp rows.
Reduces: the embedding, the head and the [tokens, vocab] logits (the largest activation of a small
model) by 1/tp per rank. Costs: one all-reduce of [B, S, h] after the lookup (or a reduce-scatter
under SP) and two all-reduces of [B, S] scalars in the loss; the logits are never gathered.

Padding: a vocabulary not divisible by tp is padded to the next multiple with zero rows at the
end. No token id reaches a padded row, and the head drops the padded rows before its GEMM (the
last rank's logits are simply narrower), so padding cannot change a logit, the loss or a gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.comm import Comm
from meshlm.model.loss import ChunkedCrossEntropy, ChunkKernels
from meshlm.parallel.tensor_layers import (TP, ParallelRegion, _ReduceFromTensorParallel, _ReduceScatterToSequence,
                                           mark_tp_sharded, shard_rows)



def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


class VocabShard:
    """Which vocabulary rows this rank owns: [start, start + real) of the padded per-rank block."""

    def __init__(self, vocab_size: int, tp: int, rank: int):
        self.vocab_size = vocab_size
        self.per_rank = padded_vocab(vocab_size, tp) // tp
        self.start = rank * self.per_rank
        self.real = max(0, min(self.per_rank, vocab_size - self.start))  # < per_rank on the last rank if padded


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the tokens in its vocabulary range (others give zero rows), then the
    partial embeddings are summed: all-reduce (TP), or reduce-scatter onto sequence shards (SP)."""

    def __init__(self, embedding: nn.Embedding, comm: Comm, *, sequence_parallel: bool = False):
        super().__init__()
        tp, rank = comm.ctx.size(TP), comm.ctx.group_rank(TP)
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.shard = VocabShard(embedding.num_embeddings, tp, rank)
        self.weight = nn.Parameter(shard_rows(embedding.weight.detach(), tp, rank, 0))
        mark_tp_sharded(self.weight, 0, embedding.num_embeddings)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.shard.start
        mine = (local >= 0) & (local < self.shard.real)
        partial = F.embedding(local.masked_fill(~mine, 0), self.weight)
        partial = partial.masked_fill_(~mine.unsqueeze(-1), 0.0)  # the lookup saves only indices
        if self.sequence_parallel:
            return _ReduceScatterToSequence.apply(partial, self.comm)
        return _ReduceFromTensorParallel.apply(partial, self.comm)


class VocabParallelHead(nn.Module):
    """The output head, column-parallel over the vocabulary: logits [B, S, real rows of this rank].

    Enters the parallel region itself (TP: f; SP: all-gather of the final norm's sequence shards).
    `weight` is a sharded [V_padded/tp, h] Parameter: the embedding's own when tied, so one
    Parameter serves both uses and receives the sum of both gradients, exactly as unsharded.
    """

    def __init__(self, weight: nn.Parameter, shard: VocabShard, comm: Comm, *, sequence_parallel: bool = False):
        super().__init__()
        self.weight = weight
        self.shard = shard
        self.region = ParallelRegion(comm, sequence_parallel)
        mark_tp_sharded(self.weight, 0, shard.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = self.region.enter(x)
        # the real rows only where this rank has padding: slicing the whole weight too would make
        # its gradient twice in backward (slice's backward copies it into a new full-size tensor)
        weight = self.weight if self.shard.real == self.weight.shape[0] else self.weight[: self.shard.real]
        try:
            return self.region.linear(full, weight)
        finally:
            self.region.leave()


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard,
                                 comm: Comm, consume: bool = False,
                                 kernels: ChunkKernels | None = None) -> torch.Tensor:
    """Per-token losses [..] (fp32; 0 where the target is IGNORE_INDEX) from logits [.., V/tp].

    The chunked loss of model/loss.py with the row maxima (all-reduce MAX) and the sums of
    exponentials and target logits (one all-reduce of a [2, N] tensor; the target's logit is held
    by exactly one rank) combined over the tp ranks. Backward needs no communication:
    d loss / d x_j = softmax_j - [j == target] from the saved logits and log-sum-exp.
    `consume=True` writes the gradient over the logits (the caller never reads them again);
    `kernels` is the chunk maths (eager by default)."""
    flat = ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), consume, shard.start,
                                     lambda t, op: comm.all_reduce(t, TP, op=op), kernels)
    return flat.view(targets.shape)


class VocabParallelLoss:
    """`loss_sum(logits, targets)`: the trainer's summed token loss, for vocab-sharded logits.
    Consumes the logits (their gradient is written over them): the trainer reads only the loss."""

    def __init__(self, shard: VocabShard, comm: Comm, kernels: ChunkKernels | None = None):
        self.shard = shard
        self.comm = comm
        self.kernels = kernels  # the chunk maths: eager (None) or compiled (parallel/compile.py)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.shard, self.comm, consume=True,
                                            kernels=self.kernels).sum()


def gather_logits(local: torch.Tensor, shard: VocabShard, comm: Comm) -> torch.Tensor:
    """The full [.., vocab] logits from every rank's [.., real] block (for tests and sampling;
    training never does this). Blocks are padded to equal width for the collective, then cut."""
    n = comm.ctx.size(TP)
    block = F.pad(local, (0, shard.per_rank - local.shape[-1])).contiguous()
    out = torch.empty((n * block.shape[0], *block.shape[1:]), dtype=block.dtype, device=block.device)
    comm.all_gather(out, block, TP)
    return out.view(n, *block.shape).movedim(0, -2).reshape(*block.shape[:-1], n * shard.per_rank)[..., : shard.vocab_size]
