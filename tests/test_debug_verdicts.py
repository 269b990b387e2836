"""Verdicts that must not depend on timing or on the setup: dumps that arrive late or never (a rank
stopped by torchrun mid-dump, another node's run.dir), stuck peers against dead ones, lock-order
cycles, and run directories holding files the analysis did not write. The analyzer's basic cases
are in test_debug.py."""

import json
import threading
import time

import pytest

from helpers import small_cfg
from meshlm.debug.analyze import analyze
from meshlm.debug.fingerprint import DesyncError
from meshlm.debug.nonfinite import NonFiniteError


def rec(seq, op="all_reduce", axis="dp", numel=1, dtype="float32", done=True, peer=None, t=0.0):
    return {"seq": seq, "op": op, "axis": axis, "numel": numel, "dtype": dtype, "peer": peer,
            "t_start": t, "t_end": t + 0.1 if done else None}


def write(run_dir, rank, world, records, groups, reason="timeout", step=3, **extra):
    (run_dir / "debug").mkdir(parents=True, exist_ok=True)
    dump = {"rank": rank, "world_size": world, "reason": reason, "time": 100.0 + rank, "step": step,
            "phase": "end of step", "groups": groups, "records": records, "stacks": {}, "idle_s": 5.0, **extra}
    (run_dir / "debug" / f"rank{rank}.json").write_text(json.dumps(dump))


# ---------------------------------------------------------------- 1. desync: late or missing dumps

def _desync_dumps(run_dir, ranks):
    """3 ranks, rank 2 sent #1 as int64: what each rank's desync dump holds (the fingerprint's culprit)."""
    for r in ranks:
        write(run_dir, r, 3, [rec(0), rec(1, dtype="int64" if r == 2 else "float64")], {"dp": [0, 1, 2]},
              reason="desync", culprits=[2], report=["desync at step 3: rank 2 called different collectives"])


@pytest.mark.parametrize("present", [(0, 1, 2), (1, 2), (0, 2), (0, 1), (2,)])
def test_a_desync_verdict_names_the_fingerprints_culprit_whichever_dumps_arrived(tmp_path, present):
    """Rank 0 stopped by torchrun before its dump: ranks 1 and 2 alone are a tie of two calls, and a
    vote over them blamed the innocent rank 1. Every desync dump holds the all-gathered culprits."""
    _desync_dumps(tmp_path, present)
    (tmp_path / "debug" / "rank0.json.tmp").write_text('{"rank": 0, "wor')  # cut off by SIGTERM
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"]) == ("desync", [2]), v["line"]
    if 2 in present and len(present) > 1:  # the odd rank's records beside another's: the collective is named
        assert (v["group"], v["seq"], v["op"]) == ("dp", 1, "all_reduce") and "rank 2 called" in v["line"]


@pytest.mark.parametrize("error", [DesyncError("desync at step 2: rank 1 called different collectives", [1]),
                                   NonFiniteError("non-finite gradient norm (nan) at step 2: rank 1", [1])],
                         ids=["desync", "nonfinite"])
def test_a_rank_that_raises_a_desync_waits_for_its_peers_dumps(corpus, tmp_path, error):
    """Every rank raises these at the same step end; one that exited at once had torchrun stop the others
    mid-dump. Rank 1's dump lands 1 s after rank 0's: rank 0 is still there to see it."""
    from meshlm.debug.guard import RankFailed, RankGuard

    cfg = small_cfg(corpus, tmp_path, 2, "parallel.dp=2")
    late = threading.Timer(1.0, write, (tmp_path, 1, 2, [], {}), {"reason": "desync", "culprits": [1]})
    t0 = time.monotonic()
    with pytest.raises(RankFailed):
        with RankGuard(cfg, 0, 2):
            late.start()
            raise error
    waited = time.monotonic() - t0
    late.join()
    assert 0.9 < waited < 4.0, waited  # waited for the peer's dump, and no longer
    assert analyze(tmp_path)["ranks"] == [1]
