"""The Llama decoder against Hugging Face, its initialisation, parameter counts and FLOPs."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from meshlm.analysis.flops import device_peak_tflops, flops_per_token, mfu, peak_tflops_for_name
from meshlm.config import ModelConfig
from meshlm.model import Llama, count_parameters, init_weights, initial_value
from meshlm.model.llama import RMSNorm, apply_rope, rope_tables
from meshlm.model.presets import PRESETS
from meshlm.train.checkpoint.hf import hf_name  # a pure renaming: no q/k permutation (see there)

transformers = pytest.importorskip("transformers")


def small_cfg(**overrides) -> ModelConfig:
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=80, vocab_size=97,
                max_seq_len=64, rope_theta=10000.0, tie_embeddings=False, norm_eps=1e-5)
    return ModelConfig(preset="custom", **(base | overrides))


def built(cfg: ModelConfig, seed: int = 0) -> Llama:
    model = Llama(cfg)
    init_weights(model, seed)
    return model


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


# --------------------------------------------------------------------------- Hugging Face parity


def hf_twin(model: Llama):
    cfg = model.cfg
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        # transformers 5 moved rope_theta into rope_parameters.
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta} if cfg.rope_scaling != "llama3" else {
            "rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_seq_len},
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False,
        attn_implementation="eager",  # transformers 5: a config field, no longer a model argument
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict({hf_name(k): v for k, v in model.state_dict().items()}, strict=True)
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == cfg.tie_embeddings
    return hf


def scale_up(model) -> None:
    """Init std 0.02 gives near-uniform logits, in which an error could hide; scale the weights
    up. x5 keeps fp32 rounding (SDPA vs HF's eager matmuls) ~7x below the 1e-5 tolerance."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(5)


@pytest.mark.parametrize("n_heads,n_kv_heads,tied,seq,batch", [
    (4, 4, False, 16, 2),   # multi-head
    (8, 2, False, 13, 2),   # grouped-query, odd length
    (8, 2, True, 16, 2),    # grouped-query, tied head
    (4, 1, True, 7, 2),     # multi-query
    (4, 1, False, 64, 2),   # full max_seq_len
    (4, 2, False, 9, 4),    # grouped-query, as many sequences as query heads (dims of equal size)
])
def test_logits_and_loss_match_hugging_face(n_heads, n_kv_heads, tied, seq, batch):
    cfg = small_cfg(n_heads=n_heads, n_kv_heads=n_kv_heads, tie_embeddings=tied, n_layers=3)
    model = built(cfg, seed=7)
    scale_up(model)
    hf = hf_twin(model)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(input_ids=tokens, labels=tokens)
    assert ours.dtype == torch.float32 and ours.shape == (batch, seq, cfg.vocab_size)
    assert ours.abs().max() > 1.0  # the comparison below is not of near-zero numbers
    assert (ours - theirs.logits).abs().max() <= 1e-5
    assert abs(next_token_loss(ours, tokens) - theirs.loss) <= 1e-5


LLAMA3 = dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=0.5, rope_high_freq_factor=2.0,
              rope_original_max_seq_len=16)


