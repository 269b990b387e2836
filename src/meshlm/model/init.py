"""Layout-independent initialisation and analytic parameter counts for the Llama decoder.

Every parameter is drawn from its own random stream, seeded by (run seed, hash of its name),
never from the global RNG. So the initial weights depend only on the seed, not on which ranks
build which pieces or in what order: a tensor-parallel rank calls `initial_value` for the full
shape and keeps its slice; a pipeline stage that owns layers 4..7 asks for
`layers.4.attention.wq.weight`, ... and gets what the single-process model has. This is what
lets every layout start from, and reproduce, the single-process loss curve.
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # meshlm.config imports meshlm.model (for the presets): no runtime cycle
    from meshlm.config import ModelConfig
    from meshlm.model.llama import Llama

INIT_STD = 0.02
NORM_NAMES = ("attention_norm", "ffn_norm", "norm")
# The projections that write into the residual stream; see `initial_value`.
RESIDUAL_OUTPUT_NAMES = ("wo", "w2")


def parameter_seed(name: str, seed: int) -> int:
    """A generator seed from the run seed and the parameter's name.

    32 bits, because the CPU generator (mt19937) silently ignores any higher seed bits.
    crc32 rather than Python's `hash`, which is salted per process and would differ across ranks.
    """
    return zlib.crc32(f"{seed}:{name}".encode())


def initial_value(name: str, shape: tuple[int, ...], seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The full initial value of parameter `name`, as an fp32 CPU tensor.

    Norm weights start at 1 (identity). Embeddings and linears are Normal(0, 0.02), except the
    two projections that add into the residual stream (attention `wo`, MLP `w2`): with 2 of them
    per layer summed into one stream, their std is divided by sqrt(2 * n_layers) so the
    residual's variance at init does not grow with depth (GPT-2, Megatron-LM).
    """
    module = name.split(".")[-2]
    if module in NORM_NAMES:
        return torch.ones(shape)
    std = INIT_STD / math.sqrt(2 * cfg.n_layers) if module in RESIDUAL_OUTPUT_NAMES else INIT_STD
    generator = torch.Generator().manual_seed(parameter_seed(name, seed))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> None:
    """Fill every parameter of `model` with its `initial_value`, whatever its device and dtype.

    Values are drawn on the CPU in fp32 and then copied, so a CUDA or bf16 model gets the same
    numbers (up to the final rounding) as the CPU fp32 one. `named_parameters` lists a tied
    weight once, under `tok_embeddings.weight`, so it is initialised once.
    """
    for name, param in model.named_parameters():
        param.copy_(initial_value(name, tuple(param.shape), seed, model.cfg))


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the config alone, without building anything (instant for 70B).

    Keys: `embedding` (vocab x dim), `attention_per_layer` (wq, wk, wv, wo), `mlp_per_layer`
    (w1, w3, w2), `layer` (one whole block: attention + mlp + its two norms), `norms` (all norm
    weights, final norm included), `head` (0 when tied to the embedding), `total`.
    """
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attention = cfg.dim * q_dim + 2 * cfg.dim * kv_dim + q_dim * cfg.dim
    mlp = 3 * cfg.dim * cfg.ffn_dim
    layer = attention + mlp + 2 * cfg.dim
    embedding = cfg.vocab_size * cfg.dim
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return {
        "embedding": embedding,
        "attention_per_layer": attention,
        "mlp_per_layer": mlp,
        "layer": layer,
        "norms": (2 * cfg.n_layers + 1) * cfg.dim,
        "head": head,
        "total": embedding + cfg.n_layers * layer + cfg.dim + head,
    }
