"""Failure diagnosis without launching jobs: the analyzer on constructed dumps, the watchdog and
the rank guard on forked ranks (dumps written, dropped on a restart, a restart naming the failure
before it). What ranks check while they train (non-finite steps, the desync fingerprint,
stragglers, the OOM report) is in test_debug_checks.py; end-to-end faults through `meshlm train`
in test_debug_cli.py."""

import json
import time

import pytest
import torch
import torch.distributed as dist

from helpers import small_cfg
from meshlm.comm import Comm
from meshlm.debug.analyze import analyze
from meshlm.debug.dumps import read_dumps
from meshlm.debug.progress import Progress
from meshlm.debug.watchdog import Watchdog
from meshlm.mesh import Layout, ParallelContext
from meshlm.testing import run_ranks


# ---------------------------------------------------------------- the analyzer on constructed dumps

def rec(seq, op="all_reduce", axis="dp", numel=1, dtype="float32", done=True, peer=None, t=0.0):
    return {"seq": seq, "op": op, "axis": axis, "numel": numel, "dtype": dtype, "peer": peer,
            "t_start": t, "t_end": t + 0.1 if done else None}


def write(tmp_path, rank, world, records, groups, reason="timeout", step=3, **extra):
    (tmp_path / "debug").mkdir(exist_ok=True)
    dump = {"rank": rank, "world_size": world, "reason": reason, "time": 100.0 + rank, "step": step,
            "phase": "forward", "groups": groups, "records": records, "stacks": {}, "idle_s": 5.0, **extra}
    (tmp_path / "debug" / f"rank{rank}.json").write_text(json.dumps(dump))


def test_hang_names_the_rank_that_never_entered_the_collective(tmp_path):
    dp = {"dp": [0, 1, 2, 3]}
    for r in (0, 1, 3):  # three ranks wait in #5; rank 2 finished #4 and never called #5
        write(tmp_path, r, 4, [rec(4), rec(5, done=False, t=1.0)], dp)
    write(tmp_path, 2, 4, [rec(4)], dp)
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"], v["group"], v["seq"], v["op"]) == ("hang", [2], "dp", 5, "all_reduce")
    assert v["line"].startswith("hang: rank 2 never entered collective #5 (all_reduce on dp [0, 1, 2, 3])")


def test_hang_follows_the_culprit_to_the_rank_that_waits_on_nothing(tmp_path):
    # tp groups {0,1} {2,3}, dp groups {0,2} {1,3}: rank 0 waits in tp #7 for rank 1, which waits in
    # dp #3 for rank 3, which is in no collective at all: the root is rank 3.
    g = {0: {"tp": [0, 1], "dp": [0, 2]}, 1: {"tp": [0, 1], "dp": [1, 3]}, 2: {"tp": [2, 3], "dp": [0, 2]},
         3: {"tp": [2, 3], "dp": [1, 3]}}
    write(tmp_path, 0, 4, [rec(6, axis="tp"), rec(7, axis="tp", done=False, t=2.0)], g[0])
    write(tmp_path, 1, 4, [rec(6, axis="tp"), rec(3, axis="dp", done=False, t=1.0)], g[1])
    write(tmp_path, 2, 4, [rec(6, axis="tp"), rec(3, axis="dp")], g[2])
    write(tmp_path, 3, 4, [rec(6, axis="tp"), rec(2, axis="dp")], g[3])
    v = analyze(tmp_path)
    assert v["verdict"] == "hang" and v["ranks"] == [3] and (v["group"], v["seq"]) == ("dp", 3)


def test_a_missing_sender_is_named_for_a_waiting_receiver(tmp_path):
    write(tmp_path, 0, 2, [rec(0, op="send", axis="pp", peer=1)], {})
    write(tmp_path, 1, 2, [rec(0, op="recv", axis="pp", peer=0), rec(1, op="recv", axis="pp", peer=0, done=False)], {})
    v = analyze(tmp_path)
    assert v["verdict"] == "hang" and v["ranks"] == [0] and v["group"] == "p2p" and v["seq"] == 1


