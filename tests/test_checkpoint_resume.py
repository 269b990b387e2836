"""Which checkpoints a start leaves where: the set-aside of another timeline's checkpoints, and what
a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0, set here by hand) finds after it. In this
process or one forked rank each: no torchrun (tests/test_checkpoint_cli.py runs it end to end)."""

import json

import pytest

from meshlm.config import load_config

from helpers import build_trainer, small_cfg


def _fake_checkpoint(root, step):
    path = root / f"step_{step:07d}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"step": step, "files": {}}))
    return path


def test_two_set_asides_within_one_second_get_a_directory_each(tmp_path, monkeypatch):
    """Two fresh starts in a row within one second: the second renamed checkpoints/ onto the
    first's checkpoints.old-<second>, not empty: OSError (Directory not empty)."""
    import time

    from meshlm.train.checkpoint.resume import set_aside_old_checkpoints

    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20250101-000000")  # one second, whatever the load
    cfg = load_config(None, [f"run.dir={tmp_path}", "checkpoint.resume=never"])
    asides = []
    for step in (2, 4):
        _fake_checkpoint(tmp_path / "checkpoints", step)  # the previous fresh start's save
        asides.append(set_aside_old_checkpoints(cfg, None))
    assert asides[0] != asides[1] and all(a.name.startswith("checkpoints.old-20250101-000000") for a in asides)
    assert [sorted(p.name for p in a.iterdir()) for a in asides] == [["step_0000002"], ["step_0000004"]]


def _four_steps(corpus, run_dir):
    """A run's checkpoints at steps 2 and 4 (one rank, in this process)."""
    from meshlm.train.checkpoint import save_checkpoint

    trainer = build_trainer(small_cfg(corpus, run_dir, 1, steps=4))
    while trainer.step < 4:
        trainer.train_step()
        if trainer.step % 2 == 0:
            save_checkpoint(trainer, run_dir / "checkpoints", keep=3)
    return run_dir / "checkpoints"


def _start(corpus, run_dir, *extra, restart=False, monkeypatch):
    """A rank's start (worker.start_state) of a 6-step run, as torchrun's first attempt or its
    restart; the rank then dies before this run's first save. Returns the step it starts at."""
    from meshlm.train.worker import start_state

    with monkeypatch.context() as m:
        m.setenv("TORCHELASTIC_RESTART_COUNT", "1" if restart else "0")
        trainer = build_trainer(small_cfg(corpus, run_dir, 1, *extra, steps=6))
        start_state(trainer)
        return trainer.step


def _names(root):
    return sorted(p.name for p in root.iterdir())


def test_a_restart_after_falling_back_past_a_bad_newest_checkpoint_resumes_the_one_loaded(
        corpus, tmp_path, monkeypatch):
    """auto skips a corrupt step 4 for step 2. The set-aside moved all of checkpoints/, step 2
    with it: a rank dying before the first save made the restart train silently from step 0."""
    root = _four_steps(corpus, tmp_path)
    rank_file = root / "step_0000004" / "rank00000.safetensors"
    data = rank_file.read_bytes()
    rank_file.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    assert _start(corpus, tmp_path, monkeypatch=monkeypatch) == 2
    assert _names(root) == ["step_0000002"]
    (aside,) = tmp_path.glob("checkpoints.old-*")
    assert _names(aside) == ["step_0000004"]  # the bad one: kept, apart
    assert _start(corpus, tmp_path, restart=True, monkeypatch=monkeypatch) == 2
    assert _names(root) == ["step_0000002"] and len(list(tmp_path.glob("checkpoints.old-*"))) == 1


def test_a_restart_after_resuming_an_older_own_checkpoint_resumes_it_again(corpus, tmp_path, monkeypatch):
    """checkpoint.resume=<this run's step 2>, a step 4 beside it: the set-aside took step 2 too,
    and the restart failed with 'checkpoint.resume: .../step_0000002: not a directory'."""
    root = _four_steps(corpus, tmp_path)
    given = f"checkpoint.resume={root / 'step_0000002'}"
    assert _start(corpus, tmp_path, given, monkeypatch=monkeypatch) == 2
    assert _names(root) == ["step_0000002"]
    assert _start(corpus, tmp_path, given, restart=True, monkeypatch=monkeypatch) == 2


