"""The shared-memory collectives (comm/shared_memory.py) against gloo's own: all-reduce,
reduce-scatter and all-gather equal at every world size (integer values, so every summation order
gives the same sum), bit-identical on every rank, across chunk and segment boundaries and uneven
parts, in place and out, between phases with the futex barrier and with gloo's; the window is
used only where it may be, and nothing is left in /dev/shm."""

import os

import pytest
import torch
import torch.distributed as dist

from meshlm.comm import Comm, shared_memory, shm_barrier
from meshlm.config import load_config
from meshlm.mesh import ParallelContext
from meshlm.testing import run_ranks

SLOT = shared_memory.MIN_WINDOW_BYTES  # 1 MiB slots: a few MiB take several chunks


def _integers(numel, seed, dtype=torch.float32):
    return torch.randint(-50, 50, (numel,), generator=torch.Generator().manual_seed(seed)).to(dtype)


def _window_rank(n, futex):
    r = dist.get_rank()
    group = dist.group.WORLD
    if not futex:  # as on a machine whose memory order the futex barrier cannot rely on
        shm_barrier.usable = lambda: False
    window = shared_memory.SharedWindow.open(group, list(range(n)), r, slot_bytes=SLOT)
    creator = torch.tensor([os.getpid()])
    dist.broadcast(creator, src=0)  # group rank 0 named the file after itself
    leftover = [f for f in os.listdir(shared_memory.SHM_DIR) if f.startswith(f"meshlm-{int(creator)}-")]
    out = {"opened": window is not None, "leftover": leftover, "futex": window.barrier is not None}
    # Sizes: under one slot; 3 chunks, the last ragged, parts uneven at n = 3; bf16 (half the bytes).
    for numel, dtype in ((1000, torch.float32), (SLOT // 4 * 2 + 12347, torch.float32),
                         (SLOT // 2 * 3 + 5, torch.bfloat16)):
        mine = _integers(numel, 100 * r + numel, dtype)
        expected = mine.clone()
        dist.all_reduce(expected)
        got = mine.clone()
        window.all_reduce(got)
        every = [torch.empty_like(got) for _ in range(n)]
        dist.all_gather(every, got)
        out[(numel, str(dtype))] = (torch.equal(got, expected), all(torch.equal(e, got) for e in every))
    # Reduce-scatter and all-gather, against the library ops: several segments per op, the last
    # ragged; out of place and in place (ZeRO's forms: my chunk of the input / of the output).
    for per_rank, dtype in ((999, torch.float32), (SLOT // 4 + 4321, torch.float32), (SLOT // 2 + 77, torch.bfloat16)):
        full = _integers(n * per_rank, 7 * r + per_rank, dtype)
        expected = torch.empty(per_rank, dtype=dtype)
        dist.reduce_scatter_single(expected, full.clone())
        got = torch.empty(per_rank, dtype=dtype)
        window.reduce_scatter(got, full)
        in_place = full.clone()
        window.reduce_scatter(in_place.view(n, -1)[r], in_place)
        gathered, lib = torch.empty(n * per_rank, dtype=dtype), torch.empty(n * per_rank, dtype=dtype)
        dist.all_gather_single(lib, got)
        window.all_gather(gathered, got)
        own = torch.zeros(n * per_rank, dtype=dtype)
        own.view(n, -1)[r].copy_(got)
        window.all_gather(own, own.view(n, -1)[r])
        out[("rs/ag", per_rank, str(dtype))] = (
            torch.equal(got, expected) and torch.equal(in_place.view(n, -1)[r], expected),
            torch.equal(gathered, lib) and torch.equal(own, lib))
    # Small all-reduces (one phase, up to ONE_PHASE_MAX_BYTES, and the two-phase path just past
    # it): sum, max and min, floats and integers, against gloo's.
    one_phase = shared_memory.ONE_PHASE_MAX_BYTES // 4
    for numel, dtype, op in ((1, torch.float32, dist.ReduceOp.SUM), (one_phase, torch.float32, dist.ReduceOp.SUM),
                             (one_phase + 1, torch.float32, dist.ReduceOp.MAX), (777, torch.int64, dist.ReduceOp.SUM),
                             (333, torch.float32, dist.ReduceOp.MAX), (333, torch.bfloat16, dist.ReduceOp.MIN),
                             (one_phase * 3, torch.int32, dist.ReduceOp.MIN)):
        mine = _integers(numel, 31 * r + numel, dtype)
        expected, got = mine.clone(), mine.clone()
        dist.all_reduce(expected, op=op)
        window.all_reduce(got, op)
        every = [torch.empty_like(got) for _ in range(n)]
        dist.all_gather(every, got)
        out[("small", numel, str(dtype), str(op))] = (torch.equal(got, expected), all(torch.equal(e, got) for e in every))
    # Real-valued fp32 at n = 2: a + b is a + b, whoever adds.
    x = torch.randn(SLOT // 4 * 2 + 7, generator=torch.Generator().manual_seed(r))
    expected, got = x.clone(), x.clone()
    dist.all_reduce(expected)
    window.all_reduce(got)
    out["real"] = torch.equal(got, expected) if n == 2 else (got - expected).abs().max().item() <= 1e-5
    return out


@pytest.mark.parametrize("n,futex", [(2, True), (3, True), (4, True), (3, False)],
                         ids=["n2", "n3", "n4", "n3-gloo-barrier"])
def test_window_collectives_equal_gloo_and_are_identical_on_every_rank(n, futex):
    futex = futex and shm_barrier.usable()
    for out in run_ranks(_window_rank, n, n, futex):
        assert out.pop("opened") and out.pop("leftover") == [] and out.pop("futex") == futex
        assert all(v is True or v == (True, True) for v in out.values()), out


def _comm_rank(host_differs, shm_free):
    if host_differs:  # as if each rank were on another machine
        shared_memory.host_id = lambda: dist.get_rank()
    if shm_free is not None:
        shared_memory._shm_free_bytes = lambda: shm_free
    comm = Comm(ParallelContext.from_config(load_config(None, [f"parallel.dp={dist.get_world_size()}"]).parallel))
    r, n = dist.get_rank(), dist.get_world_size()
    small, large = _integers(1000, r), _integers(shared_memory.SHARED_MEMORY_MIN_BYTES // 4 + 99, r + 7)
    expected = [t.clone() for t in (small, large)]
    for t in expected:
        dist.all_reduce(t)
    handles = [comm.all_reduce(t, "dp", async_op=True) for t in (small, large)]  # DDP's pattern
    between = torch.ones(3)
    comm.all_reduce(between, "dp")  # another op while the window's is not yet waited
    for h in handles:
        h.wait()
    rs_in = [_integers(n * 100 * (k + 1), 3 * r + k) for k in range(3)]
    rs_expected = [torch.empty(100 * (k + 1)) for k in range(3)]
    for e, x in zip(rs_expected, rs_in):
        dist.reduce_scatter_single(e, x.clone())
    rs_out = [torch.empty_like(e) for e in rs_expected]
    rs_handles = [comm.reduce_scatter(o, x, "dp", async_op=True) for o, x in zip(rs_out, rs_in)]  # 3 in flight
    gathered = torch.empty(n * 100)
    comm.all_gather(gathered, torch.full((100,), float(r)), "dp")
    for h in rs_handles:
        h.wait()
    first = comm._windows.get(tuple(range(n)))
    per = (3 << 20) // 4  # 3 MiB from each rank: more than the first window's slots
    big = torch.empty(n * per)
    comm.all_gather(big, torch.full((per,), float(r)), "dp")
    grown = comm._windows.get(tuple(range(n)))
    maximum = torch.full((shared_memory.SHARED_MEMORY_MIN_BYTES // 4,), float(r))
    comm.all_reduce(maximum, "dp", op=dist.ReduceOp.MAX)
    return {"used": comm.uses_shared_memory("dp"),
            "equal": torch.equal(small, expected[0]) and torch.equal(large, expected[1]),
            "between": torch.equal(between, torch.full((3,), float(dist.get_world_size()))),
            "max": bool((maximum == dist.get_world_size() - 1).all()),
            "rs/ag": all(torch.equal(o, e) for o, e in zip(rs_out, rs_expected))
            and torch.equal(gathered, torch.arange(n).float().repeat_interleave(100))
            and torch.equal(big, torch.arange(n).float().repeat_interleave(per)),
            # a larger op opened larger slots: 1 MiB for the small all-reduce, reopened at 2 for the
            # large one; 16 for the n x 3 MiB gather
            "slots": None if first is None else (first.requested, grown.requested)}


@pytest.mark.parametrize("host_differs,shm_free,used", [(False, None, True), (True, None, False),
                                                        (False, 3 * shared_memory.MIN_WINDOW_BYTES, False)])
def test_comm_takes_the_window_only_on_one_host_with_room_and_stays_exact(host_differs, shm_free, used):
    for out in run_ranks(_comm_rank, 3, host_differs, shm_free):
        slots = (2 << 20, 16 << 20) if used else None
        assert out == {"used": used, "equal": True, "between": True, "max": True, "rs/ag": True, "slots": slots}


def test_meshlm_shm_disable_keeps_gloo(monkeypatch):
    monkeypatch.setenv("MESHLM_SHM_DISABLE", "1")
    for out in run_ranks(_comm_rank, 2, False, None):
        assert out == {"used": False, "equal": True, "between": True, "max": True, "rs/ag": True, "slots": None}


def _late_rank(late, queued_on_a_replaced_window):
    import time

    comm = Comm(ParallelContext.from_config(load_config(None, [f"parallel.dp={dist.get_world_size()}"]).parallel))
    r, n = dist.get_rank(), dist.get_world_size()
    out = torch.empty(4 * 1024 * n)
    comm.all_gather(out, torch.full((4 * 1024,), float(r)), "dp")  # opens the window
    waited0 = comm.peer_wait_s()
    handle = comm.all_gather(out, torch.full((4 * 1024,), float(r)), "dp", async_op=True)  # runs when waited
    if queued_on_a_replaced_window:  # a larger op reopens the window before the queued one runs
        per = (3 << 20) // 4
        comm.all_gather(torch.empty(n * per), torch.full((per,), float(r)), "dp")
    if r == late:
        time.sleep(0.5)
    handle.wait()
    return comm.peer_wait_s() - waited0


@pytest.mark.parametrize("queued", [False, True], ids=["one-window", "window-replaced"])
def test_peer_wait_is_the_time_spent_waiting_for_the_last_rank(queued):
    """Comm.peer_wait_s: what the early ranks spend at the window's barriers while the late one is
    still busy (bench scaling reports it as the skew part of the exposed communication), also for
    an op that was queued on a window since reopened larger (DDP's async buckets)."""
    waits = run_ranks(_late_rank, 3, 1, queued)
    assert waits[0] >= 0.35 and waits[2] >= 0.35 and waits[1] < 0.2, waits


def _gloo_barrier_rank():
    shm_barrier.usable = lambda: False  # as on a machine the futex barrier does not run on
    comm = Comm(ParallelContext.from_config(load_config(None, [f"parallel.dp={dist.get_world_size()}"]).parallel))
    r = dist.get_rank()
    small = _integers(1000, r)
    expected = small.clone()
    dist.all_reduce(expected)
    comm.all_reduce(small, "dp")
    opened_by_small = dict(comm._windows)
    large = _integers(shared_memory.SHARED_MEMORY_MIN_BYTES // 4, r)
    expected_large = large.clone()
    dist.all_reduce(expected_large)
    comm.all_reduce(large, "dp")
    window = comm._windows.get(tuple(range(dist.get_world_size())))
    return (opened_by_small, torch.equal(small, expected), torch.equal(large, expected_large),
            window is not None and window.barrier is None)


def test_without_the_futex_barrier_small_all_reduces_stay_gloo_and_open_no_window():
    """Two phases of gloo barriers would be slower than gloo's own small all-reduce: from 1 MiB up
    the window (with gloo's barrier) takes them, below that nothing is opened for them."""
    for out in run_ranks(_gloo_barrier_rank, 3):
        assert out == ({}, True, True, True)


def test_the_futex_barrier_runs_wherever_its_conditions_hold():
    """Not only skipped-when-unusable: on x86-64 Linux with a readable pid namespace (this machine,
    CI's) the windows must get the futex barrier, or every shared-memory op silently pays gloo's."""
    import platform
    import sys

    expected = (sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64")
                and os.path.exists("/proc/self/ns/pid"))
    assert shm_barrier.usable() == expected
