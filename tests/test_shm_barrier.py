"""The futex barrier of the shared-memory collectives (comm/shm_barrier.py): nobody passes
barrier k before everyone has arrived at it, over many rounds with shuffled arrivals and more than
two parties; a peer that died makes the waiter raise instead of hanging. (Its use by the
collectives is tested with them, in test_shared_memory.py.)"""

import mmap
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
    raised = []

    def wait():
        try:
            mine.wait()
        except RuntimeError as e:
            raised.append(str(e))

    waiter = threading.Thread(target=wait, daemon=True)  # a barrier that never returns fails, not hangs
    waiter.start()
    waiter.join(timeout=3 * shm_barrier.LIVENESS_EVERY_S)
    assert not waiter.is_alive(), "the barrier kept waiting for a dead peer"
    assert len(raised) == 1 and re.fullmatch(r"shared-memory barrier: peer 1 of 2 \(pid \d+\) is gone; .*", raised[0])
    gone.wait()