def test_a_restart_after_resuming_another_directorys_checkpoint_finds_it_where_it_was(
        corpus, tmp_path, monkeypatch):
    """A checkpoint of another run: this run directory's own (another timeline) all move aside,
    the restart resumes the named one again, from where it is."""
    theirs = _four_steps(corpus, tmp_path / "theirs")
    ours = _four_steps(corpus, tmp_path / "ours")
    given = f"checkpoint.resume={theirs / 'step_0000002'}"
    assert _start(corpus, tmp_path / "ours", given, monkeypatch=monkeypatch) == 2
    assert not ours.exists()
    (aside,) = (tmp_path / "ours").glob("checkpoints.old-*")
    assert _names(aside) == ["step_0000002", "step_0000004"]
    assert _start(corpus, tmp_path / "ours", given, restart=True, monkeypatch=monkeypatch) == 2
    assert _names(theirs) == ["step_0000002", "step_0000004"]


def _signalled_at_step_1(monkeypatch):
    """A SIGTERM to this process during step 1's forward-backward (as a scheduler sends one)."""
    import os
    import signal

    from meshlm.train.trainer import Trainer

    real, sent = Trainer.forward_backward, []

    def forward_backward(self, *args, **kwargs):
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)


def test_a_stopped_run_says_how_to_continue_it(corpus, tmp_path, monkeypatch):
    """'run the same command again to continue' held for resume=auto only: the same command with
    resume=never starts over (and sets the saved checkpoint aside), with a path resumes that path."""
    from helpers import read_metrics, run_meshlm, small_train_args

    args = ["train", *small_train_args(corpus, tmp_path, steps=4), "run.sample_tokens=0", "checkpoint.interval=0"]
    with monkeypatch.context() as m:
        _signalled_at_step_1(m)
        stopped = run_meshlm(*args, "checkpoint.resume=never", in_process=True)
    assert ("stopped by SIGTERM after step 1; checkpoint " in stopped.stdout
            and "; to continue, run the same command with checkpoint.resume=auto (in place of "
                "checkpoint.resume=never)" in stopped.stdout), stopped.stdout
    continued = run_meshlm(*args, "checkpoint.resume=never", "checkpoint.resume=auto", in_process=True)
    assert "resuming from" in continued.stdout and [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    with monkeypatch.context() as m:
        _signalled_at_step_1(m)
        again = run_meshlm(*args, "train.steps=6", in_process=True)  # auto: the message as it was
    assert "stopped by SIGTERM after step 2; checkpoint " in again.stdout  # resumed step 1 (interval 0)
    assert "; run the same command again to continue" in again.stdout


def _metrics_writer(run_dir):
    import io

    from meshlm.train.metrics import MetricsWriter

    return MetricsWriter(run_dir, total_steps=8, log_interval=1, active=True, stream=io.StringIO())


def _log(writer, steps, loss=1.0):
    for step in steps:
        writer.log_step({"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0,
                         "step_time_s": 1.0, "tflops": 1.0})


def test_starts_interrupted_before_they_resumed_lose_no_metrics_row(tmp_path):
    """Each start moved metrics.jsonl onto metrics.jsonl.old until it knew whether it resumed: a
    start killed before then left the history there, and the next start moved its own empty file
    over it. Every step must stay in metrics.jsonl once."""
    from helpers import read_metrics

    first = _metrics_writer(tmp_path)
    _log(first, range(1, 5))
    first.close()
    _metrics_writer(tmp_path), _metrics_writer(tmp_path)  # two starts killed before resume_at (not closed)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]  # meanwhile, the history is in place
    resumed = _metrics_writer(tmp_path)
    resumed.resume_at(4)
    _log(resumed, range(5, 9))
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 9))
    fresh = _metrics_writer(tmp_path)  # a fresh start: its first row replaces another timeline's
    _log(fresh, [1], loss=2.0)
    fresh.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 2.0)]


