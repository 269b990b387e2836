"""Training FLOPs per token and model FLOPs utilisation (MFU), with one stated convention.

MFU = achieved model FLOP/s / peak FLOP/s. It is the honest throughput measure for comparing
layouts: model FLOPs are fixed by the architecture, so recompute, communication and pipeline
bubbles all show up as a lower MFU instead of being counted as useful work.

The convention (PaLM, Chowdhery et al. 2022, appendix B; also torchtitan and nanoGPT):

    flops_per_token = 6 * N_matmul + 12 * n_layers * dim * seq_len

Derivation. A matmul with an [m, k] @ [k, n] shape does m*k*n multiply-adds = 2*m*k*n FLOPs, so
each token passing through a weight matrix with P entries costs 2*P FLOPs forward. Backward
costs twice the forward (one matmul for the input's gradient, one for the weight's), hence
3 x 2 = 6 FLOPs per weight per token for training. N_matmul counts the weights used in
matmuls: per layer wq, wk, wv, wo, w1, w3, w2, plus the LM head (vocab x dim).

Attention's score and value matmuls have no weights: per layer and token the query is dotted with
seq_len keys of width n_heads * head_dim = dim (2 * seq_len * dim FLOPs), and the softmax weights
mix seq_len values of width dim (another 2 * seq_len * dim): 4 * seq_len * dim forward, times 3
for training = 12 * seq_len * dim.

Counted: all matmuls above, the LM head even when it is tied to the embedding (the matmul is
still done). Not counted: the embedding lookup (a gather, no FLOPs), norms, activations,
softmax, RoPE and the loss (elementwise, well under 1%), and recompute (MFU counts model FLOPs,
not hardware FLOPs). No causal halving: a causal mask makes half of the score matrix unused and
kernels such as flash attention skip it, so the attention term overstates the useful work by up
to 2x; we keep the full count so that MFU figures compare with published ones, which use it.
"""

from __future__ import annotations

import re

import torch

from meshlm.config import ModelConfig

# Dense (no 2:4 sparsity) bf16 tensor-core peaks in TFLOP/s, with fp32 accumulation, from the
# vendor datasheets. Keys are whole words of `torch.cuda.get_device_name()` (so "L4" is not found
# in "L40"); the longest match wins, so "H100 PCIe" beats "H100".
PEAK_TFLOPS: dict[str, float] = {
    "B200": 2250.0,
    "H200": 989.0,
    "GH200": 989.0,  # the H200's GPU
    "H100": 989.0,  # SXM; its name carries no form factor, e.g. "NVIDIA H100 80GB HBM3"
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H800": 989.0,
    "A100": 312.0,
    "A10G": 125.0,  # the A10 datasheet figure; AWS publishes none for the A10G
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
}

# fp32 training on tensor cores runs as TF32, whose dense peak is half the bf16 one on every
# device above. Without TF32 (PyTorch's default: torch.get_float32_matmul_precision() "highest")
# fp32 matmuls run on CUDA cores, e.g. 67 TFLOP/s on an H100 SXM, a figure not listed here: a
# measured run then reports no MFU rather than one understated 7x (device_peak_tflops).
_DTYPE_FACTOR = {"bfloat16": 1.0, "float16": 1.0, "float32": 0.5}


def matmul_params(cfg: ModelConfig) -> int:
    """N_matmul: the weights every token is multiplied by (all block linears and the LM head)."""
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = 2 * cfg.dim * q_dim + 2 * cfg.dim * kv_dim + 3 * cfg.dim * cfg.ffn_dim
    return cfg.n_layers * per_layer + cfg.vocab_size * cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token; see the module docstring for the convention."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.dim * seq_len


def peak_tflops_for_name(device_name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s for a CUDA device name and a dtype name; None for an unknown device."""
    if dtype not in _DTYPE_FACTOR:
        raise ValueError(f"dtype: expected one of {', '.join(_DTYPE_FACTOR)}, got {dtype!r}")
    def whole_word(key: str) -> bool:
        return re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name) is not None

    matches = [key for key in PEAK_TFLOPS if whole_word(key)]
    if not matches:
        return None
    return PEAK_TFLOPS[max(matches, key=len)] * _DTYPE_FACTOR[dtype]


def device_peak_tflops(device: torch.device, dtype: str) -> float | None:
    """Dense peak TFLOP/s of `device` for `dtype`; None on CPU or an unlisted GPU."""
    if device.type != "cuda" or (dtype == "float32" and torch.get_float32_matmul_precision() == "highest"):
        return None  # (fp32 without TF32: see _DTYPE_FACTOR)
    return peak_tflops_for_name(torch.cuda.get_device_name(device), dtype)


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None, n_devices: int) -> float | None:
    """Achieved model FLOP/s over the peak of all `n_devices` together (0..1); None if no peak."""
    if peak_tflops is None:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12 * n_devices)
