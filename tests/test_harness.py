import time

import pytest
import torch
import torch.distributed as dist

from meshlm.testing import RankFailure, RankTimeout, run_ranks


def _allreduce_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def test_ranks_run_collectives_and_return_in_rank_order():
    out = run_ranks(_allreduce_rank, 4)
    assert out == [(r, 10.0) for r in range(4)]


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on one")
    dist.barrier()  # rank 0 blocks here forever: the harness must not wait for it


def test_a_failing_rank_fails_fast_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="boom on one"):
        run_ranks(_raise_on_rank_one, 2, timeout=60)
    assert time.monotonic() - t0 < 30


def _hang():
    if dist.get_rank() == 0:
        dist.barrier()
    time.sleep(60)


def test_a_hang_fails_at_the_timeout_and_children_are_reaped():
    import multiprocessing as mp

    with pytest.raises(RankTimeout, match="still running"):
        run_ranks(_hang, 2, timeout=3)
    assert mp.active_children() == []
