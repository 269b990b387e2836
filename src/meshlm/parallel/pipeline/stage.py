"""Pipeline stages: the Llama cut into pp * v consecutive pieces; each rank keeps only its own.

Reduces: parameters, gradients and optimizer state per rank to about 1/pp of the model (the
embedding on the first stage and the head on the last come on top).
Costs: with tied embeddings the last stage keeps a second copy of the embedding matrix, kept
equal to the first by summing the two gradients every step. (The split happens on the meta
device: a rank never allocates the stages it does not run; parallel/sharded_init.py.)

Virtual stage j (of S = pp * v) holds a contiguous run of layers; it lives on pipeline rank j % pp
as that rank's chunk j // pp. The embedding belongs to stage 0, the final norm and the head (and
so the loss) to stage S-1. Parameter names are the single-process ones (`layers.4.attention.wq
.weight`, `output.weight`), so layout-independent init, checkpoints and `meshlm generate` keep
working whatever the split.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from meshlm.model.llama import Llama

TIED_DUPLICATE = "output.weight"  # the last stage's copy of the tied embedding


def split_layers(n_layers: int, n_stages: int, layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """The layer indices of each virtual stage. Balanced by count unless `layers_per_stage` is
    given; when n_layers does not divide, the first stages get one more (the last stage also
    carries the head and the loss, usually the heaviest non-layer work)."""
    if layers_per_stage is None:
        base, extra = divmod(n_layers, n_stages)
        layers_per_stage = [base + (1 if s < extra else 0) for s in range(n_stages)]
    counts = list(layers_per_stage)
    if len(counts) != n_stages or any(c < 0 for c in counts) or sum(counts) != n_layers:
        raise ValueError(f"layers_per_stage={counts}: need {n_stages} counts >= 0 summing to n_layers={n_layers}")
    out, first = [], 0
    for count in counts:
        out.append(range(first, first + count))
        first += count
    return out


class PipelineStageModel(nn.Module):
    """This pipeline rank's chunks of the model. `forward(x, chunk)` runs one chunk: token ids in
    on virtual stage 0, hidden states [B, S, dim] between stages, logits out of the last stage."""

    def __init__(self, model: Llama, pp: int, rank: int, virtual: int = 1,
                 layers_per_stage: Sequence[int] | None = None):
        super().__init__()
        self.cfg = model.cfg
        self.pp, self.rank, self.virtual = pp, rank, virtual
        n_stages = pp * virtual
        ranges = split_layers(len(model.layers), n_stages, layers_per_stage)
        self.layers_per_stage = [len(r) for r in ranges]  # all stages', so rank 0 can gather them
        self.stages = [c * pp + rank for c in range(virtual)]  # the virtual stage of each chunk
        self.chunk_layers = [list(ranges[s]) for s in self.stages]
        self.holds_embedding = 0 in self.stages
        self.holds_head = n_stages - 1 in self.stages
        if self.holds_embedding:
            self.tok_embeddings = model.tok_embeddings
        self.rope = model.rope
        # A ModuleDict keyed by the global layer index keeps the names `layers.<i>.`.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for layers in self.chunk_layers for i in layers})
        if self.holds_head:
            self.norm = model.norm
            self.output = model.output
            if self.cfg.tie_embeddings and not self.holds_embedding:
                # The head is the embedding matrix; this stage gets its own copy. Both copies see
                # the same summed gradient and the same AdamW update, so they stay equal.
                original = model.tok_embeddings.weight
                weight = nn.Parameter(original.detach().clone())
                weight.meshlm_pp_duplicate = True  # counted once in the grad norm (data_parallel.py)
                for attr in ("meshlm_tp_sharded", "meshlm_tp_dim", "meshlm_tp_full_size", "meshlm_tp_replicas"):  # which tp slice it is
                    if hasattr(original, attr):
                        setattr(weight, attr, getattr(original, attr))
                self.output.weight = weight

    def is_first(self, chunk: int) -> bool:
        return self.stages[chunk] == 0

    def is_last(self, chunk: int) -> bool:
        return self.stages[chunk] == self.pp * self.virtual - 1

    def chunk_modules(self, chunk: int) -> list[nn.Module]:
        """The modules whose parameters chunk `chunk` uses (rope and its tables aside)."""
        modules = [self.layers[str(i)] for i in self.chunk_layers[chunk]]
        if self.is_first(chunk):
            modules.insert(0, self.tok_embeddings)
        if self.is_last(chunk):
            modules += [self.norm, self.output]
        return modules

    @property
    def tied_weight(self) -> nn.Parameter | None:
        """The copy of the tied embedding this rank holds (first or last stage), if any."""
        if not self.cfg.tie_embeddings or (self.holds_embedding and self.holds_head):
            return None
        if self.holds_embedding:
            return self.tok_embeddings.weight
        return self.output.weight if self.holds_head else None

    def forward(self, x: torch.Tensor, chunk: int = 0, seq_len: int | None = None) -> torch.Tensor:
        """`seq_len`: the full sequence length when `x` is a sequence-parallel shard of it (the
        blocks gather the whole sequence before attention, so rotary tables must cover it)."""
        cos, sin = self.rope(seq_len or x.shape[1])
        h = self.tok_embeddings(x) if self.is_first(chunk) else x
        for i in self.chunk_layers[chunk]:
            h = self.layers[str(i)](h, cos, sin)
        if self.is_last(chunk):
            return self.output(self.norm(h))
        return h


def stage_state_shapes(cfg, pp: int, rank: int, virtual: int = 1,
                       layers_per_stage: Sequence[int] | None = None) -> list[tuple[str, torch.Size]]:
    """(name, shape) of every state-dict entry pipeline rank `rank` holds, in state-dict order,
    computed on the meta device: what a receiver needs to gather a stage without asking it."""
    with torch.device("meta"):
        stage = PipelineStageModel(Llama(cfg), pp, rank, virtual, layers_per_stage)
    return [(name, t.shape) for name, t in stage.state_dict().items()]


def split_for_rank(model: Llama, cfg, ctx, layers_per_stage: Sequence[int] | None = None) -> PipelineStageModel:
    """The PP split step of `parallel.apply.build_local_model`: this rank's stage of `model` (on the
    meta device, already TP/CP/recompute-transformed as a whole), for parallel.pp, parallel.pp_virtual and
    parallel.pp_layers (an explicit split; `layers_per_stage` overrides it)."""
    from meshlm.mesh import parse_pp_layers

    p = cfg.parallel
    if layers_per_stage is None and p.pp_layers:
        layers_per_stage = parse_pp_layers(p.pp_layers)
    return PipelineStageModel(model, p.pp, ctx.coord("pp"), p.pp_virtual, layers_per_stage)
