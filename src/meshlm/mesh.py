"""ParallelContext: the world as a grid of ranks with named axes tp, cp, dp, pp (tp fastest).

Reduces: nothing by itself; it is the one map every technique reads (who shares my weights, my
batch, my pipeline stage), so no technique re-derives rank arithmetic of its own.
Costs: one `new_group` per process group at start-up (collective, done once); none afterwards.

Two layers, kept apart on purpose:
- `Layout` is pure rank arithmetic (a frozen dataclass, no torch.distributed): coordinates of a
  rank, the rank at given coordinates, every group of ranks along any set of axes. It is tested
  against a brute-force enumeration for hundreds of shapes without starting a process.
- `ParallelContext` turns a Layout into process groups for this rank, once, in the same order
  on every rank (`new_group` is collective: every rank must call it for every group, even the
  groups it is not in). It is passed explicitly to whatever needs it; there is no global.

Why tp is the fastest axis: ranks r and r+1 usually sit on the same node, and tensor parallelism
communicates on every layer (two all-reduces per block, forward and backward), so it gets the
fastest links. pp is slowest: a pipeline only sends activations between neighbouring stages.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from meshlm.errors import ConfigError
from meshlm.group_timeout import group_timeout

if TYPE_CHECKING:  # config.py will import this module to call check_layout; avoid a cycle.
    from meshlm.config import Config, ParallelConfig

AXES: tuple[str, ...] = ("tp", "cp", "dp", "pp")  # fastest-varying first

# Groups every run creates (besides the world): one per axis, dp x cp for gradient reduction
# (context-parallel ranks hold the same weights and see different tokens, so their gradients are
# summed together with the data-parallel ones), and the embedding group (see `embedding_groups`).
DEFAULT_GROUPS: tuple[tuple[str, ...], ...] = (("tp",), ("cp",), ("dp",), ("pp",), ("cp", "dp"))

AxesLike = str | Sequence[str]


def normalize_axes(axes: AxesLike) -> tuple[str, ...]:
    """'dp' -> ('dp',); ('dp', 'cp') or 'dp+cp' -> ('cp', 'dp') (canonical order); 'world' -> all."""
    if isinstance(axes, str):
        if axes == "world":
            return AXES
        axes = axes.split("+")
    unknown = [a for a in axes if a not in AXES]
    if unknown or not axes:
        raise ValueError(f"unknown axes {list(axes)!r} (known: {', '.join(AXES)} or 'world')")
    return tuple(a for a in AXES if a in axes)


def axes_label(axes: tuple[str, ...]) -> str:
    return "world" if axes == AXES else "+".join(axes)


# --------------------------------------------------------------------------- pure rank arithmetic


@dataclass(frozen=True)
class Layout:
    """Sizes of the four axes. rank = tp_i + tp*(cp_i + cp*(dp_i + dp*pp_i))."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1

    def __post_init__(self):
        for axis in AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{axis} must be a positive integer, got {value!r}")

    @classmethod
    def from_config(cls, p: "ParallelConfig", world_size: int | None = None) -> "Layout":
        """dp=0 in the config means 'whatever is left of the world'."""
        dp = p.dp
        if dp == 0:
            if world_size is None:
                raise ValueError("parallel.dp=0 (auto) needs the world size")
            dp = world_size // (p.tp * p.cp * p.pp)
        return cls(tp=p.tp, cp=p.cp, dp=dp, pp=p.pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def size(self, axes: AxesLike) -> int:
        return math.prod(getattr(self, a) for a in normalize_axes(axes))

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours along `axis` (product of the faster axes' sizes)."""
        return math.prod(getattr(self, a) for a in AXES[: AXES.index(axis)])

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        out = {}
        for axis in AXES:
            rank, out[axis] = divmod(rank, getattr(self, axis))
        return out

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """Inverse of `coords`; missing axes count as coordinate 0."""
        return sum(coords.get(a, 0) * self.stride(a) for a in AXES)

    def groups(self, axes: AxesLike) -> list[tuple[int, ...]]:
        """Every group of ranks that differ only along `axes`, each sorted, ordered by first rank.

        Within a group, position i is the rank's index along the axes (first axis fastest), which
        is what torch.distributed calls the group rank, since groups are sorted.
        """
        axes = normalize_axes(axes)
        inner = [0]  # offsets of a group's members from its first rank
        for a in axes:
            inner = [o + k * self.stride(a) for k in range(getattr(self, a)) for o in inner]
        bases = [0]  # first ranks of the groups: all coordinates of the other axes
        for a in AXES:
            if a not in axes:
                bases = [b + k * self.stride(a) for k in range(getattr(self, a)) for b in bases]
        return [tuple(sorted(b + o for o in inner)) for b in sorted(bases)]

    def group_of(self, rank: int, axes: AxesLike) -> tuple[int, ...]:
        axes = normalize_axes(axes)
        c = self.coords(rank)
        base = self.rank_of({a: (0 if a in axes else c[a]) for a in AXES})
        inner = [0]
        for a in axes:
            inner = [o + k * self.stride(a) for k in range(getattr(self, a)) for o in inner]
        return tuple(sorted(base + o for o in inner))

    def pp_neighbour(self, rank: int, step: int) -> int:
        """The rank `step` pipeline stages away with the same tp/cp/dp coordinates (wrapping, so the
        interleaved schedule can send from the last stage back to the first)."""
        c = self.coords(rank)
        c["pp"] = (c["pp"] + step) % self.pp
        return self.rank_of(c)

    def embedding_groups(self) -> list[tuple[int, ...]]:
        """First and last pipeline stage of every pipeline: with tied embeddings the input
        embedding (first stage) and the output head (last stage) are one weight, so their
        gradients are summed across this pair. A single stage holds both: a group of one."""
        return [tuple(sorted({g[0], g[-1]})) for g in self.groups("pp")]

    def describe(self) -> str:
        return " x ".join(f"{a}={getattr(self, a)}" for a in AXES) + f" = {self.world_size} ranks"


# --------------------------------------------------------------------------- validation


def parse_pp_layers(text: str) -> list[int] | None:
    """parallel.pp_layers ("3,1") as counts, or None if it is not a list of integers >= 0."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        return None
    return counts if all(c >= 0 for c in counts) else None


def check_layout(cfg: "Config", world_size: int) -> None:
    """Raise ConfigError (one line, naming the key) if the model or batch cannot be split as asked.

    `config.validate` already checks dp*tp*cp*pp == world size, global batch divisibility, schedule
    names and the zero stage; these are the checks that need the model and the parallel layout
    together. `world_size` is accepted for a uniform signature (the callers always have it).
    """
    from meshlm.model.presets import PRESETS

    m, t, p = cfg.model, cfg.train, cfg.parallel
    preset = PRESETS.get(m.preset, {})

    def model(key: str):  # unresolved configs still carry None: read the preset then
        value = getattr(m, key)
        return preset.get(key) if value is None else value

    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    if p.tp > 1:
        # Each tensor-parallel rank owns whole heads and an equal slice of the MLP hidden size.
        # The vocabulary is padded to a multiple of tp instead. Under GQA kv heads are split when
        # tp divides them, replicated when tp is a multiple of them (parallel/tensor.py).
        heads, kv = model("n_heads"), model("n_kv_heads")
        require(heads is None or heads % p.tp == 0, f"parallel.tp: model.n_heads={heads} is not divisible by tp={p.tp}")
        require(kv is None or kv % p.tp == 0 or p.tp % kv == 0,
                f"parallel.tp: model.n_kv_heads={kv} neither divides nor is divisible by tp={p.tp} "
                f"(kv heads are split or replicated across tp ranks)")
        ffn = model("ffn_dim")
        require(ffn is None or ffn % p.tp == 0, f"parallel.tp: model.ffn_dim={ffn} is not divisible by tp={p.tp}")
        vocab = model("vocab_size")  # ceil(V/tp) rows a rank (vocab_parallel.VocabShard): the last must get one
        require(vocab is None or -(-vocab // p.tp) * (p.tp - 1) < vocab,
                f"parallel.tp: model.vocab_size={vocab} in slices of {-(-vocab // p.tp) if vocab else 0} rows "
                f"leaves the last of tp={p.tp} ranks no vocabulary")
    stages = p.pp * p.pp_virtual
    n_layers = model("n_layers")
    if p.pp_layers:
        counts = parse_pp_layers(p.pp_layers)
        require(counts is not None and len(counts) == stages and (n_layers is None or sum(counts) == n_layers),
                f"parallel.pp_layers: {p.pp_layers!r} must be pp*pp_virtual = {stages} comma-separated layer counts "
                f">= 0 summing to model.n_layers={n_layers}")
    else:
        require(n_layers is None or n_layers % stages == 0,
                f"parallel.pp: model.n_layers={n_layers} is not divisible into pp*pp_virtual = "
                f"{p.pp}*{p.pp_virtual} = {stages} stages (or give parallel.pp_layers)")
    require(p.pp_virtual == 1 or p.pp_schedule == "interleaved",
            f"parallel.pp_virtual: {p.pp_virtual} virtual stages need parallel.pp_schedule=interleaved "
            f"(got {p.pp_schedule!r})")
    if p.cp > 1:
        # Causal load balancing cuts the sequence into 2*cp chunks and gives rank i chunks i and
        # 2*cp-1-i, so every rank gets the same amount of attention work.
        require(t.seq_len % (2 * p.cp) == 0,
                f"parallel.cp: train.seq_len={t.seq_len} is not divisible by 2*cp = {2 * p.cp} "
                f"(causal load balancing splits it into 2*cp chunks)")
    if p.sp and p.tp > 1:
        local = t.seq_len // p.cp
        require(local % p.tp == 0,
                f"parallel.sp: the per-rank sequence train.seq_len/cp = {local} is not divisible by tp={p.tp}")


# --------------------------------------------------------------------------- process groups


def nccl_usable() -> bool:
    """A visible CUDA GPU and a torch built with NCCL: what parallel.backend=nccl needs."""
    return torch.cuda.is_available() and dist.is_nccl_available()


def default_backend(preference: str = "auto", *, nccl_ok: bool | None = None) -> str:
    """parallel.backend resolved: auto = nccl where NCCL is usable, else gloo; gloo or nccl as
    asked (gloo on a GPU machine trains on the CPU: default_device). An nccl that cannot run is
    refused before any rank starts (cli.cmd_train). `nccl_ok` replaces the probe (pure checks)."""
    if preference != "auto":
        return preference
    return "nccl" if (nccl_usable() if nccl_ok is None else nccl_ok) else "gloo"


def default_device(backend: str, rank: int = 0) -> torch.device:
    """nccl -> this process's GPU (LOCAL_RANK from torchrun); anything else -> the CPU."""
    if backend == "nccl" or (backend != "gloo" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class ParallelContext:
    """This rank's place in the layout, with one process group per axis combination it needs.

    `group(axes)` returns None for a group of one rank: there is nothing to communicate, and the
    traced layer (`meshlm.comm.Comm`) skips such groups. Never pass a None group straight to
    torch.distributed, where None means the whole world; ask `size(axes) > 1` first.

    `embedding_ranks` are the first and last stage of this rank's pipeline; `embedding_group` is
    their group on those two ranks and None elsewhere (middle stages, or pp=1).
    """

    def __init__(self, layout: Layout, *, extra_groups: Iterable[AxesLike] = (), device: torch.device | None = None,
                 backend: str = "auto"):
        initialized = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size() if initialized else 1
        if layout.world_size != world_size:
            raise ValueError(f"layout {layout.describe()} does not match the world size {world_size}")
        self.layout = layout
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = world_size
        # One process (no group): `backend` (parallel.backend) still picks the device, so gloo runs on the CPU.
        self.backend = dist.get_backend() if initialized else default_backend(backend)
        self.device = device if device is not None else default_device(self.backend, self.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._coords = layout.coords(self.rank)
        self._ranks: dict[tuple[str, ...], tuple[int, ...]] = {}
        self._groups: dict[tuple[str, ...], dist.ProcessGroup | None] = {}
        self.groups_created = 0  # how many new_group calls this context made (size-1 axes: none)
        for axes in (*DEFAULT_GROUPS, *(normalize_axes(a) for a in extra_groups)):
            self._build(axes)
        self._build(AXES)
        self.embedding_ranks, self.embedding_group = self._build_embedding()

    @classmethod
    def from_config(cls, p: "ParallelConfig", **kwargs) -> "ParallelContext":
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        kwargs.setdefault("backend", p.backend)
        return cls(Layout.from_config(p, world_size), **kwargs)

    # ---- building (collective: same calls, same order, on every rank)

    def _new_group(self, ranks: tuple[int, ...]):
        if len(ranks) == self.world_size:
            return dist.group.WORLD  # the world already exists; a copy would cost a communicator
        self.groups_created += 1
        # new_group takes gloo's 30 min, not the world's timeout, unless told: every group keeps the configured one.
        return dist.new_group(list(ranks), timeout=group_timeout())

    def _build(self, axes: tuple[str, ...]) -> None:
        if axes in self._groups:
            return
        mine = self.layout.group_of(self.rank, axes)
        self._ranks[axes] = mine
        # Axes of size 1 add nothing: ('cp','dp') with cp=1 is the dp group, reuse it.
        effective = tuple(a for a in axes if getattr(self.layout, a) > 1)
        if len(mine) == 1:
            self._groups[axes] = None
        elif effective != axes and effective in self._groups:
            self._groups[axes] = self._groups[effective]
        else:
            group = None
            for ranks in self.layout.groups(axes):
                created = self._new_group(ranks)
                if self.rank in ranks:
                    group = created
            self._groups[axes] = group
            self._groups.setdefault(effective, group)
            self._ranks.setdefault(effective, mine)

    def _build_embedding(self):
        """(first and last stage of my pipeline, their group if I am one of them, else None)."""
        groups = self.layout.embedding_groups()
        pipeline = self._ranks[("pp",)]
        mine = tuple(sorted({pipeline[0], pipeline[-1]}))
        if len(mine) == 1:
            return mine, None
        if self.layout.pp == 2:  # first and last stage are the whole pipeline
            return mine, self._groups[("pp",)]
        group = None
        for ranks in groups:  # middle stages create the groups too: new_group is collective
            created = self._new_group(ranks)
            if self.rank in ranks:
                group = created
        return mine, group

    # ---- queries

    def coord(self, axis: str) -> int:
        return self._coords[axis]

    @property
    def coords(self) -> dict[str, int]:
        return dict(self._coords)

    def size(self, axes: AxesLike) -> int:
        return self.layout.size(axes)

    def _key(self, axes: AxesLike) -> tuple[str, ...]:
        key = normalize_axes(axes)
        if key not in self._ranks:
            known = ", ".join(axes_label(k) for k in self._ranks)
            raise KeyError(f"no process group for {axes_label(key)!r} (created: {known}; "
                           f"ask for it with ParallelContext(..., extra_groups=[...]))")
        return key

    def group(self, axes: AxesLike):
        """The process group along `axes` that contains this rank; None if it is this rank alone."""
        return self._groups[self._key(axes)]

    def ranks(self, axes: AxesLike) -> tuple[int, ...]:
        """Global ranks of this rank's group along `axes`, sorted (index = group rank)."""
        return self._ranks[self._key(axes)]

    def group_rank(self, axes: AxesLike) -> int:
        return self.ranks(axes).index(self.rank)

    # ---- pipeline

    @property
    def is_first_stage(self) -> bool:
        return self._coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self._coords["pp"] == self.layout.pp - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps from the last stage to the first)."""
        return self.layout.pp_neighbour(self.rank, +1)

    @property
    def prev_rank(self) -> int:
        return self.layout.pp_neighbour(self.rank, -1)

    def __repr__(self) -> str:
        where = ", ".join(f"{a}={self._coords[a]}" for a in AXES)
        return (f"ParallelContext(rank {self.rank}/{self.world_size}: {where}; "
                f"{self.layout.describe()}; {self.backend} on {self.device})")

