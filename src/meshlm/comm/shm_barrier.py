"""A barrier for the ranks of one host, on counters in shared memory and the kernel's futex: what
the shared-memory collectives (comm/shared_memory.py) wait on between writing their slots and
reading the others'.
Reduces: a gloo barrier's ~0.3 ms (a TCP round trip through two of gloo's threads, each a wake-up
on the rank's core) to ~10 us, and its tail of 2-6 ms waits that both ranks take at once when a
wake-up lands behind a busy thread: on 2 ranks of `meshlm bench scaling`'s TP engine, 55 barriers
per step averaged 1.3 ms with gloo's, a quarter of the step.
Costs: a futex wake (one syscall, ~1 us) per barrier per rank; x86-64 Linux only (below); a rank
that arrives first sleeps in the kernel, as in gloo's barrier.

Each rank owns one counter, on a cache line of its own, and adds one to it at every barrier;
barrier k is passed when every counter has reached k. Counters only grow, so a rank that runs
ahead into barrier k+1 cannot release anyone from barrier k, and nothing is ever reset. A waiter
sleeps with FUTEX_WAIT on a late peer's counter, which the kernel checks still holds the value it
read before sleeping (so a peer that arrived in between is never missed); an arriving rank stores
its count, then FUTEX_WAKEs whoever sleeps on it. Spinning instead was measured and rejected: a
rank that polled for up to 1 ms slowed the other (this VM's two vCPUs), TP went 5,216 -> 4,314
tokens/s; the futex's kernel wake-up costs ~10 us more than a poll would.

Why the slots' bytes are visible once the counter is: x86-64 keeps stores in program order for
every other core (TSO) and an aligned 8-byte store is one instruction, so a reader that sees the
new count sees the slot bytes stored before it. Other architectures need a fence that Python
cannot issue, so there `usable()` is False and the windows keep gloo's barrier.

A peer that died never arrives: the waiter wakes once a second to check that the late peer's
process still runs (pids are in the header; the window asks all ranks to share a pid namespace)
and raises, as gloo's barrier would on the closed connection (`GONE` in the message); a peer
alive but absent for the process group's own timeout (`meshlm train`: `backend_timeout`, past the
watchdog's limits) raises TimeoutError (`STUCK`), as gloo's barrier would at that timeout: a hang,
not a lost peer (debug/guard.py tells the two apart by these words).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
import time

import torch.distributed as dist

LINE = 64  # bytes per counter: one cache line, so a rank's store never invalidates another's line
LIVENESS_EVERY_S = 1
# A peer alive but stuck (a deadlock elsewhere) raises after the group's timeout (the window passes
# it); this default serves a barrier made without one, gloo's default as gloo's barrier has.
# `meshlm train`'s watchdog (debug/watchdog.py) speaks before either, with dumps.
GIVE_UP_S = dist.default_pg_timeout.total_seconds()
GONE, STUCK = "is gone", "has not arrived"  # the two failures' words, matched by debug/guard.py
SYS_FUTEX = 202  # x86-64's syscall number (`usable()` admits no other architecture)
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # the shared (not _PRIVATE) forms: the word lives in a shared mapping
WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def header_bytes(n: int) -> int:
    """The bytes of the window's file the barrier of n ranks takes (counters, then pids): a page
    or more, so the slots after it stay page-aligned."""
    return max(4096, -(-2 * n * LINE // 4096) * 4096)


def usable() -> bool:
    """Whether the ordering argument (module docstring) holds, the futex is there, and peers' pids
    can be checked (/proc readable)."""
    return sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64") and pid_namespace() != ""


def pid_namespace() -> str:
    """Which pid namespace this process is in: peers' pids mean something only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


class FutexBarrier:
    """The barrier over `buffer`'s first `header_bytes(n)` bytes, for rank `me` of n. Construct it
    on every rank after the buffer is mapped, and pass a gloo barrier before any rank's first
    `wait` (so every pid is in place)."""

    def __init__(self, buffer, n: int, me: int, give_up_s: float | None = None) -> None:
        self.n, self.me = n, me
        self.give_up_s = give_up_s  # None: GIVE_UP_S, read when it is needed
        self._counters = [ctypes.c_int64.from_buffer(buffer, j * LINE) for j in range(n)]
        pids = ctypes.c_int64.from_buffer(buffer, n * LINE)
        self._pids = (ctypes.c_int64 * n).from_address(ctypes.addressof(pids))
        self._pids[me] = os.getpid()
        self._addresses = [ctypes.addressof(c) for c in self._counters]
        self.count = self._counters[me].value  # 0 in a new window
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._timeout = _Timespec(LIVENESS_EVERY_S, 0)

    def wait(self) -> None:
        self.count += 1
        target = self.count
        self._counters[self.me].value = target
        self._futex(self._addresses[self.me], FUTEX_WAKE, WAKE_ALL, None)
        start = next_check = None
        for j in range(self.n):
            if j == self.me:
                continue
            while (seen := self._counters[j].value) < target:
                if start is None:
                    start = time.monotonic()
                    next_check = start + LIVENESS_EVERY_S
                # Sleeps only while the word still holds `seen`'s low 32 bits (a futex word is 32),
                # for at most a second, then looks at the clock and, once a second, at the peer.
                rc = self._futex(self._addresses[j], FUTEX_WAIT, seen & 0xFFFFFFFF, ctypes.byref(self._timeout))
                if rc != 0 and (err := ctypes.get_errno()) not in (errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT):
                    raise OSError(err, f"shared-memory barrier: futex wait failed: {os.strerror(err)}")
                if (now := time.monotonic()) >= next_check:
                    next_check = now + LIVENESS_EVERY_S
                    self._check_alive(j, now - start)

    def _futex(self, address: int, op: int, value: int, timeout) -> int:
        # syscall(2) is variadic: every argument passed at its full register width.
        return self._syscall(ctypes.c_long(SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_long(op),
                             ctypes.c_long(value), timeout, None, ctypes.c_long(0))

    def _check_alive(self, j: int, waited: float) -> None:
        pid = self._pids[j]
        if not _running(pid):
            raise RuntimeError(f"shared-memory barrier: peer {j} of {self.n} (pid {pid}) {GONE}; "
                               f"this rank waited {waited:.0f} s for it")
        if waited > (GIVE_UP_S if self.give_up_s is None else self.give_up_s):  # alive but stuck: gloo's timeout
            raise TimeoutError(f"shared-memory barrier: peer {j} of {self.n} (pid {pid}) {STUCK} "
                               f"in {waited:.0f} s")


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a forked rank that died, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
