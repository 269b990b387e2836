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


def _std(name: str, cfg: ModelConfig) -> float | None:
    """The init std of parameter `name`; None for norm weights, which start at 1 (identity).

    Embeddings and linears are Normal(0, 0.02), except the two projections that add into the
    residual stream (attention `wo`, MLP `w2`): with 2 of them per layer summed into one stream,
    their std is divided by sqrt(2 * n_layers) so the residual's variance at init does not grow
    with depth (GPT-2, Megatron-LM).
    """
    module = name.split(".")[-2]
    if module in NORM_NAMES:
        return None
    return INIT_STD / math.sqrt(2 * cfg.n_layers) if module in RESIDUAL_OUTPUT_NAMES else INIT_STD


def initial_value(name: str, shape: tuple[int, ...], seed: int, cfg: ModelConfig) -> torch.Tensor:
    """The full initial value of parameter `name`, as an fp32 CPU tensor: one draw of numel
    normals from the parameter's own generator (see `_std` for the distribution)."""
    std = _std(name, cfg)
    if std is None:
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(parameter_seed(name, seed))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


# Elements drawn per call when streaming: a multiple of 16 (see `initial_rows`), 16 MiB of fp32.
STREAM_CHUNK = 1 << 22


def initial_rows(name: str, shape: tuple[int, ...], seed: int, cfg: ModelConfig, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of `initial_value(name, shape, ...)` without materialising the rest."""
    return InitStream(name, shape, seed, cfg).read_rows(start, stop)


class InitStream:
    """One parameter's initial value, read row block by row block in increasing order, without
    ever holding more than the rows asked for plus one chunk of the random stream: what a rank
    that owns a slice of a large parameter needs (meshlm/parallel/sharded_init.py).

    The values are bit-identical to `initial_value`'s one-call draw because PyTorch's CPU
    `normal_` on a contiguous tensor of >= 16 elements fills uniforms in order and transforms
    them 16 at a time, recomputing the last 16 from fresh uniforms when the size is not a
    multiple of 16. So drawing the stream on a fixed grid of chunks that are multiples of 16,
    the last one merged into its predecessor when shorter than 16, reproduces it exactly
    (tests/test_sharded_init.py checks this against the one-call draw). Skipping ahead costs the
    time of drawing the skipped elements, not memory.
    """

    def __init__(self, name: str, shape: tuple[int, ...], seed: int, cfg: ModelConfig):
        self.name, self.shape, self.seed, self.cfg = name, tuple(shape), seed, cfg
        self.std = _std(name, cfg)
        self.row = math.prod(self.shape[1:])
        self.total = self.shape[0] * self.row
        self.generator = torch.Generator().manual_seed(parameter_seed(name, seed))
        self.chunk, self.chunk_start = torch.empty(0), 0  # the last chunk drawn, where it starts
        self.whole = None  # small tensors: one draw, kept

    def _chunk_end(self, first: int) -> int:
        last = first + STREAM_CHUNK
        return self.total if self.total - last < 16 else min(last, self.total)

    def read_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) as [stop - start, *shape[1:]] fp32 (into `out` if given). `start`
        must not go back before the chunk the previous read ended in."""
        out = torch.empty((stop - start, *self.shape[1:])) if out is None else out
        if self.std is None:
            return out.fill_(1.0)
        if self.total <= STREAM_CHUNK:
            if self.whole is None:
                self.whole = initial_value(self.name, self.shape, self.seed, self.cfg)
            return out.copy_(self.whole[start:stop])
        lo, hi = start * self.row, stop * self.row
        if lo < self.chunk_start:
            raise ValueError(f"InitStream({self.name}): rows must be read in increasing order")
        flat = out.view(-1)
        while True:
            end = self.chunk_start + self.chunk.numel()
            a, b = max(self.chunk_start, lo), min(end, hi)
            if a < b:
                flat[a - lo: b - lo] = self.chunk[a - self.chunk_start: b - self.chunk_start]
            if end >= hi:
                return out
            self.chunk_start = end
            self.chunk = torch.empty(self._chunk_end(end) - end).normal_(0.0, self.std, generator=self.generator)


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
