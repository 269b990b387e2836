"""All-reduce through shared memory for the ranks of a group that share one host (what `Comm`
runs on gloo there, from `SHARED_MEMORY_MIN_BYTES` up).

Reduces: the cost of gloo's all-reduce, which moves every byte through loopback TCP (a send and a
receive copy through the kernel per step of its algorithm): 16 MiB on 2 ranks, 12.4 ms with gloo,
6.0 ms here. NCCL does the same inside a node (its SHM and P2P transports).
Costs: a window of 2 x n x `WINDOW_BYTES` of /dev/shm per group (smaller where /dev/shm is small;
none, and gloo's op, where the ranks are on different hosts or /dev/shm has no room), one gloo
barrier (~0.2 ms) per phase, and no background progress: the work runs in the caller's thread
when the op is waited (DDP's bucket all-reduces run in `finish_backward`, not under backward).

Per chunk of the tensor that fits a slot (its n parts: part r is rank r's to sum), two phases,
each "write my slot, barrier, read":
  1. every rank copies the other ranks' parts of its chunk into its slot; rank r adds part r of
     every other slot to its own part, in place, in rank order;
  2. every rank copies its summed part into its slot of the other window, and the other ranks'
     summed parts from theirs. Each part is summed by one rank only, so all ranks end with the
     same bits; at n = 2 the sum a + b is gloo's too.
Phases alternate between two windows, so one barrier per phase is enough: a rank writes a window
only after passing the barrier that follows the previous phase, which every rank reached only
after reading what it needed from the window written before that.

The window is mapped from a file in /dev/shm that group rank 0 creates (its pages reserved with
posix_fallocate, so a full /dev/shm is an error now, not a SIGBUS later) and unlinks once every
rank has mapped it: nothing is left behind, whatever way the job ends. Copies to and from the
window run outside any dispatch mode: like gloo's own buffers, it is library memory, not tensors
a step allocates (train/memtrack.py).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import socket

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

WINDOW_BYTES = 16 * 2**20  # per slot: a 25 MiB DDP bucket takes two chunks
MIN_WINDOW_BYTES = 2**20  # below this, /dev/shm is too small to be worth it: gloo's op
SHARED_MEMORY_MIN_BYTES = 2**20  # smaller all-reduces: gloo's op (one round trip, not two barriers)
SHM_DIR = "/dev/shm"


def host_id() -> int:
    """The same number on every process of one machine (boot) and, in practice, no other."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return int.from_bytes(hashlib.sha256(f"{socket.gethostname()}/{boot}".encode()).digest()[:7], "little")


def _shm_free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class SharedWindow:
    """Two windows of n slots in memory shared by the ranks of one group. `open` is collective."""

    def __init__(self, buffer, group, n: int, me: int, slot_bytes: int):
        self._buffer = buffer  # the mmap: kept alive as long as the tensor views below
        self.group, self.n, self.me, self.slot_bytes = group, n, me, slot_bytes
        with _disable_current_modes():  # library memory, not a tensor of the step (module docstring)
            self.windows = torch.frombuffer(buffer, dtype=torch.uint8).view(2, n, slot_bytes)
        self.phase = 0

    @classmethod
    def open(cls, group, ranks: list[int], me: int, slot_bytes: int = WINDOW_BYTES) -> "SharedWindow | None":
        """The group's window, or None (on every rank alike) where the ranks are not all on one
        host or /dev/shm has no room: the caller keeps gloo's op then."""
        n = len(ranks)
        facts = torch.tensor([host_id(), _shm_free_bytes()], dtype=torch.int64)
        every = [torch.empty_like(facts) for _ in range(n)]
        dist.all_gather(every, facts, group=group)
        if len({int(t[0]) for t in every}) != 1:
            return None
        room = min(int(t[1]) for t in every) // (2 * n) // 2  # leave half of /dev/shm to others
        slot_bytes = min(slot_bytes, room) // 64 * 64
        if slot_bytes < MIN_WINDOW_BYTES:
            return None
        # Group rank 0 creates the file and says whether that worked, and under which name.
        size = 2 * n * slot_bytes
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
        return cls(mapped, group, n, me, slot_bytes)

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def _slots(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The current phase's window as [n, numel] of `dtype`; the next phase gets the other."""
        window = self.windows[self.phase % 2]
        self.phase += 1
        return window[:, : numel * torch.empty((), dtype=dtype).element_size()].view(dtype)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` (contiguous) over the group, in place."""
        flat = tensor.view(-1)
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
                    mine.add_(slots[j, parts[self.me]])
                # Phase 2: my summed part out; the others' summed parts in.
                summed = self._slots(flat.dtype, m)
                summed[self.me, : mine.numel()].copy_(mine)
                self._barrier()
                for j in others:
                    chunk[parts[j]].copy_(summed[j, : parts[j].stop - parts[j].start])


class DeferredAllReduce:
    """An all-reduce through the window, run when waited (`Comm` hands it out as async work)."""

    def __init__(self, window: SharedWindow, tensor: torch.Tensor):
        self.window, self.tensor = window, tensor

    def wait(self) -> None:
        if self.tensor is not None:
            tensor, self.tensor = self.tensor, None
            self.window.all_reduce(tensor)

    def is_completed(self) -> bool:
        return self.tensor is None


def applies(tensor: torch.Tensor, op) -> bool:
    """Sums of contiguous floating-point CPU tensors from `SHARED_MEMORY_MIN_BYTES` up."""
    return (op == dist.ReduceOp.SUM and tensor.device.type == "cpu" and tensor.is_floating_point()
            and tensor.is_contiguous() and tensor.numel() * tensor.element_size() >= SHARED_MEMORY_MIN_BYTES)


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
