"""Traced collectives: the one door through which meshlm communicates.

Reduces: blind spots; every op is recorded (op, group, dtype, size, bytes each rank sends and
receives by the algorithm's formula, start/end time, per-group sequence number).
Costs: a few microseconds of Python per op (measured by `meshlm bench comm`), no extra copies.

`Comm(ctx)` wraps the library collectives of torch.distributed (gloo on CPU, NCCL on GPU) and
names groups by parallel axis: `comm.all_reduce(t, "dp")`, `comm.all_gather(out, inp, "tp")`.
- Groups of one rank: nothing is sent and nothing is recorded (an op that moves no bytes would
  only dilute the summary); ops with an output copy the input there, so callers need no branch.
- async_op=True returns a `Handle`; the op's end time is stamped when the handle is waited.
- On GPU, durations come from CUDA events recorded around the op on the current stream (host
  timestamps would only measure the launch); they are read lazily when the summary is asked for.
- P2P peers are global ranks (pipeline neighbours come from ParallelContext.next_rank/prev_rank);
  `axis` only labels them in the summary.
- On gloo, sums and gathers of ranks on one host go through shared memory (comm/shared_memory.py),
  across hosts the reduce-scatter and all-gather through meshlm's P2P rings (comm/gloo_rings.py);
  NCCL keeps its own.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from meshlm.comm import shared_memory, shm_barrier
from meshlm.comm.cost import rank_traffic
from meshlm.comm.gloo_rings import DirectAllGather, RingReduceScatter, ring_applies
from meshlm.comm.recorder import CommRecord, FlightRecorder
from meshlm.mesh import AxesLike, ParallelContext, axes_label, normalize_axes

ReduceOp = dist.ReduceOp
# torch 2.13 named the flat-tensor collectives *_single (the *_into_tensor / *_tensor names now warn);
# GPU machines may run an older torch (the device tool's has 2.11): whichever this torch has.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# A compiled block (train.compile, parallel/compile.py) calls the ops below as they are: a graph
# break, not traced. Traced, dynamo would put the library collective into the graph as a functional
# one, apart from the recorder's bookkeeping around it, and cut the block into many small graphs.
# Costs about 0.5 us per call when nothing is compiled.
_eager = torch.compiler.disable


class P2P(NamedTuple):
    """One half of a point-to-point exchange for `Comm.batch_isend_irecv`: kind 'send' or 'recv'."""

    kind: str
    tensor: torch.Tensor
    peer: int


class Handle:
    """What an async op returns. `wait()` blocks (CPU) or orders the current stream (GPU) after
    the op, then stamps its end in the recorder. Waiting twice is harmless."""

    __slots__ = ("_works", "_records", "_recorder")

    def __init__(self, works: Sequence, records: Sequence[CommRecord], recorder: FlightRecorder | None):
        self._works = [w for w in works if w is not None]
        self._records = records
        self._recorder = recorder

    @_eager
    def wait(self) -> None:
        on_gpu = [r for r in self._records if r.t_end is None and r.cuda_events is not None]
        if on_gpu:
            # Where this stream starts waiting: what it ran since the issue overlapped the ops.
            on_gpu[0].wait_event = torch.cuda.Event(enable_timing=True)
            on_gpu[0].wait_event.record()
        if self._works:
            t0 = time.perf_counter()
            for work in self._works:
                work.wait()
            self._works = []
            if not on_gpu:  # on GPUs the host's wait is inside the stream's stall, counted from the events
                self._recorder.blocked_s += time.perf_counter() - t0
        for record in self._records:
            if record.t_end is None and record.cuda_events is not None:
                record.cuda_events[1].record()
            self._recorder.finish(record)
        for record in on_gpu[1:]:  # one stall for the handle: the first op carries it, the rest none
            record.wait_event = record.cuda_events[1]

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    @staticmethod
    def merge(handles: Sequence["Handle"]) -> "Handle":
        """One handle for several (of one recorder): waits for all of them."""
        recorders = [h._recorder for h in handles if h._recorder is not None]
        return Handle([w for h in handles for w in h._works], [r for h in handles for r in h._records],
                      recorders[0] if recorders else None)


_DONE = Handle((), (), None)  # for async ops on a group of one


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _same_dtype(op: str, label: str, output: torch.Tensor, input: torch.Tensor) -> None:
    """NCCL refuses an output of another dtype than the input; gloo's paths, the shared-memory
    window and the one-rank copy would cast silently. Checked on every backend, so a CPU test
    fails where the GPU run would."""
    if output.dtype != input.dtype:
        raise ValueError(f"{op} over {label}: output is {output.dtype}, input {input.dtype} (must be the same)")


def _dense(op: str, label: str, tensor: torch.Tensor) -> None:
    """NCCL refuses a tensor whose elements do not fill one block of memory (a strided view, such
    as a column); gloo takes it and reads and writes numel elements from its first, outside the
    view. Checked on every backend, so a CPU run fails where the GPU run would. (Any dim order
    is dense: a transposed tensor passes.)"""
    if tensor.is_contiguous():  # the common case, checked in C++: every op pays for this
        return
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(tensor.stride(), tensor.shape) if sz != 1):
        if stride != expected:
            raise ValueError(f"{op} over {label}: the tensor is a strided view (shape {list(tensor.shape)}, "
                             f"stride {list(tensor.stride())}); pass a contiguous copy and copy the result back")
        expected *= size


def _copy_if_distinct(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src.reshape(dst.shape))


class Comm:
    def __init__(self, ctx: ParallelContext, recorder: FlightRecorder | None = None, *, capacity: int = 4096,
                 shared_memory_ok: bool = True):
        self.ctx = ctx
        self.rank = ctx.rank
        self.recorder = recorder if recorder is not None else FlightRecorder(ctx.rank, capacity)
        self._axes: dict = {}  # axis as the caller spells it -> (label, group, ranks, my index)
        self.desync_next = False  # debug.fault=desync: the next all-reduce reads its bytes as another dtype
        self._gloo = dist.is_initialized() and dist.get_backend() == "gloo"
        # Groups on one host all-reduce through shared memory (comm/shared_memory.py), unless
        # MESHLM_SHM_DISABLE=1 (as NCCL_SHM_DISABLE) or shared_memory_ok=False (the library's ops
        # only: `meshlm bench comm` times tracing against them): group ranks -> their window, or
        # None for gloo's op.
        self._windows: dict[tuple[int, ...], shared_memory.SharedWindow | None] = {}
        self._shared_memory = (shared_memory_ok and self._gloo
                               and os.environ.get("MESHLM_SHM_DISABLE", "0") in ("", "0"))
        self._futex_barrier = shm_barrier.usable()
        self._barrier_clock = shared_memory.BarrierClock()  # every window's barrier seconds

    # ---- plumbing

    def _group(self, axis: AxesLike):
        """(label, process group, global ranks, this rank's index in them); cached because this
        runs on every op and the tracing overhead is measured in microseconds."""
        key = axis if isinstance(axis, str) else tuple(axis)
        found = self._axes.get(key)
        if found is None:
            axes = normalize_axes(axis)
            ranks = self.ctx.ranks(axes)
            found = self._axes[key] = (axes_label(axes), self.ctx.group(axes), ranks, ranks.index(self.rank))
        return found

    def _begin(self, op, label, n, tensor, numel, nbytes, traffic, *, peer=None, async_op=False, channel=None):
        record = self.recorder.start(op, label, n, tensor.dtype, numel, nbytes, traffic[0], traffic[1],
                                     peer=peer, async_op=async_op, channel=channel)
        if tensor.is_cuda:
            record.cuda_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            record.cuda_events[0].record()
        return record

    def _end(self, record: CommRecord, work, async_op: bool) -> Handle | None:
        if async_op:
            return Handle([work], [record], self.recorder)
        if record.cuda_events is not None:
            record.cuda_events[1].record()  # on the current stream, which now waits for the op
        self.recorder.finish(record)
        return None

    # ---- collectives

    @_eager
    def all_reduce(self, tensor: torch.Tensor, axis: AxesLike, op=ReduceOp.SUM, async_op: bool = False):
        """In place: every rank of the group ends with the reduction of all ranks' `tensor`."""
        label, group, ranks, me = self._group(axis)
        n = len(ranks)
        _dense("all_reduce", label, tensor)
        if n == 1:
            return _DONE if async_op else None
        if self.desync_next:  # same shape and bytes, another dtype: no backend notices (debug/faults.py)
            self.desync_next = False
            tensor = tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(tensor.element_size(), torch.int64))
        traffic = rank_traffic("all_reduce", n, me, tensor.numel(), tensor.element_size())
        record = self._begin("all_reduce", label, n, tensor, tensor.numel(), _bytes(tensor), traffic, async_op=async_op)
        # Small all-reduces take the window only where its barrier is the futex one (decided alike
        # on every rank: one host, one architecture); the window's own check covers the rest.
        small = _bytes(tensor) < shared_memory.SHARED_MEMORY_MIN_BYTES and not self._futex_barrier
        window = (None if small else
                  self._window(group, ranks, me, op, tensor, ops=shared_memory.ALL_REDUCE_OPS))
        if window is not None and _bytes(tensor) >= window.all_reduce_min_bytes:
            work = shared_memory.Deferred(window.all_reduce, tensor, op)
            if not async_op:
                work.wait()
        else:
            work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        return self._end(record, work, async_op)

    def _window(self, group, ranks, me, op, *tensors, ops=(None, ReduceOp.SUM)) -> shared_memory.SharedWindow | None:
        """The shared-memory window of these ranks if the op may take it. Opened (collectively)
        by their first op that may, with slots as large as that op needs (1-16 MiB), and opened
        again, larger, by a later op that needs more: every rank decides alike, from sizes."""
        if not (self._shared_memory and shared_memory.applies(op, *tensors, ops=ops)):
            return None
        key = tuple(ranks)  # "world" and "dp" of a pure data-parallel run share one window
        window = self._windows.get(key, False)
        wanted = shared_memory.slot_bytes_for(max(t.numel() * t.element_size() for t in tensors))
        if window is False:
            window = self._windows[key] = shared_memory.SharedWindow.open(group, ranks, me, wanted,
                                                                          self._barrier_clock)
        elif window is not None and window.requested < wanted:
            larger = shared_memory.SharedWindow.open(group, ranks, me, wanted, self._barrier_clock)
            window = self._windows[key] = larger or window
        return window

    @_eager
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, axis: AxesLike, async_op: bool = False):
        """output (n times input's size) = the group's inputs concatenated in group-rank order."""
        label, group, ranks, me = self._group(axis)
        n = len(ranks)
        if output.numel() != n * input.numel():
            raise ValueError(f"all_gather over {label} (n={n}): output has {output.numel()} elements, "
                             f"expected {n} x {input.numel()}")
        _same_dtype("all_gather", label, output, input)
        if n == 1:
            _copy_if_distinct(output, input)
            return _DONE if async_op else None
        traffic = rank_traffic("all_gather", n, me, output.numel(), output.element_size())
        record = self._begin("all_gather", label, n, output, output.numel(), _bytes(output), traffic, async_op=async_op)
        window = self._window(group, ranks, me, None, output, input)
        if window is not None:
            work = shared_memory.Deferred(window.all_gather, output, input)
            if not async_op:
                work.wait()
        elif self._gloo and ring_applies(output, input):
            # gloo's own gathers into a temporary and copies out (comm/gloo_rings.py)
            work = DirectAllGather(output, input, group, ranks, me)
            if not async_op:
                work.wait()
        else:
            work = all_gather_single(output, input, group=group, async_op=async_op)
        return self._end(record, work, async_op)

    @_eager
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, axis: AxesLike, op=ReduceOp.SUM,
                       async_op: bool = False):
        """output (1/n of input) = group-rank-th slice of the reduction of all ranks' `input`."""
        label, group, ranks, me = self._group(axis)
        n = len(ranks)
        if input.numel() != n * output.numel():
            raise ValueError(f"reduce_scatter over {label} (n={n}): input has {input.numel()} elements, "
                             f"expected {n} x {output.numel()}")
        _same_dtype("reduce_scatter", label, output, input)
        if n == 1:
            _copy_if_distinct(output, input)
            return _DONE if async_op else None
        traffic = rank_traffic("reduce_scatter", n, me, input.numel(), input.element_size())
        record = self._begin("reduce_scatter", label, n, input, input.numel(), _bytes(input), traffic, async_op=async_op)
        window = self._window(group, ranks, me, op, output, input)
        if window is not None:
            work = shared_memory.Deferred(window.reduce_scatter, output, input)
            if not async_op:
                work.wait()
        elif self._gloo and op == ReduceOp.SUM and ring_applies(output, input):
            # gloo's own is an all-reduce plus copies: twice the bytes (comm/gloo_rings.py)
            work = RingReduceScatter(output, input, group, ranks, me)
            if not async_op:
                work.wait()
        else:
            work = reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
        return self._end(record, work, async_op)

    @_eager
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, axis: AxesLike,
                   output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None,
                   async_op: bool = False):
        """Rank i's j-th slice (dim 0) goes to rank j's i-th slice; equal slices unless split sizes given."""
        label, group, ranks, me = self._group(axis)
        n = len(ranks)
        _same_dtype("all_to_all", label, output, input)
        if n == 1:
            _copy_if_distinct(output, input)
            return _DONE if async_op else None
        row = input.numel() // input.shape[0] if input.dim() and input.shape[0] else 1
        ins = input_split_sizes or [input.shape[0] // n] * n
        outs = output_split_sizes or [output.shape[0] // n] * n
        traffic = rank_traffic("all_to_all", n, me, input.numel(), input.element_size(),
                               in_splits=ins, out_splits=outs, row_numel=row)
        record = self._begin("all_to_all", label, n, input, input.numel(), _bytes(input), traffic, async_op=async_op)
        work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                      async_op=async_op)
        return self._end(record, work, async_op)

    @_eager
    def broadcast(self, tensor: torch.Tensor, src: int, axis: AxesLike, async_op: bool = False):
        """Copy `tensor` from global rank `src` to every rank of the group."""
        label, group, ranks, me = self._group(axis)
        n = len(ranks)
        _dense("broadcast", label, tensor)
        if n == 1:
            return _DONE if async_op else None
        traffic = rank_traffic("broadcast", n, me, tensor.numel(), tensor.element_size(),
                               root=ranks.index(src))
        record = self._begin("broadcast", label, n, tensor, tensor.numel(), _bytes(tensor), traffic, async_op=async_op)
        work = dist.broadcast(tensor, src=src, group=group, async_op=async_op)
        return self._end(record, work, async_op)

    @_eager
    def barrier(self, axis: AxesLike = "world") -> None:
        label, group, ranks, me = self._group(axis)
        if len(ranks) == 1:
            return
        record = self.recorder.start("barrier", label, len(ranks), torch.uint8, 0, 0, 0, 0)
        dist.barrier(group=group)
        self.recorder.finish(record)

    # ---- point to point (global ranks)

    def _p2p_record(self, kind: str, tensor: torch.Tensor, peer: int, label: str, async_op: bool) -> CommRecord:
        nbytes = _bytes(tensor)
        traffic = (nbytes, 0) if kind == "send" else (0, nbytes)
        channel = f"send->{peer}" if kind == "send" else f"recv<-{peer}"
        return self._begin(kind, label, 2, tensor, tensor.numel(), nbytes, traffic, peer=peer,
                           async_op=async_op, channel=channel)

    @_eager
    def send(self, tensor: torch.Tensor, dst: int, axis: str = "world") -> None:
        record = self._p2p_record("send", tensor, dst, axis, False)
        dist.send(tensor, dst=dst)
        self._end(record, None, False)

    @_eager
    def recv(self, tensor: torch.Tensor, src: int, axis: str = "world") -> None:
        record = self._p2p_record("recv", tensor, src, axis, False)
        dist.recv(tensor, src=src)
        self._end(record, None, False)

    @_eager
    def isend(self, tensor: torch.Tensor, dst: int, axis: str = "world") -> Handle:
        record = self._p2p_record("send", tensor, dst, axis, True)
        return Handle([dist.isend(tensor, dst=dst)], [record], self.recorder)

    @_eager
    def irecv(self, tensor: torch.Tensor, src: int, axis: str = "world") -> Handle:
        record = self._p2p_record("recv", tensor, src, axis, True)
        return Handle([dist.irecv(tensor, src=src)], [record], self.recorder)

    @_eager
    def batch_isend_irecv(self, ops: Sequence[P2P], axis: str = "world", group=None) -> Handle:
        """Start all sends and receives at once (so a ring of sends cannot deadlock); one handle.
        Empty tensors are skipped: both sides know the sizes, and there is nothing to move.
        `group`: the process group to carry them (default: the world's); peers stay global ranks."""
        for o in ops:
            if o.kind not in ("send", "recv"):
                raise ValueError(f"P2P kind must be 'send' or 'recv', got {o.kind!r}")
        ops = [o for o in ops if o.tensor.numel() > 0]
        if not ops:
            return _DONE
        records = [self._p2p_record(o.kind, o.tensor, o.peer, axis, True) for o in ops]
        p2p = [dist.P2POp(dist.isend if o.kind == "send" else dist.irecv, o.tensor, o.peer, group) for o in ops]
        return Handle(dist.batch_isend_irecv(p2p), records, self.recorder)

    # ---- reading

    def peer_wait_s(self) -> float:
        """Seconds this rank has spent so far at the shared-memory collectives' barriers: mostly
        waiting for the last rank of the group to arrive (their skew), part of the time blocked
        that the flight recorder counts. 0 where no window is used (gloo's own ops, NCCL)."""
        return self._barrier_clock.seconds

    def uses_shared_memory(self, axis: AxesLike) -> bool:
        """Whether the group's collectives have gone through shared memory (comm/shared_memory.py)."""
        return self._windows.get(tuple(self._group(axis)[2])) is not None

    def groups(self) -> dict[str, list[int]]:
        """Each group this rank has used, by label: its global ranks (for the hang/desync report)."""
        return {label: list(ranks) for label, _, ranks, _ in self._axes.values()}

    def summary(self) -> list[dict]:
        return self.recorder.summary()

    def format_summary(self, title: str | None = None) -> str:
        return self.recorder.format_summary(title)
