"""What this rank owns of each single-process tensor, as rectangles of the full tensor.

A checkpoint stores every tensor under its single-process name and full shape (the vocabulary
unpadded), cut into rectangles that say where they sit: `(row, col, rows, cols)` of the tensor
viewed as 2-D (a 1-D tensor is one row). That is the only thing saving and loading need to agree
on, so a checkpoint written under one layout loads under any other.

Every data-parallel engine exposes what it updates as `MasterSegment`s (parallel/mixed_precision.py):
a flat range [p_lo, p_hi) of one local parameter, with its fp32 master values and AdamW moments
as 1-D tensors. A local parameter is the tp shard of a full tensor (or the full tensor), so a
segment maps to the full tensor in two steps:
- tp: the shard sits at `index * local_rows` along the sharded dimension (`meshlm_tp_dim`), where
  index is the tp rank, or for kv heads replicated over several tp ranks the kv head (`tp_slice`);
  rows beyond `meshlm_tp_full_size` are the vocabulary padding and are never stored;
- the flat range: at most three rectangles (a partial first row, whole rows, a partial last
  row), each a contiguous slice of the segment's 1-D data. ZeRO and FSDP shards cross parameter
  boundaries and start mid-row; this is why checkpoints are not DTensor-shaped (see
  docs/checkpointing.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshlm.errors import ConfigError
from meshlm.parallel.tensor_layers import tp_slice

TIED_HEAD = "output.weight"
EMBEDDING = "tok_embeddings.weight"


@dataclass(frozen=True)
class Rect:
    """Rows [row, row + rows) x cols [col, col + cols) of a tensor viewed as 2-D."""

    row: int
    col: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def intersect(self, other: "Rect") -> "Rect | None":
        r0, c0 = max(self.row, other.row), max(self.col, other.col)
        r1 = min(self.row + self.rows, other.row + other.rows)
        c1 = min(self.col + self.cols, other.col + other.cols)
        if r0 >= r1 or c0 >= c1:
            return None
        return Rect(r0, c0, r1 - r0, c1 - c0)


def as_2d(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """(rows, cols) of a parameter shape: [n] -> (1, n), [r, c] -> (r, c)."""
    if len(shape) == 1:
        return 1, shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    raise ValueError(f"checkpoint pieces support 1-D and 2-D parameters, got shape {tuple(shape)}")


def flat_range_rects(cols: int, lo: int, hi: int) -> list[tuple[Rect, int]]:
    """Rectangles covering flat elements [lo, hi) of a row-major [*, cols] tensor, each with its
    offset in the range's data: a partial first row, then whole rows, then a partial last row."""
    out, pos = [], lo
    while pos < hi:
        row, col = divmod(pos, cols)
        if col == 0 and hi - pos >= cols:
            rows = (hi - pos) // cols
            out.append((Rect(row, 0, rows, cols), pos - lo))
            pos += rows * cols
        else:
            end = min(hi, (row + 1) * cols)
            out.append((Rect(row, col, 1, end - pos), pos - lo))
            pos = end
    return out


@dataclass
class Placement:
    """One local parameter's place in its full tensor."""

    name: str  # the single-process name
    full_shape: tuple[int, int]  # 2-D view of the full (unpadded) tensor
    local_shape: tuple[int, int]  # 2-D view of this rank's (tp) shard
    offset: tuple[int, int]  # where the shard's (0, 0) sits in the full tensor
    written_here: bool  # this rank writes it: the one copy among the replicas


@dataclass
class Piece:
    """A rectangle of a full tensor and the slice of a segment's 1-D data that holds it."""

    name: str
    rect: Rect  # in full-tensor coordinates
    start: int  # the rectangle's data: segment_data[start: start + local.numel].view(local.rows, local.cols)
    local: Rect  # the rectangle before clipping away padding (its data layout)

    def view(self, data: torch.Tensor) -> torch.Tensor:
        """The elements of `data` (a segment's 1-D tensor) that hold `rect`: a 2-D view."""
        block = data[self.start: self.start + self.local.numel].view(self.local.rows, self.local.cols)
        return block[: self.rect.rows, : self.rect.cols]


def segment_pieces(placement: Placement, p_lo: int, p_hi: int) -> list[Piece]:
    """The pieces of flat range [p_lo, p_hi) of a local parameter, padding dropped."""
    full_rows, full_cols = placement.full_shape
    out = []
    for local, start in flat_range_rects(placement.local_shape[1], p_lo, p_hi):
        row, col = local.row + placement.offset[0], local.col + placement.offset[1]
        rect = Rect(row, col, min(local.rows, full_rows - row), min(local.cols, full_cols - col))
        if rect.rows > 0 and rect.cols > 0:
            out.append(Piece(placement.name, rect, start, local))
    return out


def canonical_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of every trainable tensor of the single-process model (a tied head is
    the embedding: listed once), computed on the meta device."""
    from meshlm.model import Llama

    with torch.device("meta"):
        model = Llama(model_cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def placements(module: nn.Module, ctx, shapes: dict[str, tuple[int, ...]], dp_sharded: bool) -> dict[int, Placement]:
    """id(local parameter) -> its Placement, for every parameter of `module` (a model or a
    pipeline stage, already tensor-parallel). Which rank writes each element once:
    - tp: a sharded parameter on every tp rank (distinct slices; replicated kv heads on their first
      replica), a replicated one on tp rank 0;
    - dp x cp: every rank when the engine shards across them (ZeRO 1-3), else only group rank 0;
    - pp: the last stage's copy of a tied embedding is never written (stage 0 owns it)."""
    tp_rank = ctx.coord("tp")
    first_replica = dp_sharded or ctx.group_rank(("cp", "dp")) == 0
    out = {}
    for local_name, p in module.named_parameters():
        duplicate = getattr(p, "meshlm_pp_duplicate", False)
        name = EMBEDDING if duplicate and local_name == TIED_HEAD else local_name
        if name not in shapes:
            raise KeyError(f"parameter {local_name!r} has no counterpart in the single-process model")
        full = as_2d(shapes[name])
        local = as_2d(tuple(p.shape))
        offset = [0, 0]
        sharded = getattr(p, "meshlm_tp_sharded", False)
        writes_tp = tp_rank == 0
        if sharded:
            dim = p.meshlm_tp_dim + (2 - p.ndim)  # a 1-D tensor's only dim is the 2-D view's cols
            index, writes_tp = tp_slice(p, tp_rank)
            offset[dim] = index * local[dim]
        written = first_replica and not duplicate and writes_tp
        out[id(p)] = Placement(name, full, local, (offset[0], offset[1]), written)
    return out


def check_shapes(reader, model_cfg) -> None:
    """ConfigError naming the first tensor whose stored shape does not fit this model."""
    expected = canonical_shapes(model_cfg)
    for name, shape in expected.items():
        stored = reader.shapes.get(name)
        if stored is None:
            raise ConfigError(f"{reader.path}: the checkpoint has no tensor {name} (shape {list(shape)}); "
                              f"it was saved from a different model")
        if tuple(stored) != tuple(shape):
            raise ConfigError(f"{reader.path}: tensor {name} has shape {list(stored)}, this model needs "
                              f"{list(shape)} (check model.* against the checkpoint's config.toml)")
    extra = sorted(set(reader.shapes) - set(expected))
    if extra:
        raise ConfigError(f"{reader.path}: tensor {extra[0]} is not part of this model (a different architecture)")
