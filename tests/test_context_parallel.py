"""Context parallelism (ring attention, head-tail load balancing) against full causal attention
and against the single-process run, alone and composed with dp, zero-3, tp+sp and pp."""

import pytest
import torch
import torch.nn.functional as F

from meshlm.testing import run_ranks
from meshlm.parallel.context import local_positions, ring_bytes, shard_sequence, unshard_sequence

from helpers import UnevenlyMaskedLoader, build_trainer, cli_train_args, read_metrics, run_meshlm, small_cfg

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
    world, extra = LAYOUTS[layout]
    results = run_ranks(_losses_grads_weights, world, corpus, tmp_path / layout, world, *extra, timeout=300)
    _assert_equal_runs(results, reference)


# Llama 3.1's rope scaling on an 8-token original context: the 32-token windows (16 per cp rank)
# lie past it, so each rank's tokens need the scaled frequencies at their global positions.
LLAMA3 = ["model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_low_freq_factor=1",
          "model.rope_high_freq_factor=4", "model.rope_original_max_seq_len=8"]


@pytest.fixture(scope="module")
def scaled_reference(corpus, tmp_path_factory):
    return _losses_grads_weights(corpus, tmp_path_factory.mktemp("one-scaled"), 1, *LLAMA3)


@pytest.mark.parametrize("layout", ["cp2", "cp2-pp2"])
def test_a_llama3_scaled_context_parallel_run_equals_one_process(corpus, tmp_path, reference, scaled_reference, layout):
    # the scaling changes the model here: far more than the tolerance below
    assert max(abs(a - b) for a, b in zip(scaled_reference[0], reference[0])) > 2e-5, (scaled_reference[0], reference[0])
    world, extra = LAYOUTS[layout]
    results = run_ranks(_losses_grads_weights, world, corpus, tmp_path / layout, world, *extra, *LLAMA3, timeout=300)
    _assert_equal_runs(results, scaled_reference)


def _assert_equal_runs(results, reference):
    ref_losses, ref_grads, ref_weights, _ = reference
    for losses, grads, weights, rank in results:
        assert losses == pytest.approx(ref_losses, abs=1e-5), rank
        if grads is not None and rank == 0:
            for name, ref in ref_grads.items():
                assert torch.allclose(grads[name], ref, atol=1e-6, rtol=0), (name, (grads[name] - ref).abs().max())
        if rank == 0:  # the gathered full weights live on global rank 0
            assert weights.keys() == ref_weights.keys()
            for name, ref in ref_weights.items():
                assert torch.allclose(weights[name], ref, atol=1e-5, rtol=0), name


# --------------------------------------------------------------------------- what it costs


def _ring_send_bytes(corpus, run_dir, world_size, *extra):
    cfg = small_cfg(corpus, run_dir, world_size, *extra, steps=1)
    trainer = build_trainer(cfg)
    trainer.forward_backward()
    sent = sum(r["bytes_sent"] for r in trainer.comm.summary() if r["op"] == "send" and r["axis"] == "cp")
    return sent, trainer.ctx.rank, trainer.comm.recorder.pending()


@pytest.mark.parametrize("world,extra", [
    (2, ["parallel.cp=2"]),
    (4, ["parallel.cp=4", "train.dtype=bfloat16"]),
    (4, ["parallel.cp=2", "parallel.tp=2", "train.recompute=full"]),
    (2, ["parallel.cp=2", "train.recompute=selective"]),  # the ring stores no scores: nothing rerun
], ids=["cp2", "cp4-bf16", "tp2-cp2-recompute", "cp2-selective"])
def test_ring_bytes_per_rank_equal_the_formula(corpus, tmp_path, world, extra):
    cfg = small_cfg(corpus, tmp_path, world, *extra, steps=1)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    per_layer = ring_bytes(t.micro_batch_size, t.seq_len // p.cp, m.n_kv_heads // p.tp, m.head_dim,
                           2 if t.dtype == "bfloat16" else 4, p.cp)
    forwards = 2 if t.recompute == "full" else 1
    micro_batches = t.global_batch_size // (t.micro_batch_size * p.dp)
    expected = m.n_layers * micro_batches * (forwards * per_layer["forward"] + per_layer["backward"])
    for sent, rank, pending in run_ranks(_ring_send_bytes, world, corpus, tmp_path, world, *extra):
        assert sent == expected, rank
        assert pending == [], rank  # every exchange the step started was waited for (and so counted)


