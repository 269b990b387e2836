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


# ---------------------------------------------------------------- 2. a stuck peer is a hang, not a lost one

def _stuck_peer(late_s):
    """Rank 1 stays away (alive) from the second all-reduce past the process group's timeout."""
    import torch
    import torch.distributed as dist

    from meshlm.comm import Comm
    from meshlm.group_timeout import group_timeout
    from meshlm.mesh import Layout, ParallelContext

    comm = Comm(ParallelContext(Layout(dp=2)))
    comm.all_reduce(torch.ones(4), "dp")  # opens the window: its barrier is the futex one here
    if dist.get_rank() == 1:
        time.sleep(late_s)
        return None
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4), "dp")
    except TimeoutError as e:
        from meshlm.debug.guard import failure_kind

        return str(e), time.monotonic() - t0, failure_kind(e), group_timeout().total_seconds()
    return "returned", time.monotonic() - t0, None, None


def test_the_shared_memory_barrier_gives_up_at_the_groups_timeout_and_that_is_a_timeout():
    """The barrier gave up after gloo's default 30 min whatever the configured timeout, and its
    "has not arrived" matched the lost-peer marker: a stuck peer was reported as a crash."""
    from datetime import timedelta

    from meshlm.comm import shm_barrier
    from meshlm.testing import run_ranks

    if not shm_barrier.usable():
        pytest.skip("the futex barrier is x86-64 Linux only")
    message, seconds, kind, configured = run_ranks(_stuck_peer, 2, 5.0, pg_timeout=timedelta(seconds=2), timeout=60)[0]
    assert configured == 2 and "has not arrived" in message and 2 <= seconds < 4.5, (message, seconds)
    assert kind == "timeout"


def test_a_gone_peer_is_lost_and_only_the_barriers_own_words_decide():
    from meshlm.debug.guard import failure_kind

    gone = RuntimeError("shared-memory barrier: peer 1 of 2 (pid 7) is gone; this rank waited 3 s for it")
    stuck = TimeoutError("shared-memory barrier: peer 1 of 2 (pid 7) has not arrived in 1860 s")
    assert (failure_kind(gone), failure_kind(stuck)) == ("peer_lost", "timeout")
    assert failure_kind(TimeoutError("read timed out (the corpus download)")) == "error"


def _groups_timeouts():
    from meshlm.group_timeout import group_timeout
    from meshlm.mesh import Layout, ParallelContext

    ctx = ParallelContext(Layout(tp=2, dp=2))
    return [group_timeout(ctx.group(axis)).total_seconds() for axis in ("tp", "dp", "world")]


def test_every_group_keeps_the_configured_timeout():
    """new_group takes gloo's 30 min unless told: the world's timeout (backend_timeout) must reach
    the tp and dp groups too, and the shared-memory windows on them."""
    from datetime import timedelta

    from meshlm.testing import run_ranks

    for timeouts in run_ranks(_groups_timeouts, 4, pg_timeout=timedelta(seconds=123)):
        assert timeouts == [123, 123, 123]


def test_a_barrier_timeout_is_dumped_as_a_timeout_and_analysed_as_a_hang(corpus, tmp_path):
    """Rank 0's guard dumps "timeout" (not "peer_lost"); with its pending all-reduce #5 and rank 1's
    watchdog dump (stuck elsewhere), the verdict names rank 1 and the collective, not a crash."""
    from meshlm.debug.guard import RankFailed, RankGuard

    write(tmp_path, 1, 2, [rec(4)], {"dp": [0, 1]}, reason="timeout")
    with pytest.raises(RankFailed), RankGuard(small_cfg(corpus, tmp_path, 2, "parallel.dp=2"), 0, 2):
        raise TimeoutError("shared-memory barrier: peer 1 of 2 (pid 7) has not arrived in 1860 s")
    assert json.loads((tmp_path / "debug" / "rank0.json").read_text())["reason"] == "timeout"
    write(tmp_path, 0, 2, [rec(4), rec(5, done=False, t=1.0)], {"dp": [0, 1]}, reason="timeout")
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"], v["seq"]) == ("hang", [1], 5), v["line"]


