"""The Llama decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU, optional tied head.
Plain single-device PyTorch; every parallel technique in meshlm is applied to it from outside.

The module names (`tok_embeddings`, `layers.i.attention.wq`, `feed_forward.w1`, ...) are part of
meshlm's contract: tensor parallelism, pipeline splitting, checkpoint resharding and the Hugging
Face exporter all address parameters by these names. Numerics follow Hugging Face's
`LlamaForCausalLM` (tests/test_model.py checks logits to 1e-5 in fp32), so weights move between
the two with a pure renaming.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # meshlm.config imports meshlm.model (for the presets): no runtime cycle
    from meshlm.config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight: LayerNorm without mean-centering or bias, cheaper and as good for LMs."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares over thousands of bf16 values loses too much precision, so the
        # statistic is taken in fp32; casting back *before* the weight multiply rounds exactly
        # where HF's LlamaRMSNorm does.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


# --------------------------------------------------------------------------- rotary positions


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's RoPE scaling (`rope_type: "llama3"` in a Hugging Face config): how a model
    pretrained on `original_max_seq_len` tokens reads longer contexts.

    Each frequency's wavelength (2π / inv_freq, in positions) decides its band:
    - shorter than original_max_seq_len / high_freq_factor (high frequencies, local detail):
      unchanged;
    - longer than original_max_seq_len / low_freq_factor (low frequencies, which never turned
      a full circle in pretraining): divided by `factor`, i.e. positions interpolated;
    - in between: a linear blend of the two, by how many wavelengths fit in the original
      context (smooth = (original/wavelength - low) / (high - low)).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int

    @staticmethod
    def of(cfg: ModelConfig) -> Llama3Scaling | None:
        """The scaling a resolved ModelConfig asks for (model.rope_scaling), or None."""
        if cfg.rope_scaling != "llama3":
            return None
        return Llama3Scaling(cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                             cfg.rope_original_max_seq_len)

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies; the same operations, in the same fp32 order, as
        transformers' `_compute_llama3_parameters`, so the tables agree bit for bit."""
        low_freq_wavelen = self.original_max_seq_len / self.low_freq_factor
        high_freq_wavelen = self.original_max_seq_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_seq_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: Llama3Scaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) angle, shape [max_seq_len, head_dim], fp32, CPU.

    Frequency i (of head_dim/2) rotates by theta^(-2i/head_dim) radians per position, rescaled
    by `scaling` (Llama 3.1's bands) when given. Each
    frequency appears twice, at i and i + head_dim/2, because `rotate_half` pairs dimension i
    with i + head_dim/2 (HF's layout) rather than 2i with 2i+1 (Meta's original complex layout).
    Computed on the CPU so the tables are identical whatever device the model runs on.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension: a 90-degree turn per pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + head_dim/2) pair of x [B, H, S, head_dim] by its position's angle."""
    # The tables are cast to the compute dtype (not x up to fp32), as HF does, so bf16 runs of
    # the two implementations round identically.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin tables as non-persistent buffers: derived from the config, never saved.

    Storing cos/sin rather than the angles keeps `model.to(torch.bfloat16)` harmless: a bf16
    copy of cos is exactly what the forward would cast to anyway, while bf16 angles would be
    off by whole radians at large positions.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaling: Llama3Scaling | None = None):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta, self.scaling = head_dim, max_seq_len, theta, scaling
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim, dtype=torch.float32), persistent=False)
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """(Re)compute the tables in place, on whatever device and dtype the buffers now have.

        Needed after `to_empty()`, which leaves buffers uninitialised (meta-device init).
        """
        cos, sin = rope_tables(self.head_dim, self.max_seq_len, self.theta, self.scaling)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, seq_len: int, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, head_dim] for positions 0..seq_len-1, or for explicit `positions` [S]."""
        if positions is None:
            if seq_len > self.max_seq_len:
                raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={self.max_seq_len}")
            return self.cos[:seq_len], self.sin[:seq_len]
        return self.cos[positions], self.sin[positions]


# --------------------------------------------------------------------------- the block


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask, on already projected and rotated heads.

    A module of its own, holding no parameters, so that selective activation checkpointing can
    wrap exactly this piece (with an eager kernel its [B, H, S, S] scores would be the block's
    largest activations; SDPA's flash kernels keep only the output and the log-sum-exp), and
    context parallelism can swap it for ring attention without touching the projections.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [B, Hq, S, d]; k, v [B, Hkv, S, d]. With Hkv < Hq each k/v head serves Hq/Hkv
        # consecutive query heads; enable_gqa does that without materialising repeated copies.
        # The head counts come from the tensors, so a tensor-parallel shard works unchanged.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    """Grouped-query self-attention: n_heads query heads share n_kv_heads key/value heads.

    Fewer kv heads shrink wk, wv and (above all) the KV cache at inference; n_kv_heads == n_heads
    is ordinary multi-head attention, n_kv_heads == 1 is multi-query attention.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.core = CoreAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads, not cfg.n_heads: a column-parallel shard of wq holds only its own heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        out = self.core(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). The gate makes it better than a plain MLP at equal params."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then h + feed_forward(norm(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


# --------------------------------------------------------------------------- the model


class Llama(nn.Module):
    """Token ids [B, S] -> next-token logits [B, S, vocab_size], in the parameters' dtype.

    Parameters are left as PyTorch's constructors make them; call
    `meshlm.model.init.init_weights(model, seed)` for meshlm's layout-independent initialisation.
    The loss is computed outside, so that vocab-parallel cross-entropy can replace it.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.dim is None:
            raise ValueError("Llama needs a resolved ModelConfig (call meshlm.config.resolve first)")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, Llama3Scaling.of(cfg))
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tie_embeddings, make the head's weight the very same Parameter as the embedding's.

        Both are [vocab_size, dim]: row t embeds token t on the way in and scores token t on the
        way out. One tensor means one gradient (the sum of both uses) and one optimizer state.
        """
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device, recurse: bool = True) -> Llama:
        """Allocate uninitialised storage on `device` (after building on the meta device).

        PyTorch's `to_empty` creates a new Parameter per module, which silently unties the head
        from the embedding, and leaves the RoPE buffers as garbage; both are repaired here.
        The parameters still need `init_weights`.
        """
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        self.rope.reset()
        return self

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` [S] gives each token's absolute position (default 0..S-1), e.g. for a
        sequence chunk under context parallelism; attention stays causal within `tokens`."""
        cos, sin = self.rope(tokens.shape[1], positions)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