def _saved_activation_bytes(corpus, run_dir, world_size, *extra):
    """Bytes autograd keeps for backward after one micro-batch's forward (parameters excluded)."""
    cfg = small_cfg(corpus, run_dir, world_size, "train.seq_len=64", "model.n_layers=2", *extra, steps=1)
    trainer = build_trainer(cfg)
    params = {p.data_ptr() for p in trainer.model.parameters()}
    seen = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[(t.data_ptr(), tuple(t.shape), t.dtype)] = t.numel() * t.element_size()
        return t

    inputs, targets = trainer._shard(next(iter(trainer.loader.microbatches(0, 0, 1, cfg.train.micro_batch_size))))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.loss_sum(trainer.dp.module(inputs), targets)
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("cp", [2, 4])
def test_activation_memory_per_rank_falls_as_one_over_cp(corpus, tmp_path, cp):
    (single,) = run_ranks(_saved_activation_bytes, 1, corpus, tmp_path / "one", 1)
    measured = run_ranks(_saved_activation_bytes, cp, corpus, tmp_path / "cp", cp, f"parallel.cp={cp}")
    for rank_bytes in measured:  # every stored activation is per token: predicted single / cp
        assert rank_bytes == pytest.approx(single / cp, rel=0.02), (rank_bytes, single)


def test_meshlm_train_cp2_dp2_follows_the_single_process_loss_curve(corpus, single_cli_run, tmp_path):
    reference_dir, _ = single_cli_run
    run_meshlm(*cli_train_args(corpus, tmp_path, "parallel.cp=2", "parallel.dp=2", nproc=4))
    reference, rows = read_metrics(reference_dir), read_metrics(tmp_path)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], abs=1e-5)
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals == pytest.approx([r["eval_loss"] for r in reference if "eval_loss" in r], abs=1e-5) and evals


@pytest.mark.parametrize("world,overrides,key", [
    (2, ["parallel.cp=2", "train.seq_len=30"], "parallel.cp"),  # 30 tokens: not 4 equal chunks
    (8, ["model.n_kv_heads=4", "parallel.cp=2", "parallel.tp=4", "parallel.sp=true", "train.seq_len=36"], "parallel.sp"),  # 18 per cp rank
    (2, ["parallel.cp=0"], "parallel.cp"),
])
def test_bad_context_parallel_configs_name_the_key(world, overrides, key):
    from meshlm.config import ConfigError, load_config, resolve

    with pytest.raises(ConfigError) as err:
        resolve(load_config(None, ["model.preset=debug", *overrides]), world_size=world)
    assert key in str(err.value) and "\n" not in str(err.value)


def _block_gradients(q, k, v, dout, causal, fused):
    from meshlm.parallel.context import _block_backward, _block_forward

    out, lse = _block_forward(q, k, v, causal, fused)
    return (out, lse, *_block_backward(dout, q, k, v, out, lse, causal, fused))


def test_cuda_flash_block_calls_match_the_kernels_signatures(monkeypatch):
    """Runs anywhere: the CUDA kernel's calls on meta tensors (PyTorch's shape functions), GQA
    included, give the shapes the ring's merge and gradient sums expect."""
    from meshlm.parallel import context

    monkeypatch.setattr(context, "_flash_kernel", lambda q, fused: "cuda")
    q, dout = (torch.empty(2, 6, 16, 64, dtype=torch.bfloat16, device="meta") for _ in range(2))
    k, v = (torch.empty(2, 2, 16, 64, dtype=torch.bfloat16, device="meta") for _ in range(2))
    out, lse, dq, dk, dv = _block_gradients(q, k, v, dout, True, True)
    assert out.shape == q.shape and lse.shape == (2, 6, 16) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="needs a CUDA GPU with FlashAttention-2 (sm80+)")
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_flash_blocks_equal_the_portable_math(causal):
    """On a GPU: a block's output, log-sum-exp and gradients from the flash kernel against the
    portable fp32 math, both in bf16 (so bf16's tolerance); GQA 6 query heads on 2 kv heads."""
    from meshlm.parallel.context import _flash_kernel

    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 6, 64, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2, 64, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    assert _flash_kernel(q, True) == "cuda"
    math_log2 = 0.6931471805599453
    flash = _block_gradients(q, k, v, dout, causal, True)
    math = _block_gradients(q, k, v, dout, causal, False)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), flash, math):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.allclose(a.float(), b.float(), atol=3e-2, rtol=2e-2), (name, (a.float() - b.float()).abs().max())
    # The ring hands each block's backward the *merged* output and log-sum-exp, not the block's
    # own: as if another block had held half the softmax mass (lse + log 2, the output halved).
    from meshlm.parallel.context import _block_backward

    out, lse = flash[0], flash[1]
    merged = [(out * 0.5).to(out.dtype), lse + math_log2]
    for name, a, b in zip(("dq", "dk", "dv"), _block_backward(dout, q, k, v, *merged, causal, True),
                          _block_backward(dout, q, k, v, *merged, causal, False)):
        assert torch.allclose(a.float(), b.float(), atol=3e-2, rtol=2e-2), (name, (a.float() - b.float()).abs().max())