# ---------------------------------------------------------------- 3. lock-order cycles

TP2_DP2 = {0: {"tp": [0, 1], "dp": [0, 2]}, 1: {"tp": [0, 1], "dp": [1, 3]}, 2: {"tp": [2, 3], "dp": [0, 2]},
           3: {"tp": [2, 3], "dp": [1, 3]}}


def test_collectives_called_in_different_orders_are_a_deadlock_not_one_ranks_hang(tmp_path):
    """Ranks 0 and 3 call dp then tp, ranks 1 and 2 tp then dp: each waits in its first, which the
    rank it needs has not reached. The wait chain used to stop once it had seen every rank and
    blame the last one (rank 2), though it waits too."""
    for r, first in ((0, "dp"), (1, "tp"), (2, "tp"), (3, "dp")):
        write(tmp_path, r, 4, [rec(0, axis="tp"), rec(0, axis="dp"), rec(1, axis=first, done=False, t=1.0 + r)],
              TP2_DP2[r])
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"], v["seq"], v["op"]) == ("deadlock", [0, 1, 2, 3], 1, "all_reduce"), v["line"]
    assert (v["group"], v["group_ranks"], v["step"]) == ("dp", [0, 2], 4)  # rank 0's wait, in step 3 + 1
    for rank, axis, nxt in ((0, "dp [0, 2]", 2), (2, "tp [2, 3]", 3), (3, "dp [1, 3]", 1), (1, "tp [0, 1]", 0)):
        assert f"rank {rank} waits in all_reduce #1 on {axis} for rank {nxt}" in v["line"]
    assert v["line"].startswith("deadlock: ranks 0, 1, 2, 3 wait on each other")


def test_a_cycle_of_two_receives_names_the_cycle_only(tmp_path):
    """Ranks 0 and 1 each receive from the other first (neither sends); rank 2 waits in a dp
    all-reduce for rank 1: a consequence, not part of the deadlock."""
    write(tmp_path, 0, 3, [rec(0, op="recv", axis="pp", peer=1, done=False)], {})
    write(tmp_path, 1, 3, [rec(0, op="recv", axis="pp", peer=0, done=False)], {"dp": [1, 2]})
    write(tmp_path, 2, 3, [rec(0, axis="dp", done=False)], {"dp": [1, 2]})
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"], v["group"]) == ("deadlock", [0, 1], "p2p"), v["line"]


# ---------------------------------------------------------------- 4. nodes with a run.dir each

def test_ranks_of_another_node_are_not_reported_dead(tmp_path):
    """Two nodes, a run.dir each (docs: Multi-node runs): rank 1 failed on the other node, so this
    run.dir holds rank 0's lost-peer dump alone. Not "rank 1 died without a report"."""
    write(tmp_path, 0, 2, [rec(0), rec(1, done=False)], {"dp": [0, 1]}, reason="peer_lost", dir_ranks=[0])
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"], v["elsewhere"]) == ("elsewhere", [1], [1]), v["line"]
    assert "died" not in v["line"] and "rank 1 left no dump here: it ran on another node: see its run.dir" in v["line"]


def test_this_nodes_ranks_timed_out_waiting_on_no_rank_here_are_named(tmp_path):
    """A watchdog timeout on both ranks of this node, in no collective of theirs (startup, say):
    the verdict names them and what they did, not an empty "rank  ... lost its peer"."""
    for r in (0, 1):
        write(tmp_path, r, 4, [], {"dp": [0, 1, 2, 3]}, reason="timeout", dir_ranks=[0, 1])
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"]) == ("elsewhere", [2, 3]), v["line"]
    assert v["line"].startswith("elsewhere: ranks 0, 1 of this node stopped (timeout)"), v["line"]


