"""Vocabulary-parallel embedding and cross-entropy at the edges: tokens and targets at every shard
boundary (first and last id of each rank, the padded last shard, an ignored target), tp 2, 3, 4
(3 and 4 pad a vocabulary of 10), and logits of magnitude ~1e4 in fp32 and bf16 — against
`F.embedding` and `F.cross_entropy` on the full tensors, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from meshlm.comm import Comm
from meshlm.mesh import Layout, ParallelContext
from meshlm.model.loss import IGNORE_INDEX
from meshlm.parallel.vocab_parallel import (VocabParallelEmbedding, VocabParallelLoss, VocabShard, gather_logits,
                                           vocab_parallel_cross_entropy)
from meshlm.testing import run_ranks

VOCAB, DIM = 10, 6


def boundary_ids(tp: int) -> list[int]:
    """The first and last real id of every rank's block (the last block is short when padded)."""
    ids = []
    for rank in range(tp):
        shard = VocabShard(VOCAB, tp, rank)
        if shard.real:
            ids += [shard.start, shard.start + shard.real - 1]
    return ids


def _ranks_loss(scale: float, dtype: torch.dtype):
    tp = torch.distributed.get_world_size()
    comm = Comm(ParallelContext(Layout(tp=tp)))
    rank = comm.ctx.group_rank("tp")
    shard = VocabShard(VOCAB, tp, rank)
    targets = torch.tensor(boundary_ids(tp) + [IGNORE_INDEX])
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(len(targets), VOCAB, generator=g) * scale).to(dtype)
    full[0, targets[0]] = scale  # one target that is also the row's largest logit
    local = full[:, shard.start: shard.start + shard.real].clone().requires_grad_(True)
    before = local.detach().clone()
    assert torch.equal(gather_logits(before, shard, comm), full)  # [tokens, vocab]; 3-D in test_tensor_parallel
    loss = vocab_parallel_cross_entropy(local, targets, shard, comm)
    loss.sum().backward()
    assert torch.equal(local.detach(), before)  # by default the logits are left as they were
    # The trainer's loss consumes its logits (backward writes their gradient over them: no second
    # [tokens, vocab/tp] buffer) and gives the same sum and gradient.
    consumed = before.clone().requires_grad_(True)
    total = VocabParallelLoss(shard, comm)(consumed, targets)
    total.backward()
    assert torch.allclose(total.detach(), loss.detach().float().sum(), rtol=1e-6)
    assert consumed.grad.data_ptr() == consumed.data_ptr() and torch.equal(consumed.grad, local.grad)
    return loss.detach(), local.grad.float(), shard.start, shard.real


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("scale,dtype", [(1.0, torch.float32), (1e4, torch.float32), (1e4, torch.bfloat16)],
                         ids=["fp32", "fp32-1e4", "bf16-1e4"])
def test_cross_entropy_at_every_shard_boundary(tp, scale, dtype):
    targets = torch.tensor(boundary_ids(tp) + [IGNORE_INDEX])
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(len(targets), VOCAB, generator=g) * scale).to(dtype)
    full[0, targets[0]] = scale
    ref_logits = full.float().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, targets, ignore_index=IGNORE_INDEX, reduction="none")
    ref.sum().backward()
    for loss, grad, start, real in run_ranks(_ranks_loss, tp, scale, dtype):
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
        assert loss[-1] == 0 and (grad[-1] == 0).all()  # the ignored target
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6 * scale)
        torch.testing.assert_close(grad, ref_logits.grad[:, start: start + real], rtol=1e-6, atol=1e-6)


def _ranks_embedding(tokens: torch.Tensor):
    tp = torch.distributed.get_world_size()
    comm = Comm(ParallelContext(Layout(tp=tp)))
    full = torch.nn.Embedding(VOCAB, DIM)
    torch.nn.init.normal_(full.weight, generator=torch.Generator().manual_seed(1))
    parallel = VocabParallelEmbedding(full, comm)
    out = parallel(tokens)
    out.pow(2).sum().backward()
    return out.detach(), parallel.weight.grad, parallel.shard.start, parallel.shard.real


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_embedding_at_every_shard_boundary(tp):
    tokens = torch.tensor([boundary_ids(tp)])
    full = torch.nn.Embedding(VOCAB, DIM)
    torch.nn.init.normal_(full.weight, generator=torch.Generator().manual_seed(1))
    ref = full(tokens)
    ref.pow(2).sum().backward()
    for out, grad, start, real in run_ranks(_ranks_embedding, tp, tokens):
        torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)
        torch.testing.assert_close(grad[:real], full.weight.grad[start: start + real], rtol=1e-6, atol=1e-7)
        assert (grad[real:] == 0).all()  # the padded rows of the last shard never receive a gradient
