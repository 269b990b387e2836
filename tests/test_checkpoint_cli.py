"""Checkpoints end to end through `meshlm train`: resume after a crash, a killed rank restarted by
torchrun, SIGTERM and Ctrl-C, corrupt checkpoints, and bad input. Every run here is compared with
an uninterrupted one, loss by loss.

One-rank runs that end by themselves run in this process (helpers.meshlm_in_process: the same
code, without an interpreter start each); a crash, a signal and several ranks need real processes.
The tests that start from a run with checkpoints share one (`four_steps`), each on its own copy."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import data_args, meshlm_in_process, no_rank_left, read_metrics, run_meshlm

STEPS = 6


def train_args(corpus, run_dir, *overrides, steps=STEPS):
    return ["train", "model.preset=debug", *data_args(corpus), "train.seq_len=32", "train.global_batch_size=8",
            "train.micro_batch_size=2", f"train.steps={steps}", "train.lr=1e-3", "train.warmup_steps=2",
            "train.eval_interval=0", "run.sample_tokens=0", "checkpoint.interval=2", f"run.dir={run_dir}", *overrides]


def meshlm(*args, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "meshlm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def losses(run_dir) -> list[float]:
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "metrics.jsonl must hold every step once"
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """Uninterrupted single-process losses (the reference)."""
    run_dir = tmp_path_factory.mktemp("straight")
    run_meshlm(*train_args(corpus, run_dir), in_process=True)
    return losses(run_dir)


@pytest.fixture(scope="module")
def four_steps(corpus, tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4; `copy_of` gives each test its own."""
    run_dir = tmp_path_factory.mktemp("four-steps")
    run_meshlm(*train_args(corpus, run_dir, "checkpoint.keep=3", steps=4), in_process=True)
    return run_dir


def copy_of(run_dir, to):
    shutil.copytree(run_dir, to, dirs_exist_ok=True)  # tmp_path exists already
    return to


def test_crash_then_resume_is_bitwise_exact_and_metrics_hold_every_step(corpus, tmp_path, straight):
    crashed = meshlm(*train_args(corpus, tmp_path, "debug.fault=kill", "debug.fault_step=3"))
    assert crashed.returncode == -signal.SIGKILL
    assert len(read_metrics(tmp_path)) == 3  # step 3 was logged after the checkpoint of step 2
    resumed = run_meshlm(*train_args(corpus, tmp_path), in_process=True)
    assert "resuming from" in resumed.stdout and "step_0000002" in resumed.stdout
    assert losses(tmp_path) == straight  # tolerance 0; step 3 ran twice and is listed once


# `meshlm train` with a SIGKILL at the one moment a crash test cannot otherwise reach: the step's
# checkpoint is in place, its metrics row not yet written.
KILLED_BEFORE_THE_ROW = """
import os, signal, sys
from meshlm.train import metrics
log_step = metrics.MetricsWriter.log_step
def dying(self, row):
    if row["step"] == int(os.environ["DIE_BEFORE_ROW"]):
        os.kill(os.getpid(), signal.SIGKILL)
    log_step(self, row)
metrics.MetricsWriter.log_step = dying
from meshlm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_kill_after_a_checkpoint_before_its_metrics_row_loses_no_row(corpus, tmp_path, straight):
    """The row of a save step is logged after the save (it holds checkpoint_s): a kill in between
    left a checkpoint of step 4 and metrics up to step 3, and the resume from step 4 appended
    from step 5, so step 4's loss was lost from metrics.jsonl for good."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DIE_BEFORE_ROW="4")
    crashed = subprocess.run([sys.executable, "-c", KILLED_BEFORE_THE_ROW, *train_args(corpus, tmp_path)],
                             capture_output=True, text=True, timeout=240, env=env)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "step_0000004" / "manifest.json").exists()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    resumed = run_meshlm(*train_args(corpus, tmp_path), in_process=True)
    assert "step_0000004" in resumed.stdout
    assert losses(tmp_path) == straight  # every step once, step 4's row from its checkpoint