def test_a_failure_on_this_node_names_the_other_nodes_ranks_as_elsewhere(tmp_path):
    for r in (0, 1):
        write(tmp_path, r, 8, [rec(0)], {"dp": list(range(8))}, reason="error" if r == 1 else "peer_lost",
              dir_ranks=[0, 1], culprits=[1], report=["rank 1 failed at step 3 (forward): RuntimeError: boom"])
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"]) == ("error", [1]) and "ranks 2-7 left no dump here" in v["line"], v["line"]
    write(tmp_path, 0, 8, [rec(0)], {"dp": list(range(8))}, reason="peer_lost")  # one run.dir for all (no note)
    (tmp_path / "debug" / "rank1.json").unlink()
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"], v["elsewhere"]) == ("crash", list(range(1, 8)), [])


def _meet(run_dirs):
    """Rank r as the only rank of node r, each node with its own run.dir, checkpoints off."""
    import os
    from types import SimpleNamespace

    import torch.distributed as dist

    from meshlm.train import rank0_node

    r = dist.get_rank()
    os.environ.update(GROUP_WORLD_SIZE="2", LOCAL_RANK="0", **{rank0_node.LAUNCH_ENV: f"launch{r % 2}"})
    cfg = SimpleNamespace(run=SimpleNamespace(dir=run_dirs[r % 2]), checkpoint=SimpleNamespace(interval=0))
    return rank0_node.meet_rank0(cfg)


def test_each_rank_learns_which_ranks_share_its_run_dir(tmp_path):
    from meshlm.testing import run_ranks

    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for d in dirs:
        d.mkdir()
    assert run_ranks(_meet, 4, dirs) == [[0, 2], [1, 3], [0, 2], [1, 3]]  # ranks 0, 2 launched on node 0
    assert run_ranks(_meet, 2, [tmp_path, tmp_path]) == [None, None]  # one shared run.dir


# ---------------------------------------------------------------- 5. files the analysis did not write

