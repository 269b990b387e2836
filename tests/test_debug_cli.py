"""Each injected fault end to end through `meshlm train` (torchrun, real processes): the job
ends within a bounded time with exit 1, the one-line verdict names the faulty rank (and the
collective where one is involved), `meshlm debug analyze --json` agrees, and no rank is left."""

import json
import os
import subprocess
import sys
import time

import pytest

from helpers import data_args, no_rank_left, read_metrics
from meshlm.cli import main as meshlm_main


def train(corpus, run_dir, nproc, *overrides, steps=3):
    args = ["train", "--nproc", str(nproc), "model.preset=debug", *data_args(corpus), "train.seq_len=32",
            "train.global_batch_size=12", "train.micro_batch_size=2", f"train.steps={steps}", "train.eval_interval=0",
            "run.sample_tokens=0", "checkpoint.interval=0", f"run.dir={run_dir}", "debug.timeout_s=4", *overrides]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "meshlm.cli", *args], capture_output=True, text=True, timeout=90,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    no_rank_left(run_dir)
    return proc, time.monotonic() - t0


def analyze_json(run_dir, capsys) -> dict:
    capsys.readouterr()
    assert meshlm_main(["debug", "analyze", str(run_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# fault, ranks, rank that fails, expected start of the verdict line, verdict fields (group, op)
FAULTS = [
    ("hang", 2, 1, "meshlm: hang: rank 1 never entered collective #", ("cp+dp", "all_reduce")),
    ("desync", 3, 2, "meshlm: desync: at collective #", ("cp+dp", "all_reduce")),
    ("raise", 2, 1, "meshlm: error: rank 1 failed at step 2 (batch): RuntimeError: debug.fault=raise", None),
    ("nan", 2, 1, "meshlm: nonfinite: non-finite gradient norm (nan) at step 2: the loss of rank 1 is not finite", None),
    ("oom", 2, 1, "meshlm: oom: out of memory on rank 1 in the forward of step 2", None),
]


@pytest.mark.parametrize("fault,nproc,rank,line,collective", FAULTS, ids=[f[0] for f in FAULTS])
def test_an_injected_fault_ends_the_job_with_a_verdict_naming_the_rank(corpus, tmp_path, capsys, fault, nproc, rank,
                                                                       line, collective):
    proc, seconds = train(corpus, tmp_path, nproc, f"debug.fault={fault}", f"debug.fault_rank={rank}",
                          "debug.fault_step=2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    verdicts = [v for v in proc.stderr.splitlines() if v.startswith("meshlm: ") and "(details: meshlm debug analyze" in v]
    assert len(verdicts) == 1 and verdicts[0].startswith(line), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "via signal SIGTERM" not in proc.stderr  # torchrun's note on each rank it stops after one failed
    assert seconds < 60
    result = analyze_json(tmp_path, capsys)
    assert result["verdict"] == fault.replace("raise", "error").replace("nan", "nonfinite")
    assert result["ranks"] == [rank]
    if collective:
        assert (result["group"], result["op"]) == collective and result["seq"] is not None
        assert f"#{result['seq']} " in verdicts[0] and f"on {collective[0]}" in verdicts[0]
    if fault == "oom":  # the block: categories against the prediction, and what would fit
        assert "predicted at peak" in proc.stderr and "fits this rank's" in proc.stderr  # 2**60 bytes: not the layout
    assert not (tmp_path / "final").exists()


def test_a_desync_on_the_pipeline_axis_is_caught_at_its_step(corpus, tmp_path, capsys):
    """Stage 1's share of the loss's sum over pp sent as int64 bytes: the stages differ in all
    else, but not in their pipeline-axis collectives, which are compared across them."""
    proc, _ = train(corpus, tmp_path, 2, "parallel.pp=2", "debug.fault=desync", "debug.fault_rank=1",
                    "debug.fault_step=2")
    assert proc.returncode == 1 and "meshlm: desync: at collective #3 on pp [0, 1]" in proc.stderr, proc.stderr[-2000:]
    result = analyze_json(tmp_path, capsys)
    assert (result["verdict"], result["group"], result["op"]) == ("desync", "pp", "all_reduce")


def test_a_killed_rank_is_the_one_named(corpus, tmp_path, capsys):
    """Rank 1 killed: rank 0 finds its peer gone inside a shared-memory collective. That is a lost
    peer, not rank 0's own failure: the verdict is a crash of rank 1."""
    proc, _ = train(corpus, tmp_path, 2, "debug.fault=kill", "debug.fault_rank=1", "debug.fault_step=2")
    assert proc.returncode != 0
    result = analyze_json(tmp_path, capsys)
    assert (result["verdict"], result["ranks"]) == ("crash", [1]), result["line"]


def test_a_resumed_run_reports_the_step_it_is_at(corpus, tmp_path, capsys):
    proc, _ = train(corpus, tmp_path, 2, "checkpoint.interval=2", steps=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, _ = train(corpus, tmp_path, 2, "checkpoint.interval=2", "debug.fault=raise", "debug.fault_rank=1",
                    "debug.fault_step=3", steps=4)
    assert "resuming from" in proc.stdout and "rank 1 failed at step 3 (" in proc.stderr, proc.stderr[-2000:]
    assert "saving a checkpoint" not in proc.stderr  # torchrun's SIGTERM to the survivors saves nothing
    assert analyze_json(tmp_path, capsys)["step"] == 3


def test_each_run_is_analysed_alone(corpus, tmp_path, capsys):
    """A finished run of 3 ranks, a failed one of 2, then a clean run of 1 in the same directory:
    the analysis reads the last run only (not the first's rank-2 log, nor the second's dumps)."""
    for nproc, faults in ((3, ()), (2, ("debug.fault=raise", "debug.fault_rank=1", "debug.fault_step=2")), (1, ())):
        proc, _ = train(corpus, tmp_path, nproc, *faults, steps=2)
        assert proc.returncode == (1 if faults else 0), proc.stderr[-2000:]
    result = analyze_json(tmp_path, capsys)
    assert result["verdict"] == "ok" and "1 ranks' collectives agree" in result["line"], result["line"]


def test_a_slow_rank_is_named_as_the_straggler_and_the_run_finishes(corpus, tmp_path):
    proc, _ = train(corpus, tmp_path, 2, "debug.fault=slow", "debug.fault_rank=1", "debug.fault_step=1",
                    "debug.fault_slow_s=0.3", "train.log_interval=1", steps=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: straggler: rank 1 worked" in proc.stdout
    rows = read_metrics(tmp_path)
    assert [r["slowest_rank"] for r in rows] == [1, 1, 1, 1] and all(r["fastest_rank"] == 0 for r in rows)
    # rank 0's waiting for rank 1 is not counted as its work: the 0.3 s sleep shows as the gap
    # (half of it at least; without the blocked-time accounting the gap would be about zero)
    assert all(r["slowest_rank_s"] > r["fastest_rank_s"] + 0.15 for r in rows)
    # ... and is exposed communication: rank 0 blocked ~0.3 s in each step's collectives, rank 1
    # about none, so the ranks' mean is ~0.15 s (measured 0.149-0.156; with rank 0's time dropped it
    # would be ~0); a share of the step below 1
    assert all(r["comm_exposed_s"] > 0.1 and 0 < r["comm_exposed_share"] < 1 for r in rows)