@pytest.mark.parametrize("device, dtype, head_dim, capability, flash_on, hip, fused, expected", [
    ("cpu", torch.float32, 64, None, True, None, True, "cpu"),
    ("cpu", torch.float32, 64, None, True, None, False, None),  # fused=False: the portable math
    ("cuda", torch.bfloat16, 64, (8, 0), True, None, True, "cuda"),
    ("cuda", torch.float16, 256, (9, 0), True, None, True, "cuda"),
    ("cuda", torch.bfloat16, 64, (8, 0), True, None, False, None),
    ("cuda", torch.bfloat16, 64, (7, 5), True, None, True, None),  # FlashAttention-2 needs sm80+
    ("cuda", torch.float32, 64, (8, 0), True, None, True, None),  # bf16/fp16 only
    ("cuda", torch.bfloat16, 60, (8, 0), True, None, True, None),  # head_dim a multiple of 8
    ("cuda", torch.bfloat16, 264, (8, 0), True, None, True, None),  # ... up to 256
    ("cuda", torch.bfloat16, 64, (8, 0), False, None, True, None),  # torch.backends.cuda.enable_flash_sdp(False)
    ("cuda", torch.bfloat16, 64, (8, 0), True, "6.0", True, None),  # ROCm's kernel differs
    ("mps", torch.bfloat16, 64, None, True, None, True, None),
], ids=lambda v: str(v))
def test_the_flash_kernel_is_chosen_only_where_it_exists(monkeypatch, device, dtype, head_dim, capability,
                                                         flash_on, hip, fused, expected):
    """The decision table of `_flash_kernel`, on any machine: q stands in for a tensor on `device`
    and the CUDA queries answer as that GPU would."""
    from types import SimpleNamespace

    from meshlm.parallel.context import _flash_kernel

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: flash_on)
    monkeypatch.setattr(torch.version, "hip", hip)
    q = SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(2, 4, 16, head_dim))
    assert _flash_kernel(q, fused) == expected


def test_ring_attention_uses_the_devices_kernel_unless_told_not_to():
    from meshlm.comm import Comm
    from meshlm.mesh import Layout, ParallelContext
    from meshlm.parallel.context import RingAttention

    comm = Comm(ParallelContext(Layout()))
    assert RingAttention(comm).ring.fused is True and RingAttention(comm, fused=False).ring.fused is False


def test_load_balanced_rotary_gives_each_rank_the_scaled_tables_of_its_global_positions():
    from meshlm.model.llama import Llama3Scaling, RotaryEmbedding
    from meshlm.parallel.context import LoadBalancedRotary

    scaling = Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8)
    full = RotaryEmbedding(16, 32, 10000.0, scaling)
    assert not torch.equal(full.cos, RotaryEmbedding(16, 32, 10000.0).cos)
    for rank in range(2):
        cos, sin = LoadBalancedRotary(full, cp=2, rank=rank)(16)
        positions = local_positions(32, 2, rank)
        assert torch.equal(cos, full.cos[positions]) and torch.equal(sin, full.sin[positions])


def test_load_balanced_rotary_refuses_a_full_sequence_past_max_seq_len():
    from meshlm.model.llama import RotaryEmbedding
    from meshlm.parallel.context import LoadBalancedRotary

    rope = LoadBalancedRotary(RotaryEmbedding(16, 32, 10000.0), cp=2, rank=1)
    cos, _ = rope(16)  # 2 x 16 = 32 = max_seq_len: allowed
    assert cos.shape[-2] == 16
    with pytest.raises(ValueError, match="sequence length 34 exceeds max_seq_len=32"):
        rope(17)
