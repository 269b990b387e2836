"""Flat buffers and buckets: the bookkeeping under DDP and ZeRO.

Reduces: collective count and launch overhead; one collective per bucket of many parameters
instead of one per parameter, and a contiguous buffer that a collective can work on in place.
Costs: a padding of at most (n-1) elements per bucket so that every bucket splits into n equal
shards, and the rule that buckets are reduced strictly in order (so that every rank issues the
same collectives in the same order, whatever order its gradients become ready in).

- `FlatLayout` places parameters one after another (in the order given: DDP and ZeRO pass them
  in reverse registration order, roughly the order backward produces their gradients) and cuts
  the sequence into buckets of about `bucket_bytes`, each padded to a multiple of `align`. A
  parameter of `bucket_bytes` or more has a bucket of its own (Megatron-LM gives the shared
  embedding one too): joined to the previous bucket's parameters, the first block's would wait for
  the embedding's gradient, the last in backward, and ZeRO-2 would stage a table-sized bucket from
  the first of them on.
  Shard r of a bucket is its r-th 1/align slice; a shard crosses parameter boundaries freely.
- `ReadyTracker` is DDP's reducer logic: a gradient-ready event marks a parameter; a bucket
  whose parameters are all marked is launched, buckets strictly in index order; at the end of
  backward the rest are launched, and parameters that never got a gradient on the first step
  are remembered as unused, so later steps do not wait for them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch import nn


@dataclass
class Slot:
    """One parameter's place in the flat buffer: elements [start, start + numel)."""

    name: str
    param: nn.Parameter
    start: int
    numel: int
    shape: torch.Size

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass
class Bucket:
    """Elements [start, end) of the flat buffer (end padded to a multiple of the alignment)."""

    index: int
    start: int
    end: int = 0
    slots: list[Slot] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard(self, rank: int, n: int) -> tuple[int, int]:
        """Flat range of shard `rank` of `n` (equal slices; the padding sits in the last ones)."""
        size = self.numel // n
        return self.start + rank * size, self.start + (rank + 1) * size


@dataclass
class Segment:
    """The overlap of a flat range with one parameter: flat [lo, hi) = param.view(-1)[p_lo:p_hi]."""

    slot: Slot
    lo: int
    hi: int

    @property
    def p_lo(self) -> int:
        return self.lo - self.slot.start

    @property
    def p_hi(self) -> int:
        return self.hi - self.slot.start


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


