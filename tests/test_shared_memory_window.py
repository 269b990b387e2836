"""The shared-memory window's own rules, beside test_shared_memory.py's values: real-valued sums
bit-identical on every rank at any world size (each part summed by one rank), which all-reduces
take one phase, how large a slot an op asks for and how much of /dev/shm a window may take, the
host key, and which tensors and launches the window applies to."""

import torch
import torch.distributed as dist

import pytest

from meshlm.comm import shared_memory
from meshlm.testing import run_ranks

MIB = 2**20


def _real_sums_and_phases(n):
    r = dist.get_rank()
    window = shared_memory.SharedWindow.open(dist.group.WORLD, list(range(n)), r,
                                             slot_bytes=shared_memory.MIN_WINDOW_BYTES)
    out = {}
    # Real values, several chunks, parts uneven at n = 3: the same bits on every rank.
    for numel in (shared_memory.ONE_PHASE_MAX_BYTES // 4 + 1, shared_memory.MIN_WINDOW_BYTES // 4 * 2 + 7):
        got = torch.randn(numel, generator=torch.Generator().manual_seed(r))
        expected = got.clone()
        dist.all_reduce(expected)
        window.all_reduce(got)
        every = [torch.empty_like(got) for _ in range(n)]
        dist.all_gather(every, got)
        out[numel] = (all(torch.equal(e, got) for e in every), (got - expected).abs().max().item())
    # Up to 64 KiB (ONE_PHASE_MAX_BYTES: the loss, norms, softmax statistics) one phase (one barrier), above
    # it two per slot-sized chunk.
    phases = []
    for numel in (1, 64 * 1024 // 4, 64 * 1024 // 4 + 1):
        before = window.phase
        window.all_reduce(torch.ones(numel))
        phases.append(window.phase - before)
    out["phases"] = phases
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_real_sums_are_the_same_bits_on_every_rank_and_small_ones_take_one_phase(n):
    for out in run_ranks(_real_sums_and_phases, n, n):
        assert out.pop("phases") == [1, 1, 2]
        for identical, error in out.values():
            assert identical and error <= 1e-5


def _window_with_free_bytes(free):
    shared_memory._shm_free_bytes = lambda: free
    window = shared_memory.SharedWindow.open(dist.group.WORLD, [0, 1], dist.get_rank(), slot_bytes=16 * MIB)
    return None if window is None else (window.slot_bytes, type(window.slot_bytes), window.requested)


@pytest.mark.parametrize("free,slot", [
    (64 * MIB, 8 * MIB),  # half of /dev/shm over 2 windows x 2 slots
    (8 * MIB + 1000, MIB + 64),  # rounded down to 64 bytes
    (8 * MIB - 8, None),  # under 1 MiB a slot: gloo's op instead
    (1 << 40, 16 * MIB),  # never more than was asked for
])
def test_a_window_takes_at_most_half_of_dev_shm(free, slot):
    for got in run_ranks(_window_with_free_bytes, 2, free):
        assert got == (None if slot is None else (slot, int, 16 * MIB))


def test_an_op_asks_for_the_next_power_of_two_between_1_and_16_mib():
    sizes = {1: MIB, MIB: MIB, MIB + 1: 2 * MIB, 2 * MIB: 2 * MIB, 3 * MIB: 4 * MIB, 16 * MIB: 16 * MIB,
             16 * MIB + 1: 16 * MIB, 1 << 40: 16 * MIB}
    assert {nbytes: shared_memory.slot_bytes_for(nbytes) for nbytes in sizes} == sizes


def test_the_host_key_fits_an_int64_and_tells_hosts_apart():
    keys = [shared_memory._as_int(f"host{i}/boot") for i in range(2000)]
    assert all(0 <= k < 2**63 for k in keys) and len(set(keys)) == len(keys)
    assert shared_memory._as_int("a/b") == shared_memory._as_int("a/b")


def test_the_window_applies_to_contiguous_non_empty_real_cpu_tensors_and_its_ops():
    x = torch.ones(4, 4)
    assert shared_memory.applies(dist.ReduceOp.SUM, x) and shared_memory.applies(None, x, x[0])
    assert not shared_memory.applies(dist.ReduceOp.MAX, x)  # only what `ops` names
    assert shared_memory.applies(dist.ReduceOp.MAX, x, ops=shared_memory.ALL_REDUCE_OPS)
    for bad in (x.t(), torch.ones(0), torch.ones(3, dtype=torch.complex64), torch.ones(3, dtype=torch.bool),
                torch.ones(3, device="meta")):
        assert not shared_memory.applies(dist.ReduceOp.SUM, bad), bad
        assert not shared_memory.applies(dist.ReduceOp.SUM, x, bad), bad


def test_one_host_means_every_rank_local_shared_memory_there_and_not_disabled(monkeypatch, tmp_path):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("MESHLM_SHM_DISABLE", raising=False)
    assert shared_memory.on_one_host(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not shared_memory.on_one_host(4) and shared_memory.on_one_host(2)
    monkeypatch.setenv("MESHLM_SHM_DISABLE", "1")
    assert not shared_memory.on_one_host(2)
    monkeypatch.setenv("MESHLM_SHM_DISABLE", "0")
    monkeypatch.setattr(shared_memory, "SHM_DIR", str(tmp_path / "absent"))
    assert shared_memory._shm_free_bytes() == 0 and not shared_memory.on_one_host(2)