def test_killed_rank_is_restarted_and_training_continues(corpus, tmp_path, straight):
    proc = run_meshlm(*train_args(corpus, tmp_path, "debug.fault=kill", "debug.fault_rank=1", "debug.fault_step=3"),
                      "--nproc", "2", "--max-restarts", "1")
    assert "resumed from" in proc.stdout
    assert ("meshlm: restart 1 of 1, from the newest checkpoint; the attempt before failed: crash: rank 1 died "
            "without a report") in proc.stderr  # not silent, and says why
    assert losses(tmp_path) == pytest.approx(straight, abs=1e-5, rel=0)
    no_rank_left(tmp_path)


def test_each_restart_says_why_the_attempt_before_failed(corpus, tmp_path):
    """A week-long run with --max-restarts: each restart said only "a rank died" (also of a rank that
    raised), and the next attempt's ranks deleted the dumps that said why, so only the last failure
    was ever explained. Now rank 0 reads the verdict before any rank of the new attempt drops its
    dump, and says it with the restart."""
    proc = meshlm(*train_args(corpus, tmp_path, "debug.fault=raise", "debug.fault_rank=1", "debug.fault_step=3"),
                  "--nproc", "2", "--max-restarts", "1")
    assert proc.returncode == 1
    cause = "error: rank 1 failed at step 3 (batch): RuntimeError: debug.fault=raise: injected on rank 1 at step 3"
    assert f"meshlm: restart 1 of 1, from the newest checkpoint; the attempt before failed: {cause}" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"meshlm: {cause}")  # the last attempt's, as before
    no_rank_left(tmp_path)