class FlatLayout:
    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], bucket_bytes: int, align: int = 1,
                 itemsize: int = 4) -> None:
        if not named_params:
            raise ValueError("no trainable parameters to lay out")
        self.align = align
        self.buckets: list[Bucket] = []
        self.slots: list[Slot] = []
        cap = max(1, bucket_bytes // itemsize)
        offset = 0
        bucket = Bucket(0, 0)
        for name, p in named_params:
            if bucket.slots and (offset - bucket.start >= cap or p.numel() >= cap):
                offset = self._close(bucket, offset)
                bucket = Bucket(len(self.buckets), offset)
            slot = Slot(name, p, offset, p.numel(), p.shape)
            bucket.slots.append(slot)
            self.slots.append(slot)
            offset += p.numel()
        self.numel = self._close(bucket, offset)

    def _close(self, bucket: Bucket, offset: int) -> int:
        bucket.end = bucket.start + round_up(max(offset - bucket.start, 1), self.align)
        self.buckets.append(bucket)
        return bucket.end

    def segments(self, lo: int, hi: int, slots: Sequence[Slot] | None = None) -> list[Segment]:
        """The parameters overlapping flat range [lo, hi), with the overlap of each (padding skipped)."""
        out = []
        for s in slots if slots is not None else self.slots:
            a, b = max(lo, s.start), min(hi, s.end)
            if a < b:
                out.append(Segment(s, a, b))
        return out

    def shard_segments(self, rank: int, n: int) -> list[tuple[Bucket, Segment]]:
        """Every (bucket, segment) of this rank's shards, bucket by bucket."""
        out = []
        for b in self.buckets:
            lo, hi = b.shard(rank, n)
            out.extend((b, seg) for seg in self.segments(lo, hi, b.slots))
        return out


def weak_hook(method: Callable) -> Callable:
    """A hook that calls `method` while its object lives. Hooks registered on a tensor are held
    by C++ (invisible to Python's garbage collector), so a hook holding its engine strongly would
    keep the engine, and every buffer it owns, alive forever: a leak no `del` can fix."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        return None if bound is None else bound(*args)

    return hook


def point_params_into(buffer: torch.Tensor, slots: Sequence[Slot], copy: bool = True) -> None:
    """Make each slot's parameter a view of `buffer` (copying its current value in first), so the
    parameters live in one contiguous storage a collective can fill in one call."""
    with torch.no_grad():
        for s in slots:
            view = buffer[s.start: s.end].view(s.shape)
            if copy:
                view.copy_(s.param.detach())
            s.param.data = view


class ReadyTracker:
    """Gradient-ready bookkeeping: launches a bucket once all its parameters are marked, buckets
    strictly in index order (bucket k never before bucket k-1), so all ranks agree on the order.
    A backward may cover only some buckets (`reset(order)`, `extend`): those, still in index order.

    `members` holds each bucket's parameters. Parameters that get no gradient on the first step
    are found by `flush` and excluded from later steps' waiting; if one of them later gets a
    gradient after its bucket was already reduced, that is an error naming it (the reduction is
    already on the wire without it).
    """

    def __init__(self, members: Sequence[Sequence[tuple[str, nn.Parameter]]], launch: Callable[[int], None]):
        self.launch = launch
        self.members = [{id(p) for _, p in group} for group in members]
        self.names = {id(p): name for group in members for name, p in group}
        self.bucket_of = {id(p): b for b, group in enumerate(members) for _, p in group}
        self.unused: set[int] = set()
        self.first_step = True
        self._seen: set[int] = set()  # parameters with a gradient in some backward of the first step
        self.reset()

    def reset(self, order: Sequence[int] | None = None) -> None:
        """A new backward. `order`: the buckets it covers (default all); `extend` adds more."""
        self.ready = [set() for _ in self.members]
        self.order = list(range(len(self.members))) if order is None else sorted(order)
        self.next = 0  # position in `order` of the next bucket to launch

    def extend(self, buckets: Iterable[int]) -> None:
        """Make this backward cover `buckets` too: those not launched yet join the rest of the
        order, which stays in index order (FSDP under an interleaved pipeline: the units of the
        module call whose backward starts)."""
        done = self.order[:self.next]
        self.order = done + sorted(set(self.order[self.next:]) | (set(buckets) - set(done)))

    def mark(self, param: torch.Tensor) -> None:
        key = id(param)
        b = self.bucket_of[key]
        if b not in self.order:  # a bucket this backward was not said to cover: it does now
            self.extend([b])
        if self.order.index(b) < self.next:
            raise RuntimeError(
                f"parameter {self.names[key]!r} received a gradient after its bucket {b} was already reduced: "
                f"it had no gradient on the first step (so it was recorded as unused) or it got two gradients "
                f"in one backward; make every step use the same parameters")
        self.ready[b].add(key)
        self.unused.discard(key)
        if self.first_step:
            self._seen.add(key)
        while self.next < len(self.order) and \
                self.members[self.order[self.next]] - self.unused <= self.ready[self.order[self.next]]:
            self.next += 1
            self.launch(self.order[self.next - 1])

    def flush(self, end_of_step: bool = True) -> list[str]:
        """Launch every bucket not launched yet; returns the names of parameters with no gradient.
        At the end of the first step (`end_of_step`; an engine that flushes every backward, such as
        FSDP under a pipeline, where a backward covers one chunk, says when the step ends through
        `end_first_step`), the parameters no backward of it reached are recorded as unused."""
        missing = []
        while self.next < len(self.order):
            b = self.order[self.next]
            missing.extend(self.names[k] for k in self.members[b] - self.ready[b])
            self.next += 1
            self.launch(b)
        if self.first_step and end_of_step:
            self.end_first_step()
        return missing

    def end_first_step(self) -> list[str]:
        """Record the parameters no backward of the first step reached as unused; their names."""
        if self.first_step:
            self.unused = set(self.names) - self._seen
            self.first_step = False
        return [self.names[k] for k in self.names if k in self.unused]