def test_a_metrics_history_an_older_meshlm_left_in_metrics_jsonl_old_is_taken_back(tmp_path):
    """An interrupted start of the old code left the history in metrics.jsonl.old beside an empty
    metrics.jsonl (or one a later fresh start wrote): a resume merges them step by step, the
    later metrics.jsonl winning, and removes the .old."""
    from helpers import read_metrics

    def lines(*rows):
        return "".join(json.dumps({"step": step, "loss": loss}) + "\n" for step, loss in rows)

    (tmp_path / "metrics.jsonl.old").write_text(lines((1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0)))
    (tmp_path / "metrics.jsonl").write_text("")
    resumed = _metrics_writer(tmp_path)
    resumed.resume_at(4)
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0)]
    (tmp_path / "metrics.jsonl.old").write_text(lines((1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0)))
    (tmp_path / "metrics.jsonl").write_text(lines((1, 2.0), (2, 2.0), (3, 2.0)))  # a fresh start's, saved at 2
    resumed = _metrics_writer(tmp_path)
    resumed.resume_at(2)
    _log(resumed, [3], loss=3.0)
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 2.0), (2, 2.0), (3, 3.0)]
    assert not (tmp_path / "metrics.jsonl.old").exists()


@pytest.mark.parametrize("tail", ['{"step": 5, "loss": 1.0, "l', "\0" * 40, "125"], ids=["cut-off", "zeros", "parses"])
def test_a_metrics_row_cut_off_by_a_crash_does_not_stop_the_resume(tmp_path, tail):
    """A full disk or a power loss while a row was written leaves metrics.jsonl ending in part of a
    line (or, after a power loss on ext4, in zeros): every resume then failed at setup with
    "JSONDecodeError: Unterminated string", and the run could not continue without editing the
    file. The cut line is dropped (it is past the checkpoint here, so nothing is lost), with a note."""
    from helpers import read_metrics

    first = _metrics_writer(tmp_path)
    _log(first, range(1, 5))
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(tail)
    resumed = _metrics_writer(tmp_path)
    resumed.resume_at(4)
    _log(resumed, [5, 6])
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert resumed.stream.getvalue().startswith(f"warning: {tmp_path / 'metrics.jsonl'}: dropped 1 line cut off")


def test_a_full_disk_under_a_run_is_one_named_error_not_a_traceback_per_log_line(tmp_path, capsys):
    """A disk that fills during a run: each rank-log line printed Python logging's "--- Logging
    error ---" traceback on stderr (one per line logged, per rank), and the metrics row that then
    failed said "[Errno 28] No space left on device" without naming a file. /dev/full is a full disk."""
    import errno
    import logging

    from meshlm.train.metrics import rank_logger

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank0.log").symlink_to("/dev/full")
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    log = rank_logger(tmp_path, 0)
    try:
        log.info("step %d", 1)
        log.info("step %d", 2)
    finally:
        for handler in log.handlers:
            handler.close()
            log.removeHandler(handler)
        logging.Logger.manager.loggerDict.pop(log.name, None)
    assert capsys.readouterr().err == ""
    writer = _metrics_writer(tmp_path)
    with pytest.raises(OSError) as failed:
        _log(writer, [1])
    assert failed.value.errno == errno.ENOSPC and str(failed.value).endswith(f": '{tmp_path / 'metrics.jsonl'}'")


def test_a_rank_log_call_that_does_not_match_its_format_is_still_reported(tmp_path, capsys):
    """The rank log is silent about its file's failures (a full disk, above), not about meshlm's
    own: a line whose arguments do not fit its format is lost, so logging's report of it (naming
    the call) must still reach stderr."""
    import logging

    from meshlm.train.metrics import rank_logger

    log = rank_logger(tmp_path, 0)
    try:
        log.info("step %d loss %.5f", 3)  # one argument short
    finally:
        for handler in log.handlers:
            handler.close()
            log.removeHandler(handler)
        logging.Logger.manager.loggerDict.pop(log.name, None)
    err = capsys.readouterr().err
    assert "--- Logging error ---" in err and "not enough arguments for format string" in err, err