def start_training(corpus, run_dir, *overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = train_args(corpus, run_dir, "checkpoint.interval=1000", *overrides, steps=1000)
    return subprocess.Popen([sys.executable, "-m", "meshlm.cli", *args, "--nproc", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def wait_for_steps(run_dir, n: int, proc, timeout=120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("training did not reach the step")


def worker_pids(run_dir) -> list[int]:
    found = subprocess.run(["pgrep", "-f", f"meshlm.train.worker --config {run_dir}"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


@pytest.mark.parametrize("sig,name,target", [(signal.SIGTERM, "SIGTERM", "launcher"), (signal.SIGINT, "Ctrl-C", "launcher"),
                                             (signal.SIGTERM, "SIGTERM", "one rank")])
def test_a_signal_saves_at_the_next_step_and_exits_zero(corpus, tmp_path, sig, name, target):
    """To the launcher (torchrun forwards it), or to one rank only (the ranks agree after each
    step, so the other stops after the same step instead of waiting in a collective forever)."""
    proc = start_training(corpus, tmp_path)
    wait_for_steps(tmp_path, 2, proc)
    t0 = time.time()
    if target == "launcher":
        proc.send_signal(sig)
    else:
        os.kill(worker_pids(tmp_path)[-1], sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert time.time() - t0 < 30
    stopped_at = len(read_metrics(tmp_path))
    assert f"stopped by {name} after step {stopped_at}" in out
    assert (tmp_path / "checkpoints" / f"step_{stopped_at:07d}" / "manifest.json").exists()
    assert not (tmp_path / "final").exists()  # not finished: the checkpoint is the result
    no_rank_left(tmp_path)


def test_second_ctrl_c_exits_at_once_and_leaves_no_checkpoint_half_written(corpus, tmp_path):
    slow = ["model.dim=512", "model.ffn_dim=1024", "train.seq_len=128"]  # steps of ~1 s: time to interrupt one
    proc = start_training(corpus, tmp_path, *slow)
    wait_for_steps(tmp_path, 1, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert time.time() - t0 < 5
    no_rank_left(tmp_path)
    from meshlm.train.checkpoint.store import list_checkpoints, verify

    for path in list_checkpoints(tmp_path / "checkpoints"):  # whatever exists is complete
        assert verify(path) is None


@pytest.mark.parametrize("byte", [-1, 10], ids=["contents", "header"])  # the header: the launcher cannot open it
def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(corpus, tmp_path, straight, four_steps, byte):
    copy_of(four_steps, tmp_path)
    newest = tmp_path / "checkpoints" / "step_0000004" / "rank00000.safetensors"
    data = bytearray(newest.read_bytes())
    data[byte] ^= 0xFF
    newest.write_bytes(bytes(data))
    (tmp_path / "checkpoints" / "step_0000005").mkdir()  # a directory without a manifest: never loaded
    proc = run_meshlm(*train_args(corpus, tmp_path), in_process=True)
    assert "rank00000.safetensors: contents do not match the manifest's checksum" in proc.stdout + proc.stderr
    # the launcher passes over the directory without a manifest to step 4 (only the ranks hash
    # the tensors and fall back further)
    assert "skipping checkpoint step_0000005" in proc.stdout + proc.stderr and "resuming from" in proc.stdout
    assert "resumed from" in proc.stdout and "step_0000002" in proc.stdout
    assert losses(tmp_path) == straight


def test_a_restart_before_the_first_save_resumes_the_checkpoint_it_was_given(corpus, tmp_path, four_steps):
    """Rank 1 dies at step 5, before this run's first checkpoint (6): torchrun restarts the ranks,
    which continue from checkpoint.resume's step 4 again, not from scratch."""
    given = f"checkpoint.resume={four_steps}/checkpoints/step_0000004"
    run_meshlm(*train_args(corpus, tmp_path / "reference", given), in_process=True)
    proc = run_meshlm(*train_args(corpus, tmp_path / "restarted", given, "debug.fault=kill", "debug.fault_rank=1",
                                  "debug.fault_step=5"), "--nproc", "2", "--max-restarts", "1")
    assert proc.stdout.count("resumed from") == 2 and "step 4 of 6" in proc.stdout
    rows = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "restarted")}
    reference = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "reference")}
    assert sorted(rows) == sorted(reference) == [5, 6] and [rows[5], rows[6]] == pytest.approx(
        [reference[5], reference[6]], abs=1e-5, rel=0)
    no_rank_left(tmp_path / "restarted")


def test_no_good_checkpoint_is_exit_1_in_one_line(corpus, tmp_path, four_steps):
    copy_of(four_steps, tmp_path)
    for step in (2, 4):
        (tmp_path / "checkpoints" / f"step_{step:07d}" / "meta.json").write_text("{}")
    proc = meshlm_in_process(*train_args(corpus, tmp_path), code=1)
    assert proc.stderr.strip().splitlines()[-1].startswith("meshlm: error: no usable checkpoint")
    assert "Traceback" not in proc.stderr


def one_line_error(capsys, args, *fragments):
    """`meshlm ARGS` through meshlm.cli.main in this process (each case fails before any rank or
    data work, so no interpreter start is needed): exit 2 and one line naming what is wrong."""
    from meshlm.cli import main

    capsys.readouterr()
    assert main(list(args)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshlm: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_a_run_dir_in_use_by_another_train_is_refused_before_anything_is_read_or_written(
        corpus, tmp_path, capsys, four_steps):
    """Two trains in one run.dir resumed from each other's checkpoints and both wrote metrics and
    final/: the second is refused (exit 2, naming the holder) before it reads a checkpoint or
    writes config.toml; the nodes of one job lock apart; once released, the run goes on."""
    from meshlm.train.run_lock import run_dir_lock

    run_dir = copy_of(four_steps, tmp_path / "run")
    config = (run_dir / "config.toml").read_text()
    with run_dir_lock(run_dir):
        one_line_error(capsys, train_args(corpus, run_dir, steps=6), f"run.dir: {run_dir} is in use by another "
                       f"meshlm train (pid {os.getpid()} on ")
        assert (run_dir / "config.toml").read_text() == config
        with run_dir_lock(run_dir, node_rank=1):  # another node of the same job: its own lock
            pass
    proc = meshlm_in_process(*train_args(corpus, run_dir, steps=6))
    assert "resuming from" in proc.stdout and [r["step"] for r in read_metrics(run_dir)][-1] == 6


def test_bad_resume_input_is_one_line_exit_2(corpus, tmp_path, capsys, four_steps):
    copy_of(four_steps, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "step_0000002"
    one_line_error(capsys, train_args(corpus, tmp_path / "a", f"checkpoint.resume={tmp_path}"), "no manifest.json")
    one_line_error(capsys, train_args(corpus, tmp_path / "b", f"checkpoint.resume={tmp_path / 'nope'}"),
                   "checkpoint.resume", "does not exist")
    one_line_error(capsys, train_args(corpus, tmp_path / "c", f"checkpoint.resume={ckpt}", "model.dim=128"),
                   "tok_embeddings.weight", "[512, 64]")
    one_line_error(capsys, train_args(corpus, tmp_path / "d", f"checkpoint.resume={ckpt}",
                                      "train.global_batch_size=16"), "train.global_batch_size")
    one_line_error(capsys, train_args(corpus, tmp_path / "d", f"checkpoint.resume={ckpt}", "train.seq_len=16"),
                   "train.seq_len: 16, but checkpoint")
    # 8 heads of 8 and 4 kv heads: the weights' shapes of 4 heads of 16 and 2 kv heads, another model
    one_line_error(capsys, train_args(corpus, tmp_path / "d", f"checkpoint.resume={ckpt}", "model.n_heads=8",
                                      "model.n_kv_heads=4"), "model.n_heads: 8, but checkpoint", "trained with 4")
    one_line_error(capsys, train_args(corpus, tmp_path / "e", "checkpoint.interval=-1"), "checkpoint.interval")
    # the run directory's own checkpoints of another model: auto names the tensor and the way out
    one_line_error(capsys, train_args(corpus, tmp_path / "run", "model.n_layers=3"), "layers.2", "checkpoint.resume=never")
    assert json.loads((ckpt / "manifest.json").read_text())["step"] == 2  # untouched by any of it
    proc = meshlm(*train_args(corpus, tmp_path / "f", "checkpoint.interval=-1"))  # and through a real process
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "checkpoint.interval" in proc.stderr


LLAMA3 = ("model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_low_freq_factor=1",
          "model.rope_high_freq_factor=4", "model.rope_original_max_seq_len=8")


def test_a_llama3_scaled_run_resumes_exactly_and_only_with_its_scaling(corpus, tmp_path, capsys, four_steps):
    """Llama 3.1's rope scaling (an 8-token original context, 32-token windows) is part of the model
    a checkpoint holds: the same scaling resumes bit for bit; another factor, dropping the scaling,
    or adding it to an unscaled checkpoint is exit 2, one line naming the key."""
    run_meshlm(*train_args(corpus, tmp_path / "scaled", *LLAMA3, "checkpoint.keep=3", steps=4), in_process=True)
    straight = losses(tmp_path / "scaled")
    ckpt = tmp_path / "scaled" / "checkpoints" / "step_0000002"
    run_meshlm(*train_args(corpus, tmp_path / "resumed", *LLAMA3, f"checkpoint.resume={ckpt}", steps=4),
               in_process=True)
    assert [r["loss"] for r in read_metrics(tmp_path / "resumed")] == straight[2:]
    assert abs(losses(four_steps)[0] - straight[0]) > 1e-6  # the same init without scaling: another loss
    one_line_error(capsys, train_args(corpus, tmp_path / "a", *LLAMA3[:1], "model.rope_factor=16", *LLAMA3[2:],
                                      f"checkpoint.resume={ckpt}"),
                   "model.rope_factor: 16.0, but checkpoint", "trained with 8.0")
    one_line_error(capsys, train_args(corpus, tmp_path / "b", f"checkpoint.resume={ckpt}"),
                   "model.rope_scaling: none, but checkpoint", "trained with llama3")
    one_line_error(capsys, train_args(corpus, tmp_path / "c", *LLAMA3,
                                      f"checkpoint.resume={four_steps / 'checkpoints' / 'step_0000002'}"),
                   "model.rope_scaling: llama3, but checkpoint", "trained with none")


def test_resuming_onto_other_data_is_one_line_exit_2_naming_the_key(corpus, tmp_path, capsys, four_steps):
    """The checkpoint's loader position belongs to its token cache: another corpus, or the same one
    prepared differently, is refused before any rank starts (it resumed silently)."""
    run_dir = copy_of(four_steps, tmp_path / "run")
    other = tmp_path / "other"
    other.mkdir()
    text = (corpus / "topics.txt").read_text()
    (other / "topics.txt").write_text(text[len(text) // 2:])
    from meshlm.cli import main

    for override, fragments in ((f"data.path={other / 'topics.txt'}", ("was trained on 1 x topics.txt-v512-",
                                                                       "checkpoint.resume=never")),
                                ("data.val_fraction=0.02", ())):
        capsys.readouterr()
        assert main(train_args(corpus, run_dir, override, steps=6)) == 2
        err = capsys.readouterr().err  # the preparation's progress lines, then the error: after the
        last = err.strip().splitlines()[-1]  # data is prepared (its cache key), before any rank starts
        assert last.startswith("meshlm: error: data.path: checkpoint ") and "Traceback" not in err, err
        assert all(fragment in last for fragment in fragments), last
    proc = meshlm_in_process(*train_args(corpus, run_dir, steps=6))  # the same data resumes
    assert "resuming from" in proc.stdout and [r["step"] for r in read_metrics(run_dir)][-1] == 6


def test_an_explicit_older_checkpoint_is_the_one_resumed(corpus, tmp_path, four_steps, straight, monkeypatch):
    """checkpoint.resume=<a checkpoint> (here relative to the working directory) continues from
    exactly that one, though a newer one lies beside it, and fails if a file of it is damaged."""
    copy_of(four_steps, tmp_path / "old")
    monkeypatch.chdir(tmp_path)
    resumed = run_meshlm(*train_args(corpus, tmp_path / "new", "checkpoint.resume=old/checkpoints/step_0000002"),
                         in_process=True)
    assert "resuming from" in resumed.stdout and "step_0000002" in resumed.stdout
    rows = read_metrics(tmp_path / "new")  # a new run directory: its rows start at step 3
    assert [r["step"] for r in rows] == [3, 4, 5, 6] and [r["loss"] for r in rows] == straight[2:]
    # it was saved by a 4-step run: the longer schedule is named (steps 1-2 are warmup, alike in both)
    assert "another schedule (train.steps 4 -> 6)" in resumed.stdout + resumed.stderr
    absolute = tmp_path / "old" / "checkpoints" / "step_0000002"
    run_meshlm(*train_args(corpus, tmp_path / "again", f"checkpoint.resume={absolute}"), in_process=True)
    assert [r["loss"] for r in read_metrics(tmp_path / "again")] == straight[2:]
    other_rope = run_meshlm(*train_args(corpus, tmp_path / "rope", f"checkpoint.resume={absolute}",
                                        "model.rope_theta=20000"), in_process=True)
    assert "with model.rope_theta 10000.0 -> 20000.0: the same weights compute another function" in \
        other_rope.stdout + other_rope.stderr
    whole_run = run_meshlm(*train_args(corpus, tmp_path / "next", "checkpoint.resume=old"), in_process=True)
    assert "step_0000004" in whole_run.stdout  # a run directory: its newest checkpoint
    assert [r["step"] for r in read_metrics(tmp_path / "next")] == [5, 6]
    damaged = tmp_path / "old" / "checkpoints" / "step_0000004" / "rank00000.safetensors"
    data = damaged.read_bytes()
    damaged.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))
    damaged_args = train_args(corpus, tmp_path / "third", "checkpoint.resume=old/checkpoints/step_0000004")
    failed = meshlm_in_process(*damaged_args, code=None)
    assert failed.returncode != 0 and "rank00000.safetensors" in failed.stdout + failed.stderr


def test_fresh_start_sets_earlier_checkpoints_aside(corpus, tmp_path, four_steps):
    """resume=never in a directory with checkpoints: they are moved aside, never mixed with the new
    run's (a later `auto` must not pick the old run's step 4 over the new run's step 2)."""
    copy_of(four_steps, tmp_path)
    run_meshlm(*train_args(corpus, tmp_path, "checkpoint.resume=never", steps=2), in_process=True)
    from meshlm.train.checkpoint.store import list_checkpoints

    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_0000002"]
    (aside,) = tmp_path.glob("checkpoints.old-*")
    assert [p.name for p in list_checkpoints(aside)] == ["step_0000002", "step_0000004"]


def test_async_save_through_the_trainer(corpus, tmp_path, straight):
    """checkpoint.async_save: the same losses, complete checkpoints, and each background save's
    duration reported in a later step's row."""
    run_meshlm(*train_args(corpus, tmp_path, "checkpoint.async_save=true", "checkpoint.keep=3"), in_process=True)
    assert losses(tmp_path) == straight
    rows = read_metrics(tmp_path)
    assert all("checkpoint_s" in rows[s - 1] for s in (2, 4, 6))
    assert any("checkpoint_write_s" in r for r in rows[2:])
    from meshlm.train.checkpoint.store import list_checkpoints, verify

    found = list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in found] == ["step_0000002", "step_0000004", "step_0000006"]
    assert all(verify(p) is None for p in found)
