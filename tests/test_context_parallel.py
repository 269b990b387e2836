"""Context parallelism (ring attention, head-tail load balancing) against full causal attention
and against the single-process run, alone and composed with dp, zero-3, tp+sp and pp."""

import pytest
import torch
import torch.nn.functional as F

from meshlm.testing import run_ranks
from meshlm.parallel.context import local_positions, ring_bytes, shard_sequence, unshard_sequence

from helpers import UnevenlyMaskedLoader, build_trainer, small_cfg

STEPS = 3
DIM = 8


def _attention_inputs(heads, kv_heads, seq, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = [(2, heads, seq, DIM), (2, kv_heads, seq, DIM), (2, kv_heads, seq, DIM), (2, heads, seq, DIM)]
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def _ring_attention_rank(heads, kv_heads, seq, fused):
    from meshlm.comm import Comm
    from meshlm.mesh import Layout, ParallelContext
    from meshlm.parallel.context import RingAttention

    ctx = ParallelContext(Layout(cp=torch.distributed.get_world_size()))
    cp, rank = ctx.size("cp"), ctx.coord("cp")
    q, k, v, dout = _attention_inputs(heads, kv_heads, seq)
    q, k, v = [shard_sequence(t, cp, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
    out = RingAttention(Comm(ctx), fused=fused)(q, k, v)
    out.backward(shard_sequence(dout, cp, rank, dim=2))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (6, 2), (5, 1)])
@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash", "math"])
def test_ring_attention_equals_full_causal_attention(cp, heads, kv_heads, fused):
    seq = 2 * cp * 3  # three tokens per chunk: uneven within a chunk, odd head counts
    results = run_ranks(_ring_attention_rank, cp, heads, kv_heads, seq, fused)
    q, k, v, dout = [t.requires_grad_(i < 3) for i, t in enumerate(_attention_inputs(heads, kv_heads, seq))]
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    ref.backward(dout)
    for i, (name, expected) in enumerate(zip(("out", "dq", "dk", "dv"), (ref.detach(), q.grad, k.grad, v.grad))):
        got = unshard_sequence([r[i] for r in results], dim=2)
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (name, (got - expected).abs().max())


def test_load_balanced_layout():
    # cp=2, 8 tokens: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(24).view(1, 24)
    shards = [shard_sequence(x, 3, r) for r in range(3)]
    assert sorted(torch.cat(shards, 1).flatten().tolist()) == list(range(24))
    assert torch.equal(unshard_sequence(shards), x)
    for r in range(3):
        assert torch.equal(shards[r].flatten(), local_positions(24, 3, r))


# --------------------------------------------------------------------------- whole model


def _losses_grads_weights(corpus, run_dir, world_size, *extra):
    cfg = small_cfg(corpus, run_dir, world_size, "model.n_layers=4", *extra, steps=STEPS)
    trainer = build_trainer(cfg, UnevenlyMaskedLoader)  # dp/cp ranks hold different token counts
    trainer.forward_backward()
    grads = None
    if trainer.pipeline is None:
        grads = {n: g.clone() for n, g in trainer.dp.full_grads().items()}
        if trainer.tp:  # tp shards -> full tensors (collective over tp)
            grads = trainer.tp.full_state_dict(grads)
    trainer.dp.zero_grad()
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    weights = {name: t.detach().clone() for name, t in trainer.full_state_dict().items()}
    return losses, grads, weights, trainer.ctx.rank


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    return _losses_grads_weights(corpus, tmp_path_factory.mktemp("one"), 1)


LAYOUTS = {
    "cp2": (2, ["parallel.cp=2"]),
    "dp2-cp2": (4, ["parallel.cp=2", "parallel.dp=2"]),
    "tp2-sp-cp2": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
    "cp2-pp2": (4, ["parallel.cp=2", "parallel.pp=2"]),
    "dp2-cp2-zero3": (4, ["parallel.cp=2", "parallel.dp=2", "parallel.zero=3"]),
    "cp4-recompute-full": (4, ["parallel.cp=4", "train.recompute=full"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_run_equals_one_process(corpus, tmp_path, reference, layout):
    ref_losses, ref_grads, ref_weights, _ = reference
    world, extra = LAYOUTS[layout]
    results = run_ranks(_losses_grads_weights, world, corpus, tmp_path / layout, world, *extra, timeout=300)
    for losses, grads, weights, rank in results:
        assert losses == pytest.approx(ref_losses, abs=1e-5), rank
        if grads is not None and rank == 0:
            for name, ref in ref_grads.items():
                assert torch.allclose(grads[name], ref, atol=1e-6, rtol=0), (name, (grads[name] - ref).abs().max())
        if rank == 0:  # the gathered full weights live on global rank 0
            assert weights.keys() == ref_weights.keys()
            for name, ref in ref_weights.items():
                assert torch.allclose(weights[name], ref, atol=1e-5, rtol=0), name
