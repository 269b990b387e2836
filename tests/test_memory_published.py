"""The memory model against published figures (issue 13, item 3(b)); docs/memory.md explains each.

1. Mixed-precision Adam costs 16 bytes per parameter (DDP: 4 + 4 + 8 in fp32 or under autocast;
   ZeRO with bf16 parameters: 2 + 2 + 4 master + 8 Adam).
2. The ZeRO paper's model-state table (Rajbhandari et al. 2020, Figure 1 / Table 1): Ψ = 7.5B,
   N_d = 64, K = 12 -> 120, 31.4, 16.6 and 1.9 GB per device for baseline, P_os, P_os+g, P_os+g+p.
3. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
   their GPT block's per-term table sums to their formula, and, term by term with the stated
   differences applied, becomes meshlm's `activation_bytes_per_layer`.

No ranks are started: everything here is arithmetic on resolved configs (well under 5 s).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import pytest

from meshlm.analysis.memory import predict, rank_parameters
from meshlm.analysis.memory_state import engine_state
from meshlm.config import load_config, resolve
from meshlm.parallel.tensor import activation_bytes_per_layer, korthikanti_bytes_per_layer


def _config(preset: str = "llama2-7b", dtype: str = "bfloat16", zero: int = 1, dp: int = 1):
    overrides = [f"model.preset={preset}", f"train.dtype={dtype}", f"parallel.zero={zero}", f"parallel.dp={dp}",
                 "train.seq_len=128", "train.micro_batch_size=1", f"train.global_batch_size={dp}"]
    return resolve(load_config(None, overrides), world_size=dp)


def _model_state(cfg) -> tuple[int, int]:
    """(params + grads + optimizer + master bytes of rank 0's engine, the rank's parameter count N,
    unsharded: the Ψ of the ZeRO paper's per-device formulas).

    The terms are the engine's (`engine_state`, what `predict` adds at every point of the step); the
    peak `predict` reports carries the same params, optimizer and master bytes, and the gradients
    whole, not yet allocated (ZeRO-2's shard appears at the first reduction, so a peak in the first
    backward has none) or, under ZeRO-3, in part (a unit's shard is made at its own reduction, so a
    peak in the first backward has those of the units reduced by then). The paper counts them all,
    so the sum is taken with them."""
    counts = rank_parameters(cfg, 0)
    s = engine_state(cfg, counts, "nccl")
    rank = predict(cfg).ranks[0]
    assert (rank.params_bytes, rank.optimizer_bytes, rank.master_bytes) == \
        (int(s.params), int(s.optimizer), int(s.master))
    if cfg.parallel.zero == 3:
        assert 0 <= rank.grads_bytes <= int(s.grads), rank.phase
    else:
        assert rank.grads_bytes in (0, int(s.grads)), rank.phase
    return int(s.params) + int(s.grads) + int(s.optimizer) + int(s.master), sum(counts.values())


# --------------------------------------------------------------------------- 1. 16 bytes per parameter


@pytest.mark.parametrize("zero, dtype, split", [
    (0, "bfloat16", (4, 4, 8, 0)),  # DDP under autocast: fp32 params and grads, Adam's m and v
    (0, "float32", (4, 4, 8, 0)),
    (1, "bfloat16", (2, 2, 8, 4)),  # bf16 params and grads, Adam 8, fp32 master 4 (dp=1: unsharded)
])
def test_mixed_precision_adam_costs_16_bytes_per_parameter(zero, dtype, split):
    cfg = _config(zero=zero, dtype=dtype, dp=1)
    state, n = _model_state(cfg)
    assert state == 16 * n
    s = engine_state(cfg, rank_parameters(cfg, 0), "nccl")
    assert (s.params, s.grads, s.optimizer, s.master) == tuple(x * n for x in split)


# --------------------------------------------------------------------------- 2. the ZeRO paper's table

PSI, N_D, K = 7.5e9, 64, 12
# Rajbhandari et al. 2020, Figure 1: GB per device (1 GB = 1e9 bytes), as printed (rounded).
ZERO_PAPER_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
# ... and the formulas the figure evaluates: bytes per parameter per device.
ZERO_PAPER_FORMULA = {0: 2 + 2 + K, 1: 2 + 2 + K / N_D, 2: 2 + (2 + K) / N_D, 3: (2 + 2 + K) / N_D}


def test_the_paper_formulas_give_the_printed_table():
    """The transcription itself: the formulas, at Ψ = 7.5B, round to the printed figures."""
    for stage, gb in ZERO_PAPER_GB.items():
        assert round(ZERO_PAPER_FORMULA[stage] * PSI / 1e9, 1) == gb


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_model_state_equals_the_zero_paper_table(stage):
    """meshlm's per-rank model state at dp=64 in bf16, per parameter, scaled to Ψ = 7.5B.

    N is the rank's whole parameter count; the sharded terms are N/64 in the model, so
    bytes / N is the paper's per-parameter factor (2+2+K, 2+2+K/N_d, 2+(2+K)/N_d, (2+2+K)/N_d).
    ZeRO-3 keeps an fp32 shard (4) + fp32 gradient shard (4) + Adam (8): 16/N_d, the paper's
    (2+2+12)/N_d by another split (no bf16 copy at rest, fp32 gradients)."""
    state, n = _model_state(_config(zero=stage, dp=N_D))
    per_parameter = state / n
    assert per_parameter == pytest.approx(ZERO_PAPER_FORMULA[stage], rel=1e-8)
    assert abs(per_parameter * PSI / 1e9 - ZERO_PAPER_GB[stage]) <= 0.05


# --------------------------------------------------------------------------- 3. Korthikanti et al.


@dataclass(frozen=True)
class Term:
    """One tensor saved for backward: elements per token (a function of the block's shape) and
    bytes per element. `inside` terms live in a tensor-parallel region (split by heads or MLP
    columns, so / t under TP); the rest are replicated under TP and sequence-sharded under SP."""

    name: str
    per_token: object  # (h, a, k, f, s) -> elements per token (a Fraction-friendly expression)
    width: int  # bytes per element
    inside: bool


# The paper's GPT block in 16-bit, with dropout, LayerNorm and GeLU (its section 4.1), bytes per
# layer: attention 11sbh + 5as²b, MLP 19sbh, layernorms 4sbh. `s` appears per token for the
# a·s² terms (a·s elements per token).
KORTHIKANTI = [
    Term("layernorm 1 input", lambda h, a, k, f, s: h, 2, False),
    Term("QKV input", lambda h, a, k, f, s: h, 2, False),
    Term("Q", lambda h, a, k, f, s: h, 2, True),
    Term("K", lambda h, a, k, f, s: h, 2, True),
    Term("softmax output", lambda h, a, k, f, s: a * s, 2, True),
    Term("softmax dropout mask", lambda h, a, k, f, s: a * s, 1, True),
    Term("softmax dropout output", lambda h, a, k, f, s: a * s, 2, True),
    Term("V", lambda h, a, k, f, s: h, 2, True),
    Term("output-projection input", lambda h, a, k, f, s: h, 2, True),
    Term("attention dropout mask", lambda h, a, k, f, s: h, 1, False),
    Term("layernorm 2 input", lambda h, a, k, f, s: h, 2, False),
    Term("MLP input", lambda h, a, k, f, s: h, 2, False),
    Term("fc1 output (GeLU input)", lambda h, a, k, f, s: 4 * h, 2, True),
    Term("GeLU output", lambda h, a, k, f, s: 4 * h, 2, True),
    Term("MLP dropout mask", lambda h, a, k, f, s: h, 1, False),
]


def _meshlm_terms(item: int) -> list[Term]:
    """The paper's table with meshlm's differences applied, term by term (each named)."""
    removed = {
        # no dropout anywhere in meshlm's Llama
        "softmax dropout mask", "softmax dropout output", "attention dropout mask", "MLP dropout mask",
        # flash attention (SDPA's kernels) keeps no s x s matrix ...
        "softmax output",
        # GQA: k and v have n_kv_heads heads (re-added below); RoPE: q and k are saved rotated
        "Q", "K", "V",
        # SwiGLU of width ffn_dim instead of fc1 / GeLU of width 4h
        "fc1 output (GeLU input)", "GeLU output",
    }
    kept = [Term(t.name, t.per_token, item, t.inside) for t in KORTHIKANTI if t.name not in removed]
    # (kept: the two norm inputs, now RMSNorm's; the QKV input; the MLP input = the gate/up GEMMs'
    # input; the output-projection input = the attention output)
    added = [
        Term("RMSNorm 1 normalised value", lambda h, a, k, f, s: h, item, False),
        Term("RMSNorm 2 normalised value", lambda h, a, k, f, s: h, item, False),
        Term("RMSNorm statistics (2 norms)", lambda h, a, k, f, s: 2, item, False),
        Term("rotated q", lambda h, a, k, f, s: h, item, True),
        Term("rotated k (n_kv_heads)", lambda h, a, k, f, s: Fraction(h * k, a), item, True),
        Term("v (n_kv_heads)", lambda h, a, k, f, s: Fraction(h * k, a), item, True),
        # ... but a log-sum-exp per head and token
        Term("attention log-sum-exp", lambda h, a, k, f, s: a, item, True),
        Term("SwiGLU gate", lambda h, a, k, f, s: f, item, True),
        Term("SwiGLU up", lambda h, a, k, f, s: f, item, True),
        Term("SwiGLU silu(gate)", lambda h, a, k, f, s: f, item, True),
        Term("SwiGLU product (down input)", lambda h, a, k, f, s: f, item, True),
    ]
    return kept + added


def _bytes(terms: list[Term], h: int, a: int, k: int, f: int, b: int, s: int, tp: int, sp: bool) -> Fraction:
    """Bytes one tp rank saves: inside terms / t; outside terms / t only under SP."""
    total = Fraction(0)
    for t in terms:
        share = Fraction(1, tp) if t.inside or sp else Fraction(1)
        total += Fraction(b * s) * Fraction(t.per_token(h, a, k, f, s)) * t.width * share
    return total


# (h, a, k, f, b, s): MHA (GPT-3 Small's shape; the paper's 22B/175B-like ratios) and GQA shapes
PAPER_SHAPES = [(768, 12, 12, 3072, 4, 1024), (6144, 64, 64, 24576, 1, 2048), (12288, 96, 96, 49152, 1, 2048)]


@pytest.mark.parametrize("h, a, k, f, b, s", PAPER_SHAPES)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_korthikanti_terms_sum_to_their_formula(h, a, k, f, b, s, tp, sp):
    got = _bytes(KORTHIKANTI, h, a, k, f, b, s, tp, sp)
    attention = Fraction(5 * a * s, h * tp)
    if tp == 1 and not sp:
        assert got == s * b * h * (34 + Fraction(5 * a * s, h))  # the paper's eq. (1)
    rest = Fraction(34, tp) if sp else 10 + Fraction(24, tp)  # eq. (2) and (3)
    assert got == s * b * h * (rest + attention)
    assert float(got) == pytest.approx(korthikanti_bytes_per_layer(s, b, h, a, tp, sp), rel=1e-12)


def _shape(preset: str, *extra: str):
    return resolve(load_config(None, [f"model.preset={preset}", *extra])).model


MESHLM_SHAPES = [
    ("125m", ()),  # MHA: 12 heads, 12 kv heads, ffn 2048
    ("1b", ()),  # GQA: 32 heads, 8 kv heads, ffn 8192
    ("llama2-70b", ()),  # GQA: 64 heads, 8 kv heads, ffn 28672
    ("debug", ("model.n_heads=8", "model.n_kv_heads=4")),  # GQA, odd widths
]


@pytest.mark.parametrize("preset, extra", MESHLM_SHAPES)
@pytest.mark.parametrize("b, s", [(1, 512), (3, 128)])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_meshlm_block_is_the_paper_block_with_the_stated_differences(preset, extra, b, s, tp, sp):
    m = _shape(preset, *extra)
    assert m.n_kv_heads % tp == 0  # (replicated kv heads, tp > n_kv_heads, are not covered here)
    got = _bytes(_meshlm_terms(2), m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, b, s, tp, sp)
    assert got.denominator == 1
    assert got == activation_bytes_per_layer(m, b, s, tp, sp, itemsize=2)
    # and in fp32 (meshlm on CPU) every element costs 4
    assert _bytes(_meshlm_terms(4), m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, b, s, tp, sp) == \
        activation_bytes_per_layer(m, b, s, tp, sp, itemsize=4)


def test_every_term_matters():
    """Each check above can fail: dropping any single term of either table changes the total."""
    m = _shape("1b")
    h, a, k, f, b, s = m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, 2, 256
    for tp, sp in ((1, False), (2, False), (2, True)):
        ours = _meshlm_terms(2)
        want = activation_bytes_per_layer(m, b, s, tp, sp, itemsize=2)
        for i in range(len(ours)):
            assert _bytes(ours[:i] + ours[i + 1:], h, a, k, f, b, s, tp, sp) != want, ours[i].name
        paper = korthikanti_bytes_per_layer(s, b, h, a, tp, sp)
        for i in range(len(KORTHIKANTI)):
            less = float(_bytes(KORTHIKANTI[:i] + KORTHIKANTI[i + 1:], h, a, k, f, b, s, tp, sp))
            assert less != pytest.approx(paper, rel=1e-12), KORTHIKANTI[i].name
