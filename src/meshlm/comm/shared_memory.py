"""Collectives through shared memory for the ranks of a gloo group that share one host: what
`Comm` runs there for every sum, max and min all-reduce (from `SHARED_MEMORY_MIN_BYTES` up where
the barrier is gloo's), and for every sum reduce-scatter and all-gather, of contiguous real-number
tensors.

Reduces: the cost of moving bytes through loopback TCP (gloo's all-reduce, and meshlm's P2P rings,
whose every gloo send/recv costs ~1 ms here): 16 MiB all-reduce on 2 ranks, 8.9 ms with gloo,
4.1 ms here (benchmarks/collectives.py). NCCL does the same inside a node (its SHM and P2P
transports).
Costs: a window of 2 x n slots of /dev/shm per set of ranks (slots as large as the largest op
needs, 1-16 MiB; smaller where /dev/shm is small; none, and gloo's or the rings' op, where the
ranks are on different hosts or /dev/shm has no room), one barrier per phase (~10 us on futexes,
comm/shm_barrier.py; gloo's, ~0.3 ms, where that one cannot run), and no background progress:
the work runs in the caller's thread when the op is waited (DDP's bucket all-reduces run in
`finish_backward`, not under backward; on one core per rank there was no background to have).

Each op is a sequence of phases, "write my slot, barrier, read the others' slots":
- all-reduce up to `ONE_PHASE_MAX_BYTES` (the loss, norms, the vocabulary-parallel softmax's
  statistics: latency is all): every rank writes its tensor and combines all slots in rank order.
- larger all-reduces, per chunk of the tensor that fits a slot (its n parts: part r is rank r's to sum):
  1. every rank copies the other ranks' parts of its chunk into its slot; rank r adds part r of
     every other slot to its own part, in place, in rank order;
  2. every rank copies its summed part into its slot, and the other ranks' summed parts in.
  Each part is summed by one rank only, so all ranks end with the same bits; at n = 2 the sum
  a + b is gloo's too.
- reduce-scatter, per segment: every rank writes the segment of every other rank's chunk; rank r
  sums its own chunk's segment from all slots, in the all-reduce's order (same bits).
- all-gather, per segment: every rank writes its segment; everyone copies all of them.
Phases alternate between two windows, so one barrier per phase is enough: a rank writes a window
only after passing the barrier that follows the previous phase, which every rank reached only
after reading what it needed from the window written before that.

The window is mapped from a file in /dev/shm that group rank 0 creates (its pages reserved with
posix_fallocate, so a full /dev/shm is an error now, not a SIGBUS later) and unlinks once every
rank has mapped it, inside `open`: nothing is left behind, whatever way the job ends, unless a
rank is killed during `open` itself (a file meshlm-PID-*: delete it once process PID is gone).
Copies to and from the window run outside any dispatch mode: like gloo's own buffers, it is
library memory, not tensors a step allocates (train/memtrack.py), and the reduce-scatter needs
no scratch tensors, unlike the rings (analysis/memory.py: backend "shm").
"""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import socket
import time

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from meshlm.comm import shm_barrier
from meshlm.group_timeout import group_timeout

WINDOW_BYTES = 16 * 2**20  # per slot: a 25 MiB DDP bucket takes two chunks
MIN_WINDOW_BYTES = 2**20  # below this, /dev/shm is too small to be worth it: gloo's op
SHARED_MEMORY_MIN_BYTES = 2**20  # smaller all-reduces: gloo's op where the barrier is gloo's too
ONE_PHASE_MAX_BYTES = 64 * 2**10  # all-reduces up to this size: one phase (everyone reads every slot)
ALL_REDUCE_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)
SHM_DIR = "/dev/shm"


def host_id() -> int:
    """The same number on every process of one machine (boot) and, in practice, no other."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return _as_int(f"{socket.gethostname()}/{boot}")


def _as_int(text: str) -> int:
    """`text` as a number that fits an int64 tensor, equal on every rank that has the same text."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def slot_bytes_for(nbytes: int) -> int:
    """The slot an op of `nbytes` (its largest tensor) wants: the next power of two, 1-16 MiB."""
    return min(WINDOW_BYTES, max(MIN_WINDOW_BYTES, 1 << max(0, nbytes - 1).bit_length()))


def _shm_free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class BarrierClock:
    """Seconds spent in the windows' barriers: a rank that arrives first waits there for the last
    one (skew between ranks, not bytes moved, which the alpha-beta model of an op does not contain).
    One per `Comm`, shared by its windows, so an op queued on a window since reopened larger still
    counts."""

    def __init__(self) -> None:
        self.seconds = 0.0


