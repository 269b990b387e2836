"""The futex barrier of the shared-memory collectives (comm/shm_barrier.py): nobody passes
barrier k before everyone has arrived at it, over many rounds with shuffled arrivals and more than
two parties; a peer that died makes the waiter raise instead of hanging. (Its use by the
collectives is tested with them, in test_shared_memory.py.)"""

import ctypes
import errno
import mmap
import os
import random
import re
import subprocess
import sys
import threading
import time

import pytest

from meshlm.comm import shm_barrier

pytestmark = pytest.mark.skipif(not shm_barrier.usable(), reason="the futex barrier is x86-64 Linux only")


def _barriers(n):
    buffer = mmap.mmap(-1, shm_barrier.header_bytes(n))
    return buffer, [shm_barrier.FutexBarrier(buffer, n, me) for me in range(n)]


def _raised_within(barrier, seconds):
    """`barrier.wait()` in a thread: (what it raised, seconds until then). A wait that never
    returns fails the test instead of hanging it."""
    raised, t0 = [], time.perf_counter()

    def wait():
        try:
            barrier.wait()
        except Exception as e:  # noqa: BLE001 - the caller checks which
            raised.append((e, time.perf_counter() - t0))

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout=seconds)
    assert not waiter.is_alive(), f"the barrier was still waiting after {seconds} s"
    assert len(raised) == 1, "the barrier returned instead of raising"
    return raised[0]


@pytest.mark.parametrize("n", [2, 3, 5])
def test_nobody_passes_a_barrier_before_everyone_arrived(n):
    _, barriers = _barriers(n)
    rounds = 300
    arrived = [0] * n  # the last barrier each party reached
    early = []  # (party, round, the others' rounds) whenever one passed too soon

    def party(me):
        rng = random.Random(me)
        for k in range(1, rounds + 1):
            if rng.random() < 0.1:
                time.sleep(rng.random() * 1e-3)  # arrive late now and then, each party its own rounds
            arrived[me] = k
            barriers[me].wait()
            if min(arrived) < k:
                early.append((me, k, list(arrived)))

    threads = [threading.Thread(target=party, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a party never got through"
    assert early == [] and arrived == [rounds] * n


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_dead_peer_makes_the_waiter_raise_instead_of_hang(reaped):
    _, (mine, _peer) = _barriers(2)
    # The peer's slot names a process that has exited: reaped, or (a forked rank whose parent has
    # not waited for it yet) a zombie, whose /proc entry is still there.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    if reaped:
        gone.wait()
    else:
        while open(f"/proc/{gone.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
    mine._pids[1] = gone.pid
    error, _ = _raised_within(mine, 3 * shm_barrier.LIVENESS_EVERY_S)
    assert isinstance(error, RuntimeError)
    assert re.fullmatch(r"shared-memory barrier: peer 1 of 2 \(pid \d+\) is gone; .*", str(error))
    gone.wait()


def _counting_timeouts(barrier):
    """Wrap a barrier's futex call to count the waits that ran out their second: with peers never
    more than a few ms late, each one is a wake-up that was lost."""
    counted = {"timeouts": 0}
    real = barrier._futex

    def futex(address, op, value, timeout):
        rc = real(address, op, value, timeout)
        if rc != 0 and ctypes.get_errno() == errno.ETIMEDOUT:
            counted["timeouts"] += 1
        return rc

    barrier._futex = futex
    return counted


def test_two_processes_pass_every_barrier_together_and_no_wake_up_is_lost():
    """As the collectives use it: two processes over a shared mapping (so the futex must be the
    shared kind, not the private one threads could get away with)."""
    header, rounds = shm_barrier.header_bytes(2), 300
    buffer = mmap.mmap(-1, header + 64)  # anonymous and MAP_SHARED: the child sees the same pages
    arrived = (ctypes.c_int64 * 2).from_buffer(buffer, header)

    def party(me):
        barrier = shm_barrier.FutexBarrier(buffer, 2, me)
        counted, early, rng = _counting_timeouts(barrier), 0, random.Random(me)
        for k in range(1, rounds + 1):
            if rng.random() < 0.2:
                time.sleep(rng.random() * 2e-3)
            arrived[me] = k
            barrier.wait()
            early += arrived[1 - me] < k
        return early, counted["timeouts"]

    child = os.fork()
    if child == 0:
        try:
            early, timeouts = party(1)
            os._exit(0 if (early, timeouts) == (0, 0) else 1)
        finally:
            os._exit(2)
    mine = party(0)
    _, status = os.waitpid(child, 0)
    del arrived
    assert mine == (0, 0) and os.waitstatus_to_exitcode(status) == 0


def test_a_peer_alive_but_absent_past_the_limit_raises(monkeypatch):
    monkeypatch.setattr(shm_barrier, "GIVE_UP_S", 1.5)
    _, (mine, _peer) = _barriers(2)
    mine._pids[1] = os.getpid()  # alive (it is us), and never arrives
    error, seconds = _raised_within(mine, 5)
    assert isinstance(error, TimeoutError)
    assert re.fullmatch(r"shared-memory barrier: peer 1 of 2 \(pid \d+\) has not arrived in \d+ s", str(error))
    assert 1.5 <= seconds < 4


def test_a_waiting_rank_sleeps_in_the_kernel_instead_of_spinning():
    """The waiter's thread uses almost no CPU while its peer is late (the futex sleeps only while
    the counter holds the value it read: pass the wrong one and it returns at once, a busy loop)."""
    _, (mine, peer) = _barriers(2)
    for _ in range(3):  # a few rounds first: counters past 0, where a mangled value would show
        t = threading.Thread(target=peer.wait)
        t.start()
        mine.wait()
        t.join()
    cpu = []

    def waiter():
        t0 = time.thread_time()
        mine.wait()
        cpu.append(time.thread_time() - t0)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.5)
    peer.wait()
    t.join(timeout=10)
    assert cpu and cpu[0] < 0.1, cpu  # of 0.5 s waited


@pytest.mark.parametrize("n,expected", [(1, 4096), (2, 4096), (32, 4096), (33, 8192), (100, 16384)])
def test_the_header_holds_every_counter_and_pid_and_keeps_the_slots_page_aligned(n, expected):
    size = shm_barrier.header_bytes(n)
    assert size == expected and size % 4096 == 0 and size >= n * shm_barrier.LINE + 8 * n


def test_no_futex_barrier_where_peers_pids_cannot_be_read(monkeypatch):
    def unreadable(path):
        raise PermissionError(path)

    monkeypatch.setattr(shm_barrier.os, "readlink", unreadable)
    assert shm_barrier.pid_namespace() == "" and not shm_barrier.usable()


def test_an_unexpected_futex_error_raises_instead_of_looping():
    """EAGAIN (the counter moved), EINTR (a signal) and ETIMEDOUT (the liveness tick) are the
    waits' normal returns; any other error (seccomp's EPERM, ENOSYS) would otherwise turn the wait
    into a silent busy loop."""
    _, (mine, _peer) = _barriers(2)
    real = mine._futex

    def refused(address, op, value, timeout):
        if op == shm_barrier.FUTEX_WAIT:
            ctypes.set_errno(errno.EPERM)
            return -1
        return real(address, op, value, timeout)

    mine._futex = refused
    error, _ = _raised_within(mine, 5)
    assert isinstance(error, OSError) and "futex wait failed" in str(error)
