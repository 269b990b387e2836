"""train/metrics.py on its own: the human line of a step and its byte counts against strings
written out by hand, metrics.jsonl's nulls and resume rules, the progress bar on a terminal and
TensorBoard's scalars (through stand-ins: neither a terminal nor TensorBoard is there in tests)."""

import io
import json
import math
import sys
import types

import pytest

from meshlm.train.metrics import MetricsWriter, format_bytes, format_step, jsonable


def _row(step, **extra):
    return {"step": step, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1234.5, "step_time_s": 1.0,
            "tflops": 1.0, **extra}


def _steps(run_dir):
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("n, text", [(None, "n/a"), (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                     (5 * 2**20, "5.0 MiB"), (2**40, "1.0 TiB"), (3 * 2**50, "3072.0 TiB"),
                                     (-2048, "-2.0 KiB")])
def test_bytes_are_written_in_the_largest_unit_below_1024_of_it(n, text):
    assert format_bytes(n) == text


def test_a_steps_line_holds_every_field_and_says_what_is_missing():
    full = _row(12, loss=3.14159, eval_loss=3.5, lr=3e-4, grad_norm=0.5, tokens_per_s=12345.6, step_time_s=0.25,
                tflops=1.5, mfu=0.4321, mem_peak_bytes=3 * 2**30)
    assert format_step(full) == ("step    12 | loss 3.1416 | eval 3.5000 | lr 3.00e-04 | gnorm 0.500 | 12,346 tok/s | "
                                 "250 ms | 1.500 TFLOP/s | MFU 43.2% | mem 3.0 GiB")
    assert format_step(_row(7, mfu=None, eval_loss=None)) == (
        "step     7 | loss 1.0000 | lr 1.00e-03 | gnorm 1.000 | 1,234 tok/s | 1000 ms | 1.000 TFLOP/s | MFU n/a | "
        "mem n/a")


def test_non_finite_numbers_are_written_as_null(tmp_path):
    assert jsonable({"a": math.nan, "b": math.inf, "c": -math.inf, "d": 1.5, "e": 3, "f": "x", "g": None}) == \
        {"a": None, "b": None, "c": None, "d": 1.5, "e": 3, "f": "x", "g": None}
    writer = MetricsWriter(tmp_path, total_steps=1, log_interval=1, active=True, stream=io.StringIO())
    writer.log_step(_row(1, loss=math.nan, grad_norm=math.inf))
    writer.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["loss"] is None and row["grad_norm"] is None and row["lr"] == 1e-3


def test_a_writer_of_another_rank_writes_and_prints_nothing(tmp_path):
    stream = io.StringIO()
    writer = MetricsWriter(tmp_path, total_steps=4, log_interval=1, active=False, stream=stream)
    writer.resume_at(2)
    writer.log_step(_row(3))
    writer.print("hello")
    writer.close()
    assert list(tmp_path.iterdir()) == [] and stream.getvalue() == ""


def test_a_writer_closed_before_its_first_row_closes_cleanly(tmp_path):
    writer = MetricsWriter(tmp_path, total_steps=4, log_interval=1, active=True, stream=io.StringIO())
    writer.close()  # a run that failed before its first step
    writer = MetricsWriter(tmp_path, total_steps=4, log_interval=1, active=True, stream=io.StringIO())
    writer.log_step(_row(1))
    jsonl = writer._jsonl
    writer.close()
    assert jsonl.closed


def test_the_checkpoints_row_is_taken_only_for_its_own_step_and_only_if_missing(tmp_path):
    """A run killed between a checkpoint's save and logging its row: the row comes from the
    checkpoint (worker.py), for that step only, never replacing a row the file holds."""
    def start(rows):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in rows))
        return MetricsWriter(tmp_path, total_steps=8, log_interval=1, active=True, stream=io.StringIO())

    for rows, step, row, expected in [
            ([1, 2, 3], 4, {"step": 4, "loss": 4.0}, [(1, 1.0), (2, 1.0), (3, 1.0), (4, 4.0)]),  # killed before the row
            ([1, 2, 3], 3, {"step": 3, "loss": 9.0}, [(1, 1.0), (2, 1.0), (3, 1.0)]),  # the file's row stays
            ([1, 2, 3], 4, {"step": 2, "loss": 9.0}, [(1, 1.0), (2, 1.0), (3, 1.0)])]:  # another step's: not taken
        writer = start(rows)
        writer.resume_at(step, row)
        writer.close()
        assert _steps(tmp_path) == expected, (step, row)


def test_every_unreadable_line_is_dropped_and_the_rows_after_it_kept(tmp_path):
    """Zeros where a power loss left blocks unwritten need not be the file's end: each unreadable
    line is dropped and counted, the rows after it kept."""
    good = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)]
    lines = [good[0], "\0" * 10, good[1], '{"step": 3, "lo', *good[2:]]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    writer = MetricsWriter(tmp_path, total_steps=8, log_interval=1, active=True, stream=io.StringIO())
    writer.resume_at(4)
    writer.close()
    assert _steps(tmp_path) == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0)]
    assert writer.stream.getvalue() == f"warning: {tmp_path / 'metrics.jsonl'}: dropped 2 lines cut off mid-row " \
                                       f"(a crash while it was written)\n"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_a_bar_shows_the_loss_and_throughput(tmp_path):
    stream = _Terminal()
    writer = MetricsWriter(tmp_path, total_steps=3, log_interval=2, active=True, stream=stream)
    writer.log_step(_row(1))
    first = stream.getvalue()
    writer.log_step(_row(2, eval_loss=2.5))
    writer.log_step(_row(3))
    writer.close()
    assert "loss 1.000 1,234 tok/s" in first and "eval" not in first
    assert "loss 1.000 eval 2.500 1,234 tok/s" in stream.getvalue() and "3/3" in stream.getvalue().splitlines()[-1]


def test_tensorboard_gets_every_number_but_the_step_at_its_step(tmp_path, monkeypatch):
    written = []

    class SummaryWriter:
        def __init__(self, log_dir):
            written.append(("dir", log_dir))

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def close(self):
            written.append("closed")

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    writer = MetricsWriter(tmp_path, total_steps=3, log_interval=1, active=True, stream=io.StringIO())
    writer.log_step(_row(3, mfu=None, note="x", ranks=2))
    writer.close()
    assert written == [("dir", str(tmp_path / "tensorboard")), ("train/loss", 1.0, 3), ("train/lr", 1e-3, 3),
                       ("train/grad_norm", 1.0, 3), ("train/tokens_per_s", 1234.5, 3), ("train/step_time_s", 1.0, 3),
                       ("train/tflops", 1.0, 3), ("train/ranks", 2, 3), "closed"]


def test_on_a_terminal_the_shown_steps_and_notes_are_lines_of_the_writers_stream(tmp_path, capsys):
    """tqdm.write prints to sys.stdout unless told the file: the shown steps and print()'s notes
    went there, not to the stream the writer and its bar were given."""
    stream = _Terminal()
    writer = MetricsWriter(tmp_path, total_steps=3, log_interval=2, active=True, stream=stream)
    for row in (_row(1), _row(2, eval_loss=2.5), _row(3)):
        writer.log_step(row)
    writer.print("a note")
    writer.close()
    lines = stream.getvalue().replace("\r", "\n").splitlines()
    assert format_step(_row(2, eval_loss=2.5)) in lines and format_step(_row(3)) in lines and "a note" in lines
    assert format_step(_row(1)) not in lines  # the bar stands for the steps not shown
    assert capsys.readouterr().out == ""