class SharedWindow:
    """Two windows of n slots in memory shared by the ranks of one group. `open` is collective."""

    def __init__(self, buffer, group, n: int, me: int, slot_bytes: int, requested: int, futex: bool,
                 clock: BarrierClock, give_up_s: float | None = None):
        # The mmap itself; tensors over it exist only while an op runs, so nothing that scans a
        # process's tensors (the memory tracker, the tests' live-bytes count) takes library memory
        # for model state.
        self._buffer = buffer
        self.group, self.n, self.me, self.slot_bytes = group, n, me, slot_bytes
        self.requested = requested  # what `open` was asked for (slot_bytes may be less: /dev/shm's room)
        self.phase = 0
        self._header = shm_barrier.header_bytes(n)
        # The barrier between phases: counters in the window's header (comm/shm_barrier.py), or
        # gloo's where their ordering argument does not hold. Either gives up on a stuck peer at the
        # group's own timeout (`give_up_s`), as gloo's barrier does.
        self.barrier = shm_barrier.FutexBarrier(buffer, n, me, give_up_s) if futex else None
        self.clock = clock

    @classmethod
    def open(cls, group, ranks: list[int], me: int, slot_bytes: int = WINDOW_BYTES,
             clock: BarrierClock | None = None) -> "SharedWindow | None":
        """The group's window, or None (on every rank alike) where the ranks are not all on one
        host or /dev/shm has no room: the caller keeps gloo's op then."""
        n = len(ranks)
        facts = torch.tensor([host_id(), _shm_free_bytes(), _as_int(shm_barrier.pid_namespace()),
                              int(shm_barrier.usable())], dtype=torch.int64)
        every = [torch.empty_like(facts) for _ in range(n)]
        dist.all_gather(every, facts, group=group)
        if len({int(t[0]) for t in every}) != 1:
            return None
        futex = len({int(t[2]) for t in every}) == 1 and all(int(t[3]) for t in every)
        room = min(int(t[1]) for t in every) // (2 * n) // 2  # leave half of /dev/shm to others
        requested, slot_bytes = slot_bytes, min(slot_bytes, room) // 64 * 64
        if slot_bytes < MIN_WINDOW_BYTES:
            return None
        # Group rank 0 creates the file and says whether that worked, and under which name.
        size = shm_barrier.header_bytes(n) + 2 * n * slot_bytes
        status = torch.tensor([0, os.getpid(), random.getrandbits(62)], dtype=torch.int64)
        if me == 0:
            status[0] = int(_create(_path(status), size))
        dist.broadcast(status, src=ranks[0], group=group)
        if not int(status[0]):
            return None
        path = _path(status)
        mapped = None
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError:
            pass
        every_mapped = torch.tensor([int(mapped is not None)], dtype=torch.int64)
        dist.all_reduce(every_mapped, op=dist.ReduceOp.MIN, group=group)
        if me == 0:
            os.unlink(path)  # every rank has it mapped (or gave up): the name is no longer needed
        if not int(every_mapped):
            return None
        window = cls(mapped, group, n, me, slot_bytes, requested, futex, clock or BarrierClock(),
                     group_timeout(group).total_seconds())
        dist.barrier(group=group)  # every rank's pid is in the header before anyone waits on it
        return window

    def _barrier(self) -> None:
        t0 = time.perf_counter()
        if self.barrier is not None:
            self.barrier.wait()
        else:
            dist.barrier(group=self.group)
        self.clock.seconds += time.perf_counter() - t0

    def _slots(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The current phase's window as [n, numel] of `dtype`; the next phase gets the other."""
        window = torch.frombuffer(self._buffer, dtype=torch.uint8, offset=self._header,
                                  count=2 * self.n * self.slot_bytes).view(2, self.n, self.slot_bytes)[self.phase % 2]
        self.phase += 1
        return window[:, : numel * dtype.itemsize].view(dtype)

    @property
    def all_reduce_min_bytes(self) -> int:
        """Smaller all-reduces stay gloo's where the barrier is gloo's (its two phases would each pay
        a TCP round trip: slower than gloo's one); with the futex barrier every size comes here."""
        return 0 if self.barrier is not None else SHARED_MEMORY_MIN_BYTES

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """Reduce `tensor` (contiguous) over the group, in place: a sum, max or min."""
        flat = tensor.view(-1)
        combine = _combiner(op)
        if flat.numel() * flat.element_size() <= ONE_PHASE_MAX_BYTES:
            return self._all_reduce_one_phase(flat, combine)
        per_slot = self.slot_bytes // flat.element_size()
        with _disable_current_modes(), torch.no_grad():
            for c0 in range(0, flat.numel(), per_slot):
                chunk = flat[c0: c0 + per_slot]
                m = chunk.numel()
                parts = [slice(r * m // self.n, (r + 1) * m // self.n) for r in range(self.n)]
                others = [j for j in range(self.n) if j != self.me]
                mine = chunk[parts[self.me]]
                # Phase 1: the others' parts of my chunk out; my part summed in place.
                slots = self._slots(flat.dtype, m)
                for j in others:
                    slots[self.me, parts[j]].copy_(chunk[parts[j]])
                self._barrier()
                for j in others:
                    combine(mine, slots[j, parts[self.me]])
                # Phase 2: my summed part out; the others' summed parts in.
                summed = self._slots(flat.dtype, m)
                summed[self.me, : mine.numel()].copy_(mine)
                self._barrier()
                for j in others:
                    chunk[parts[j]].copy_(summed[j, : parts[j].stop - parts[j].start])

    def _all_reduce_one_phase(self, flat: torch.Tensor, combine) -> None:
        """Small tensors, where latency is all: everyone's whole tensor out, one barrier, every
        rank combines all slots in rank order (so every rank holds the same bits; at n > 2 the
        association differs from the two-phase sum's, the order of a large tensor's parts)."""
        with _disable_current_modes(), torch.no_grad():
            slots = self._slots(flat.dtype, flat.numel())
            slots[self.me].copy_(flat)
            self._barrier()
            flat.copy_(slots[0])
            for j in range(1, self.n):
                combine(flat, slots[j])

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """output = this rank's 1/n of the sum of every rank's `input` (both contiguous; output may
        be this rank's own chunk of input, ZeRO's in-place form). One phase per segment: the other
        ranks' chunks' segment out, then my chunk's segment summed from every slot, in rank order
        after my own (the order the two-phase `all_reduce` sums a part in, so the two agree bit for
        bit; a one-phase all-reduce, up to ONE_PHASE_MAX_BYTES, agrees only at n = 2)."""
        out = output.view(-1)
        chunks = input.view(self.n, -1)
        per_slot = self.slot_bytes // out.element_size() // self.n
        others = [j for j in range(self.n) if j != self.me]
        with _disable_current_modes(), torch.no_grad():
            for a in range(0, out.numel(), per_slot):
                b = min(a + per_slot, out.numel())
                slots = self._slots(out.dtype, self.n * (b - a)).view(self.n, self.n, -1)
                for j in others:
                    slots[self.me, j, : b - a].copy_(chunks[j, a:b])
                self._barrier()
                if out[a:b].data_ptr() != chunks[self.me, a:b].data_ptr():
                    out[a:b].copy_(chunks[self.me, a:b])
                for j in others:
                    out[a:b].add_(slots[j, self.me, : b - a])

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """output = every rank's `input`, concatenated in rank order (input may be this rank's own
        chunk of output). One phase per segment: my segment out, everyone's in."""
        src = input.view(-1)
        chunks = output.view(self.n, -1)
        per_slot = self.slot_bytes // src.element_size()
        with _disable_current_modes(), torch.no_grad():
            if chunks[self.me].data_ptr() != src.data_ptr():
                chunks[self.me].copy_(src)
            for a in range(0, src.numel(), per_slot):
                b = min(a + per_slot, src.numel())
                slots = self._slots(src.dtype, b - a)
                slots[self.me].copy_(src[a:b])
                self._barrier()
                for j in range(self.n):
                    if j != self.me:
                        chunks[j, a:b].copy_(slots[j])


class Deferred:
    """A window op run when waited (`Comm` hands it out as the async op's work): `method(*args)`."""

    def __init__(self, method, *args):
        self.method, self.args = method, args

    def wait(self) -> None:
        if self.args is not None:
            args, self.args = self.args, None
            self.method(*args)

    def is_completed(self) -> bool:
        return self.args is None


def _combiner(op):
    """acc <- op(acc, other), in place, for the all-reduce's ops."""
    if op == dist.ReduceOp.SUM:
        return torch.Tensor.add_
    if op == dist.ReduceOp.MAX:
        return lambda acc, other: torch.maximum(acc, other, out=acc)
    if op == dist.ReduceOp.MIN:
        return lambda acc, other: torch.minimum(acc, other, out=acc)
    raise ValueError(f"shared-memory all-reduce: no {op}")


def applies(op, *tensors: torch.Tensor, ops=(None, dist.ReduceOp.SUM)) -> bool:
    """Ops in `ops` (None: a gather) of contiguous, non-empty, real-number CPU tensors."""
    return op in ops and all(t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0 and not t.is_complex()
                             and t.dtype != torch.bool for t in tensors)


def on_one_host(world_size: int) -> bool:
    """Whether a launch of `world_size` ranks has them all here, on gloo with shared memory on:
    what the memory model assumes for the collectives' scratch (analysis/memory.py)."""
    return (int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) == world_size and _shm_free_bytes() > 0
            and os.environ.get("MESHLM_SHM_DISABLE", "0") in ("", "0"))


def _path(status: torch.Tensor) -> str:
    return f"{SHM_DIR}/meshlm-{int(status[1])}-{int(status[2]):x}"


def _create(path: str, size: int) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, size)
        return True
    except OSError:
        os.unlink(path)
        return False
    finally:
        os.close(fd)