@pytest.mark.parametrize("world,odd", [(3, [2]), (4, [1]), (2, [0, 1])])
def test_desync_names_the_minority_or_both_on_a_tie(tmp_path, world, odd):
    ranks = list(range(world))
    for r in ranks:
        odd_one = rec(1, dtype="int32" if r == odd[0] else "float32")  # on a tie, one of each
        write(tmp_path, r, world, [rec(0), odd_one, rec(2, done=False)], {"dp": ranks})
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"], v["seq"]) == ("desync", odd, 1)


def test_a_ranks_own_failure_outranks_the_peers_it_took_down(tmp_path):
    groups = {"dp": [0, 1]}
    write(tmp_path, 1, 2, [rec(0)], groups, reason="error", culprits=[1],
          report=["rank 1 failed at step 3 (forward): RuntimeError: boom"])
    write(tmp_path, 0, 2, [rec(0), rec(1, done=False)], groups, reason="peer_lost")
    v = analyze(tmp_path)
    assert v["verdict"] == "error" and v["ranks"] == [1] and "RuntimeError: boom" in v["line"]


def test_a_rank_without_a_dump_is_a_crash(tmp_path):
    write(tmp_path, 0, 2, [rec(0)], {"dp": [0, 1]}, reason="peer_lost")
    v = analyze(tmp_path)
    assert v["verdict"] == "crash" and v["ranks"] == [1]


JSON_KEYS = {"verdict", "line", "ranks", "group", "group_ranks", "seq", "op", "step", "details", "dumps",
             "missing_dumps"}


def test_a_finished_run_is_ok_and_no_data_is_none(tmp_path):
    assert analyze(tmp_path)["verdict"] == "none"
    (tmp_path / "logs").mkdir()
    for r in (0, 1):
        (tmp_path / "logs" / f"comm_rank{r}.jsonl").write_text(json.dumps({**rec(0), "rank": r}) + "\n")
    assert analyze(tmp_path)["verdict"] == "ok"
    (tmp_path / "debug").mkdir()
    (tmp_path / "debug" / "rank_notes.json").write_text('{"note": "not a dump"}')  # read past, not a KeyError
    (tmp_path / "debug" / "rank9.json").write_text('[1, 2]')
    assert analyze(tmp_path)["verdict"] == "ok"
    assert JSON_KEYS <= set(analyze(tmp_path))  # every key in every verdict (docs/debugging.md)