@pytest.mark.parametrize("tied,seq", [(False, 64), (True, 37)])
def test_llama3_rope_scaling_matches_hugging_face(tied, seq):
    """Llama 3.1's scaled frequencies (rope_type "llama3"): an original context of 16 positions
    and head_dim 16 put frequencies in all three bands (kept, blended, divided by the factor),
    and 64 positions run 4x past the original context."""
    from meshlm.model.llama import Llama3Scaling

    cfg = small_cfg(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, tie_embeddings=tied, **LLAMA3)
    scaling = Llama3Scaling.of(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    wavelen = 2 * math.pi / inv_freq
    kept, divided = wavelen < 16 / 2.0, wavelen > 16 / 0.5
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # every band is exercised
    scaled = scaling.apply(inv_freq)
    assert torch.equal(scaled[kept], inv_freq[kept]) and torch.equal(scaled[divided], inv_freq[divided] / 8)
    model = built(cfg, seed=3)
    scale_up(model)
    hf = hf_twin(model)
    assert torch.equal(hf.model.rotary_emb.inv_freq, scaled)
    tokens = torch.randint(0, cfg.vocab_size, (2, seq))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(input_ids=tokens).logits
        unscaled = built(dataclasses.replace(cfg, rope_scaling="none"), seed=3)
    assert ours.abs().max() > 1.0
    assert (ours - theirs).abs().max() <= 1e-5
    # and the scaling is not a no-op here: without it the same weights give other logits
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (unscaled(tokens) - ours).abs().max() > 1e-2


# --------------------------------------------------------------------------- building blocks


def test_rmsnorm_matches_its_formula():
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(3, 5, 16)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    assert norm.to(torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16


def test_rope_rotates_each_pair_by_position_times_frequency():
    head_dim, theta, seq = 8, 100.0, 6
    cos, sin = rope_tables(head_dim, seq, theta)
    x = torch.randn(1, 1, seq, head_dim)
    out = apply_rope(x, cos, sin)
    half = head_dim // 2
    for p in range(seq):
        for i in range(half):
            angle = p * theta ** (-2 * i / head_dim)
            a, b = x[0, 0, p, i].item(), x[0, 0, p, i + half].item()
            assert out[0, 0, p, i].item() == pytest.approx(a * math.cos(angle) - b * math.sin(angle), abs=1e-5)
            assert out[0, 0, p, i + half].item() == pytest.approx(b * math.cos(angle) + a * math.sin(angle), abs=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_tables(16, 32, 10000.0)
    q, k = torch.randn(16), torch.randn(16)

    def score(q_pos, k_pos):
        qr = apply_rope(q.view(1, 1, 1, -1), cos[q_pos], sin[q_pos])
        kr = apply_rope(k.view(1, 1, 1, -1), cos[k_pos], sin[k_pos])
        return (qr * kr).sum().item()

    assert score(5, 2) == pytest.approx(score(20, 17), abs=1e-5)


def test_model_is_causal():
    model = built(small_cfg())
    tokens = torch.randint(0, 97, (2, 12))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 97
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_explicit_positions_equal_the_default_ones():
    model = built(small_cfg())
    tokens = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, positions=torch.arange(10)), model(tokens), rtol=0, atol=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_bfloat16_forward_runs_in_bfloat16():
    model = built(small_cfg()).to(torch.bfloat16)
    logits = model(torch.randint(0, 97, (2, 9)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


# --------------------------------------------------------------------------- initialisation and tying


def test_tied_head_is_the_embedding():
    model = built(small_cfg(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())  # one tensor, initialised once
    untied = built(small_cfg(tie_embeddings=False))
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert not torch.equal(untied.output.weight, untied.tok_embeddings.weight)


def test_init_is_deterministic_per_seed():
    a, b, c = built(small_cfg(), 3).state_dict(), built(small_cfg(), 3).state_dict(), built(small_cfg(), 4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    # Different names draw from different streams even with equal shapes.
    assert not torch.equal(a["layers.0.attention.wq.weight"], a["layers.1.attention.wq.weight"])


def test_init_does_not_depend_on_the_global_rng_or_on_the_layout():
    cfg = small_cfg(n_layers=4)
    torch.manual_seed(123)
    full = built(cfg, seed=5).state_dict()
    name = "layers.1.attention.wq.weight"
    torch.manual_seed(456)
    assert torch.equal(full[name], built(cfg, seed=5).state_dict()[name])
    # What a pipeline stage or a tensor-parallel rank computes for the pieces it owns:
    assert torch.equal(full[name], initial_value(name, tuple(full[name].shape), 5, cfg))
    rows = initial_value(name, tuple(full[name].shape), 5, cfg)[8:16]  # rank 1 of 4, column-parallel
    assert torch.equal(rows, full[name][8:16])


def test_init_distributions():
    cfg = small_cfg(dim=64, ffn_dim=256, n_layers=8)
    params = dict(built(cfg).named_parameters())
    assert torch.equal(params["layers.3.ffn_norm.weight"], torch.ones(64))
    assert torch.equal(params["norm.weight"], torch.ones(64))
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["layers.3.feed_forward.w1.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["layers.3.feed_forward.w2.weight"].std().item() == pytest.approx(0.02 / 4, rel=0.05)


def test_meta_init_then_to_empty_equals_direct_init():
    cfg = small_cfg(tie_embeddings=True)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    init_weights(model, 11)
    assert model.output.weight is model.tok_embeddings.weight
    direct = built(cfg, 11)
    tokens = torch.randint(0, 97, (1, 8))
    with torch.no_grad():
        assert torch.equal(model(tokens), direct(tokens))


# --------------------------------------------------------------------------- counts and FLOPs


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_matches_the_built_model(tied):
    cfg = small_cfg(tie_embeddings=tied, n_layers=3)
    counts = count_parameters(cfg)
    params = dict(Llama(cfg).named_parameters())  # a tied head is listed once, as the embedding
    assert counts["total"] == sum(p.numel() for p in params.values())
    assert counts["head"] == (0 if tied else 97 * 32)

    def size(*prefixes):
        return sum(p.numel() for name, p in params.items() if name.startswith(prefixes))

    assert counts["embedding"] == size("tok_embeddings.")
    assert counts["head"] == size("output.")
    assert counts["attention_per_layer"] == size("layers.1.attention.")  # wq, wk, wv (GQA: 2 kv heads of 4), wo
    assert counts["mlp_per_layer"] == size("layers.1.feed_forward.")
    assert counts["layer"] == size("layers.1.")
    assert counts["norms"] == sum(p.numel() for name, p in params.items() if name.endswith("norm.weight"))


def test_parameter_count_of_published_models():
    llama2_7b = ModelConfig(preset="llama2-7b", **PRESETS["llama2-7b"])
    assert count_parameters(llama2_7b)["total"] == 6_738_415_616  # Meta's Llama-2-7b
    llama3_8b = ModelConfig(preset="llama3-8b", **PRESETS["llama3-8b"])
    assert count_parameters(llama3_8b)["total"] == 8_030_261_248  # Meta's Llama-3-8B


def test_flops_per_token_by_hand():
    cfg = ModelConfig(preset="debug", **PRESETS["debug"])  # dim 64, 2 layers, 4 heads, 2 kv, ffn 160, vocab 512
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64  # wq, wk, wv (2 kv heads of 16), wo = 12288
    mlp = 3 * 64 * 160  # 30720
    head = 512 * 64  # 32768
    n_matmul = 2 * (attention + mlp) + head  # 118784
    assert flops_per_token(cfg, 128) == 6 * n_matmul + 12 * 2 * 64 * 128 == 909_312
    # Tying does not remove the head's matmul.
    assert flops_per_token(dataclasses.replace(cfg, tie_embeddings=True), 128) == 909_312


def test_peak_lookup_and_mfu():
    assert peak_tflops_for_name("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert peak_tflops_for_name("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert peak_tflops_for_name("NVIDIA A100-SXM4-80GB", "float32") == 156.0
    assert peak_tflops_for_name("NVIDIA A10G", "bfloat16") == 125.0
    assert peak_tflops_for_name("NVIDIA L4", "bfloat16") == 121.0
    assert peak_tflops_for_name("NVIDIA L40", "bfloat16") == 181.0  # not the L4's: keys are whole words
    assert peak_tflops_for_name("NVIDIA L40S", "bfloat16") == 362.0
    assert peak_tflops_for_name("NVIDIA GH200 480GB", "bfloat16") == 989.0
    assert peak_tflops_for_name("Some Future GPU", "bfloat16") is None
    assert device_peak_tflops(torch.device("cpu"), "bfloat16") is None


def test_fp32_mfu_on_a_gpu_needs_tf32(monkeypatch):
    """fp32 matmuls run as TF32 only when allowed; PyTorch's default ("highest") runs them on CUDA
    cores, 7x below the TF32 peak on an H100: no MFU then, rather than one understated 7x."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")  # constructing it touches no GPU
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert device_peak_tflops(cuda, "float32") is None and device_peak_tflops(cuda, "bfloat16") == 989.0
        torch.set_float32_matmul_precision("high")
        assert device_peak_tflops(cuda, "float32") == 494.5
    finally:
        torch.set_float32_matmul_precision(before)
    assert mfu(1000.0, 1e9, 100.0, 2) == pytest.approx(0.005)
    assert mfu(1000.0, 1e9, None, 2) is None


# --------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("consume", [False, True])
def test_chunked_loss_and_gradient_equal_cross_entropy(monkeypatch, dtype, consume):
    from meshlm.model import loss as loss_module

    vocab, n = 32, 37  # more rows than vocabulary entries: no loop may run over the wrong one
    # 4 rows per chunk: ten chunks, the last one ragged (37 = 9 * 4 + 1).
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 4 * 4 * vocab)
    assert loss_module.chunk_rows(vocab, n) == 4
    gen = torch.Generator().manual_seed(3)
    base = (torch.randn(n, vocab, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[[0, 5, 36]] = loss_module.IGNORE_INDEX  # in the first, a middle and the ragged chunk
    ref_logits = base.clone().requires_grad_()
    # torch's default ignore_index, -100: the label convention of transformers' datasets too
    ref = F.cross_entropy(ref_logits.float(), targets, reduction="sum")
    (ref * 0.5).backward()
    logits = base.clone().requires_grad_()
    ours = loss_module.token_loss_sum(logits, targets, **({"consume_logits": True} if consume else {}))
    (ours * 0.5).backward()
    assert ours.dtype == torch.float32
    assert abs(ours.item() - ref.item()) <= 1e-5 * abs(ref.item())
    grad = logits.grad.float()
    assert grad.dtype == torch.float32 and logits.grad.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: one rounding of the gradient
    assert (grad - ref_logits.grad.float()).abs().max() <= tolerance
    assert grad[[0, 5, 36]].abs().max() == 0
    # consume_logits reuses the logits' storage for their gradient; by default they stay intact.
    assert (logits.grad.data_ptr() == logits.data_ptr()) == consume
    if not consume:
        assert torch.equal(logits.detach(), base)


def test_the_trainers_loss_writes_the_gradient_into_the_logits():
    """The trainer's loss (build_loss, eager and compiled): no second [tokens, vocab] buffer in backward."""
    from meshlm.config import load_config, resolve
    from meshlm.parallel.apply import build_loss

    logits = torch.randn(2, 3, 32)  # [batch, seq, vocab], as the model returns them
    targets = torch.arange(6).view(2, 3)
    expected = F.cross_entropy(logits.view(6, 32), targets.view(6), reduction="sum")
    for compiled in ("false", "true"):
        cfg = resolve(load_config(None, [f"train.compile={compiled}", "train.compile_backend=aot_eager"]))
        x = logits.clone().requires_grad_()
        loss = build_loss(cfg, None, comm=None)(x, targets)
        assert abs(loss.item() - expected.item()) <= 1e-5 * expected.item()
        loss.backward()
        assert x.grad.data_ptr() == x.data_ptr(), compiled


def test_a_chunk_holds_at_least_one_row_and_at_most_chunk_bytes_or_a_quarter_of_the_rows():
    from meshlm.model.loss import CHUNK_BYTES, MIN_CHUNKS, chunk_rows

    many = 10**7
    assert chunk_rows(CHUNK_BYTES, many) == 1  # a vocabulary wider than a chunk: one row at a time
    for vocab in (1000, 32000, 128256):
        rows = chunk_rows(vocab, many)
        assert rows * 4 * vocab <= CHUNK_BYTES < (rows + 1) * 4 * vocab
    # few rows (a small micro-batch, a tp rank's slice): the fp32 chunk is a quarter of the logits,
    # not all of them
    assert MIN_CHUNKS == 4 and chunk_rows(4096, 1024) == 256 and chunk_rows(4096, 3) == 1