def test_stray_files_and_incomplete_dumps_are_skipped_with_a_note(tmp_path, capsys):
    """A copy kept by hand (comm_rank1.old.jsonl), a dump without world_size, a record without axis:
    each was a traceback (exit 1); now each is skipped with a note and the rest is analysed."""
    from meshlm.cli import main as meshlm_main

    (tmp_path / "logs").mkdir()
    for name in ("comm_rank0.jsonl", "comm_rank1.jsonl", "comm_rank1.old.jsonl"):
        (tmp_path / "logs" / name).write_text(json.dumps(rec(0)) + "\n")
    (tmp_path / "logs" / "comm_rank0.jsonl").write_text("\n".join(json.dumps(r) for r in (
        rec(0), {k: v for k, v in rec(1).items() if k != "axis"})) + "\n")
    assert meshlm_main(["debug", "analyze", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: 2 ranks' collectives agree") and "comm_rank1.old.jsonl: not a recorder file" in out
    assert "comm_rank0.jsonl: 1 record(s) without" in out

    write(tmp_path, 0, 2, [rec(0), rec(1, done=False)], {"dp": [0, 1]})
    write(tmp_path, 1, 2, [rec(0)], {"dp": [0, 1]})
    dump = json.loads((tmp_path / "debug" / "rank1.json").read_text())
    (tmp_path / "debug" / "rank1.json").write_text(json.dumps({k: v for k, v in dump.items() if k != "world_size"}))
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"]) == ("hang", [1]) and any("no world_size" in n for n in v["notes"]), v
    write(tmp_path, 1, 2, [rec(0), {k: v for k, v in rec(1, done=False).items() if k != "axis"}], {"dp": [0, 1]})
    v = analyze(tmp_path)
    assert v["verdict"] == "hang" and any("1 record(s) without" in n for n in v["notes"])
    assert meshlm_main(["debug", "analyze", str(tmp_path), "--json"]) == 0


# ---------------------------------------------------------------- 6. OOM advice against each rank's share

@pytest.mark.parametrize("host_over_peak,fits", [(10.0, True), (2.1, False)])
def test_oom_advice_compares_the_prediction_with_each_local_ranks_share(corpus, tmp_path, monkeypatch,
                                                                       host_over_peak, fits):
    """2 local ranks on a CPU host: each gets half the RAM. With 10x the predicted peak in all (5x
    each) the layout is not the cause, and "to fit: ..." would send the user after the wrong
    thing; with 2.1x (1.05x each) it does not fit under 90% and the changes are listed."""
    import torch

    from meshlm.analysis.memory import predict, runtime_backend
    from meshlm.debug import oom

    cfg = small_cfg(corpus, tmp_path, 2, "parallel.dp=2", "train.micro_batch_size=4")
    peak = predict(cfg, backend=runtime_backend("cpu", 2)).ranks[0].peak_bytes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(oom, "device_capacity", lambda device: int(host_over_peak * peak))
    lines = oom.oom_report(cfg, 1, 7, "forward", None, torch.device("cpu"))
    assert "over 2 local ranks" in lines[0], lines[0]
    if fits:
        assert lines[-1].startswith("  the predicted peak (") and "a leak" in lines[-1], lines[-1]
        assert not any(line.startswith("  to fit: ") for line in lines)
    else:
        assert lines[-1].startswith("  to fit: ") and "predicted peak" in lines[-1], lines[-1]


# ---------------------------------------------------------------- 7. wording

def test_a_p2p_hang_names_the_half_the_peer_never_posted(tmp_path):
    """Rank 0 waits in its send #7 to rank 1, which never posted the receive: not "rank 1 never
    entered collective #7 (send on p2p 0->1)"."""
    write(tmp_path, 0, 2, [rec(6, op="send", axis="pp", peer=1), rec(7, op="send", axis="pp", peer=1, done=False)], {})
    write(tmp_path, 1, 2, [rec(6, op="recv", axis="pp", peer=0)], {})
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"], v["seq"]) == ("hang", [1], 7)
    assert v["line"].startswith("hang: rank 1 never posted the receive from rank 0 #7 (p2p 0->1; rank 0 waits in "
                                "its send)"), v["line"]


def test_a_p2p_hang_from_a_higher_rank_names_the_receiver_as_the_one_waiting(tmp_path):
    """Rank 0 waits in its receive #3 from rank 1, which never posted the send: the sender's
    number is the larger, and the waiting rank is still the receiver."""
    write(tmp_path, 0, 2, [rec(2, op="recv", axis="pp", peer=1), rec(3, op="recv", axis="pp", peer=1, done=False)], {})
    write(tmp_path, 1, 2, [rec(2, op="send", axis="pp", peer=0)], {})
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"], v["seq"], v["group"]) == ("hang", [1], 3, "p2p")
    assert v["line"].startswith("hang: rank 1 never posted the send to rank 0 #3 (p2p 1->0; rank 0 waits in "
                                "its recv) at step 4"), v["line"]


def test_a_hang_line_says_the_step_who_waited_how_long_and_where_the_ranks_it_waits_on_were(tmp_path):
    """The step the hang is in (one past the most any rank completed), the waiters (plural or
    not) and the longest any of them waited, the chain to the rank that waits on nothing, and
    where that rank's main thread was."""
    stack = {"MainThread (1)": ['File "/x/meshlm/train/trainer.py", line 200, in train_step\n    self.step()\n']}
    for r, idle in ((0, 4.0), (1, 6.5), (3, 5.0)):  # three ranks wait in #5; rank 2 never called it
        write(tmp_path, r, 4, [rec(4), rec(5, done=False, t=1.0)], {"dp": [0, 1, 2, 3]}, step=3 if r else 2,
              idle_s=idle)
    write(tmp_path, 2, 4, [rec(4)], {"dp": [0, 1, 2, 3]}, stacks=stack)
    v = analyze(tmp_path)
    assert v["step"] == 4 and v["line"] == (
        "hang: rank 2 never entered collective #5 (all_reduce on dp [0, 1, 2, 3]) at step 4; ranks 0, 1, 3 waited "
        "in it 6.5 s; rank 2 was in train_step (trainer.py:200)")
    # tp {0,1} {2,3}, dp {0,2} {1,3}: rank 0 waits first, in tp #7, for rank 1, which waits in dp #3
    # for rank 3, in no collective: the chain is named, and the one waiter in the singular.
    chain = tmp_path / "chain"
    write(chain, 0, 4, [rec(6, axis="tp"), rec(7, axis="tp", done=False, t=0.5)], TP2_DP2[0])
    write(chain, 1, 4, [rec(6, axis="tp"), rec(3, axis="dp", done=False, t=1.0)], TP2_DP2[1])
    write(chain, 2, 4, [rec(6, axis="tp"), rec(3, axis="dp")], TP2_DP2[2])
    write(chain, 3, 4, [rec(6, axis="tp"), rec(2, axis="dp")], TP2_DP2[3], stacks=stack)
    v = analyze(chain)
    assert (v["ranks"], v["group"], v["seq"]) == ([3], "tp", 7)
    assert v["line"] == ("hang: rank 1 never entered collective #7 (all_reduce on tp [0, 1]) at step 4 (which wait "
                         "on rank 3); rank 0 waited in it 5.0 s; rank 3 was in train_step (trainer.py:200)"), v["line"]


def test_a_rank_already_past_the_collective_is_not_among_those_that_never_entered_it(tmp_path):
    """Rank 0, the root of broadcast #5, finished it at once and now waits in #6; rank 1 waits in
    #5 for rank 2, which never called it. Rank 0 is ahead, not absent: the hang is rank 2's."""
    dp = {"dp": [0, 1, 2]}
    write(tmp_path, 0, 3, [rec(4), rec(5, op="broadcast"), rec(6, done=False, t=2.0)], dp)
    write(tmp_path, 1, 3, [rec(4), rec(5, op="broadcast", done=False, t=1.0)], dp)
    write(tmp_path, 2, 3, [rec(4)], dp)
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"], v["seq"], v["op"]) == ("hang", [2], 5, "broadcast"), v["line"]
    assert v["line"].startswith("hang: rank 2 never entered collective #5 (broadcast on dp [0, 1, 2]) at step 4; "
                                "rank 1 waited in it"), v["line"]


def test_of_several_ranks_that_never_entered_the_first_is_the_one_described(tmp_path):
    """Where the line describes one culprit's whereabouts, it is the lowest rank, as everywhere
    else in a verdict (the ranks listed in order, a cycle told from its lowest rank)."""
    def stack(function):
        return {"MainThread (1)": [f'File "/x/meshlm/train/trainer.py", line 9, in {function}\n    pass\n']}

    dp = {"dp": [0, 1, 2, 3]}
    for r in (0, 1):
        write(tmp_path, r, 4, [rec(4), rec(5, done=False, t=1.0)], dp)
    write(tmp_path, 2, 4, [rec(4)], dp, stacks=stack("load_batch"))
    write(tmp_path, 3, 4, [rec(4)], dp, stacks=stack("save_checkpoint"))
    v = analyze(tmp_path)
    assert v["ranks"] == [2, 3] and v["line"] == (
        "hang: ranks 2, 3 never entered collective #5 (all_reduce on dp [0, 1, 2, 3]) at step 4; ranks 0, 1 waited in "
        "it 5.0 s; rank 2 was in load_batch (trainer.py:9)"), v["line"]


def test_the_watchdogs_line_is_one_write_so_ranks_lines_do_not_interleave(tmp_path, monkeypatch):
    import sys

    from meshlm.comm import Comm
    from meshlm.debug.progress import Progress
    from meshlm.debug.watchdog import Watchdog
    from meshlm.mesh import Layout, ParallelContext

    writes = []
    monkeypatch.setattr(sys, "stderr", type("Err", (), {"write": lambda self, s: writes.append(s),
                                                        "flush": lambda self: None})())
    Watchdog(Comm(ParallelContext(Layout())), Progress(), tmp_path, 1, 1, exit_process=False)._fire(2.0)
    assert len(writes) == 1 and writes[0].startswith("meshlm: rank 0: no progress") and writes[0].endswith("\n")