def test_a_finished_run_missing_a_ranks_recorder_file_is_incomplete_not_ok(tmp_path):
    """The world size is the config's (dp*tp*cp*pp), not the number of files: a rank that left no
    file is named, and the others' groups resolve against the real world."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "config.toml").write_text("[parallel]\ndp = 2\ntp = 2\n")
    for r in (0, 1, 2):
        (tmp_path / "logs" / f"comm_rank{r}.jsonl").write_text(json.dumps({**rec(0), "rank": r}) + "\n")
    result = analyze(tmp_path)
    assert (result["verdict"], result["ranks"]) == ("incomplete", [3]), result["line"]
    assert result["line"].startswith("incomplete: no recorder file from rank 3 of 4")


# ---------------------------------------------------------------- the watchdog on forked ranks

def _one_rank_stalls(run_dir, stall_rank):
    rank = dist.get_rank()
    ctx = ParallelContext(Layout(dp=2))
    comm, progress = Comm(ctx), Progress()
    with Watchdog(comm, progress, run_dir, timeout_s=0.4, startup_timeout_s=0.4, exit_process=False) as dog:
        comm.all_reduce(torch.ones(1), "dp")
        if rank == stall_rank:
            time.sleep(1.5)  # stops before the collective the other rank is already in
        comm.all_reduce(torch.ones(1), "dp")
        return dog.fired.is_set()


def _gpu_dumps(run_dir, reached: dict[int, int]):
    """Timeout dumps as ranks on NCCL leave them: every record finished when its op was queued."""
    (run_dir / "debug").mkdir(parents=True, exist_ok=True)
    for rank, n in reached.items():
        records = [{"seq": k, "op": "all_reduce", "axis": "cp+dp", "numel": 1, "dtype": "float64", "peer": None,
                    "t_start": float(k), "t_end": k + 0.01} for k in range(n)]
        (run_dir / "debug" / f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "world_size": len(reached), "reason": "timeout", "time": 100.0, "step": 2, "phase": "batch",
             "groups": {"cp+dp": sorted(reached)}, "records": records, "stacks": {}, "idle_s": 300}))


def test_a_communication_log_cut_off_mid_line_is_read_up_to_the_cut(tmp_path):
    (tmp_path / "logs").mkdir()
    whole = json.dumps({"seq": 0, "op": "all_reduce", "axis": "world", "numel": 1, "dtype": "float32",
                        "peer": None, "t_start": 0.0, "t_end": 0.1})
    (tmp_path / "logs" / "comm_rank0.jsonl").write_text(whole + "\n\n" + whole.replace('"seq": 0', '"seq": 1') + "\n")
    (tmp_path / "logs" / "comm_rank1.jsonl").write_text(whole + "\n" + '{"seq": 1, "op": "all_re')  # killed writing
    result = analyze(tmp_path)
    assert result["verdict"] == "ok", result["line"]


def test_a_gpu_hang_is_attributed_from_how_far_each_rank_queued(tmp_path):
    _gpu_dumps(tmp_path / "hang", {0: 6, 1: 5, 2: 6})
    result = analyze(tmp_path / "hang")
    assert (result["verdict"], result["ranks"], result["seq"], result["group"]) == ("hang", [1], 5, "cp+dp")
    assert JSON_KEYS <= set(result)
    _gpu_dumps(tmp_path / "even", {0: 6, 1: 6})  # every rank queued as far: nothing to blame on one
    assert analyze(tmp_path / "even")["verdict"] == "unknown"


def test_a_restarted_rank_drops_its_dump_of_the_attempt_before(corpus, tmp_path):
    from meshlm.debug.guard import RankGuard

    cfg = small_cfg(corpus, tmp_path, 2, "parallel.dp=2")
    (tmp_path / "debug").mkdir()
    for rank in (0, 1):
        (tmp_path / "debug" / f"rank{rank}.json").write_text("{}")
    with RankGuard(cfg, 1, 2):
        assert sorted(p.name for p in (tmp_path / "debug").iterdir()) == ["rank0.json"]  # the other's is its own


def test_a_failure_whose_dump_cannot_be_written_is_still_said_in_one_line(corpus, tmp_path, capsys, monkeypatch):
    """A full disk fails the checkpoint and then the dump: under a launcher the guard printed
    nothing (the verdict reads dumps), so the user saw only "could not write .../rank1.json" and
    "training failed on rank 1 (exit 1)"; alone, it pointed at a traceback file it had not written.
    The failure is now said by the rank itself, without the pointer, and no partial dump is left."""
    import errno
    import pathlib

    from meshlm.debug.guard import RankFailed, RankGuard

    cfg = small_cfg(corpus, tmp_path, 2, "parallel.dp=2")
    real_write_text = pathlib.Path.write_text

    def full_disk(path, data, *args, **kwargs):  # the dump's temporary file: half written, then ENOSPC
        real_write_text(path, data[:10], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    shard = tmp_path / "checkpoints" / ".tmp_step_0000003" / "rank00001.safetensors"
    with pytest.raises(RankFailed), RankGuard(cfg, 1, 2):
        monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
        raise OSError(errno.ENOSPC, "No space left on device", str(shard))
    monkeypatch.undo()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"meshlm: rank 1: could not write {tmp_path / 'debug' / 'rank1.json'}: ")
    assert err[1:] == [f"meshlm: rank 1 failed at step 0 (setup): OSError: [Errno 28] No space left on device: "
                       f"'{shard}'"]
    assert list((tmp_path / "debug").iterdir()) == []


def test_the_first_step_a_process_runs_has_the_startup_limit_even_after_a_resume(tmp_path):
    progress = Progress()
    dog = Watchdog(Comm(ParallelContext(Layout())), progress, tmp_path, timeout_s=1, startup_timeout_s=9,
                   exit_process=False)
    progress.resumed_at(40)
    progress.at("forward")
    assert (progress.step, dog.limit_s()) == (40, 9)  # building, loading and its first step
    progress.step_done(41)
    progress.at("forward")
    assert dog.limit_s() == 1
    progress.at("eval")  # held-out batches: no collective for a while, maybe a compile
    assert dog.limit_s() == 9


def test_watchdog_dumps_every_rank_and_the_analysis_names_the_stalled_one(tmp_path):
    assert run_ranks(_one_rank_stalls, 2, tmp_path, 1, timeout=30) == [True, True]
    dumps = read_dumps(tmp_path)
    assert sorted(dumps) == [0, 1] and {d["reason"] for d in dumps.values()} == {"timeout"}
    assert dumps[0]["records"][-1]["t_end"] is None and dumps[1]["records"][-1]["t_end"] is not None
    assert any("_one_rank_stalls" in "".join(frames) for frames in dumps[1]["stacks"].values())
    v = analyze(tmp_path)
    assert (v["verdict"], v["ranks"], v["group"], v["seq"]) == ("hang", [1], "dp", 1)


def _restarted_rank(rank, port, run_dir, cfg, err_path):
    """Rank `rank` of a restart up to where the worker enters its RankGuard, which drops its dump
    of the attempt before; rank 0 starts late, as it may on a loaded node."""
    import os
    import sys

    from meshlm.debug.guard import RankGuard
    from meshlm.train.worker import say_restart

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="1",
                      TORCHELASTIC_MAX_RESTARTS="2")
    sys.stderr = open(err_path, "w", buffering=1)
    if rank == 0:
        time.sleep(1.0)
    say_restart(str(run_dir))
    with RankGuard(cfg, rank, 2):
        pass
    os._exit(0)


def test_a_restart_names_the_failure_before_it_however_late_rank_0_reaches_it(corpus, tmp_path):
    """Rank 0 of a restart reads the attempt before's dumps; each rank drops its own once its
    process group exists. gloo's group waits for rank 0, NCCL's does not (it forms lazily at the
    first collective): a rank ahead of rank 0 dropped the dump that said why (here rank 1's, the
    failure), and the restart blamed the wrong thing. The ranks meet in torchrun's store first."""
    import multiprocessing
    import socket

    from meshlm.debug.guard import RankFailed, RankGuard

    cfg = small_cfg(corpus, tmp_path, 2, "parallel.dp=2")
    with pytest.raises(RankFailed), RankGuard(cfg, 1, 2):  # the attempt before: rank 1 raised
        raise RuntimeError("the failure the restart must name")
    cause = analyze(tmp_path)["line"]
    assert "the failure the restart must name" in cause
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the agent's
    fork = multiprocessing.get_context("fork")
    ranks = [fork.Process(target=_restarted_rank, args=(r, port, tmp_path, cfg, tmp_path / f"err{r}")) for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=60)
    del store
    assert [p.exitcode for p in ranks] == [0, 0]
    said = (tmp_path / "err0").read_text()
    assert f"meshlm: restart 1 of 2, from the newest checkpoint; the attempt before failed: {cause}" in said, said
    assert list((tmp_path / "debug").iterdir()) == []  # and each rank dropped its dump after
