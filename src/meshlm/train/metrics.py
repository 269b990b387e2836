"""Where a run's numbers go: `metrics.jsonl` (the contract other tools read), a progress bar on a
terminal or plain lines in a log, TensorBoard when it is installed, and one log file per rank.

Only global rank 0 writes metrics and prints; every rank writes `logs/rank{N}.log`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from meshlm.errors import naming


def rank_logger(run_dir: Path, rank: int) -> logging.Logger:
    """A logger writing to `run_dir/logs/rank{rank}.log` (and to stderr on rank 0 for warnings)."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"meshlm.rank{rank}.{run_dir.resolve()}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not logger.handlers:
        handler = _RankLogHandler(log_dir / f"rank{rank}.log", mode="w")
        handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(message)s"))
        logger.addHandler(handler)
    return logger


class _RankLogHandler(logging.FileHandler):
    """A rank's log file that a full disk does not turn into logging's "--- Logging error ---"
    traceback on stderr for every line, on every rank: the failure is said once, by the metrics
    row or checkpoint write that fails next (a rank log repeats what those hold)."""

    def handleError(self, record) -> None:
        # Only the file's own failures: a call whose arguments do not match its format is a bug
        # in meshlm, which logging's traceback names (the line is lost either way).
        if not isinstance(sys.exc_info()[1], OSError):
            super().handleError(record)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # its last flush, onto the full disk
            pass


def format_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def format_step(row: dict[str, Any]) -> str:
    """One human line per logged step."""
    parts = [f"step {row['step']:>5}", f"loss {row['loss']:.4f}"]
    if row.get("eval_loss") is not None:
        parts.append(f"eval {row['eval_loss']:.4f}")
    parts += [f"lr {row['lr']:.2e}", f"gnorm {row['grad_norm']:.3f}",
              f"{row['tokens_per_s']:,.0f} tok/s", f"{row['step_time_s'] * 1000:.0f} ms",
              f"{row['tflops']:.3f} TFLOP/s",
              "MFU n/a" if row.get("mfu") is None else f"MFU {100 * row['mfu']:.1f}%",
              f"mem {format_bytes(row.get('mem_peak_bytes'))}"]
    return " | ".join(parts)


class MetricsWriter:
    """Rank 0's sink for per-step metrics. Other ranks get an instance that writes nothing."""

    def __init__(self, run_dir: Path, total_steps: int, log_interval: int, active: bool, stream=None) -> None:
        self.active = active
        self.log_interval = log_interval
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self._jsonl = None
        self._bar = None
        self._tb = None
        if not active:
            return
        # metrics.jsonl stays as it is until this run knows whether it resumes: resume_at keeps its
        # rows up to the checkpoint, or the first row of a fresh run replaces them. Moving it aside
        # here lost the history: a start killed before resume_at left it in metrics.jsonl.old, and
        # the next start moved its own empty file over that.
        self.path = run_dir / "metrics.jsonl"
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, file=self.stream, dynamic_ncols=True, unit="step")
        try:  # TensorBoard is optional: use it when the user has it.
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            self._tb = None

    def resume_at(self, step: int, row: dict[str, Any] | None = None) -> None:
        """Continue the metrics of a run resumed after `step`: rows up to it are kept, rows past it
        (logged before a crash, after the checkpoint) dropped, new rows appended: every step once.
        `row`: step `step`'s row as its checkpoint holds it, for a run killed between the save and
        logging the row (which holds the save's duration, so comes after it)."""
        if not self.active:
            return
        if self._jsonl is not None:
            self._jsonl.close()
        rows, cut = {}, 0  # step -> line; metrics.jsonl.old first: left by an interrupted start of an older meshlm
        for path in (self._old, self.path):
            if path.exists():
                for line in path.read_text(errors="replace").splitlines():
                    if not line.strip():
                        continue
                    try:
                        parsed = json.loads(line)
                    except ValueError:
                        parsed = None
                    if not isinstance(parsed, dict):  # a row cut off by a crash (a full disk; zeros
                        cut += 1  # after a power loss); what is left of one may parse, e.g. "125"
                        continue
                    if (row_step := parsed.get("step", 0)) <= step:
                        rows[row_step] = line  # a step logged twice: the later timeline's row
        if cut:
            self.print(f"warning: {self.path}: dropped {cut} line{'s' if cut > 1 else ''} cut off mid-row (a crash "
                       f"while it was written)")
        if row is not None and row.get("step") == step and step not in rows:
            rows[step] = json.dumps(row)
        tmp = self.path.with_suffix(".jsonl.tmp")
        with naming(tmp):
            tmp.write_text("".join(rows[k] + "\n" for k in sorted(rows)))
        os.replace(tmp, self.path)  # a kill leaves the old file or the new one, never neither
        self._old.unlink(missing_ok=True)
        self._jsonl = open(self.path, "a", buffering=1)

    @property
    def _old(self) -> Path:
        return self.path.with_suffix(".jsonl.old")

    def log_step(self, row: dict[str, Any]) -> None:
        if not self.active:
            return
        if self._jsonl is None:  # a fresh run's first row: earlier rows are another timeline's
            self._jsonl = open(self.path, "w", buffering=1)
            self._old.unlink(missing_ok=True)
        with naming(self.path):  # a full disk: which file
            self._jsonl.write(json.dumps(jsonable(row)) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step" and value is not None:
                    self._tb.add_scalar(f"train/{key}", value, row["step"])
        if self._bar is not None:
            self._bar.update(1)
            postfix = f"loss {row['loss']:.3f}" + (f" eval {row['eval_loss']:.3f}" if row.get("eval_loss") else "")
            self._bar.set_postfix_str(postfix + f" {row['tokens_per_s']:,.0f} tok/s")
            if self._shown(row):
                self._bar.write(format_step(row), file=self.stream)  # tqdm.write's default: sys.stdout
        elif self._shown(row) or row["step"] == 1:
            print(format_step(row), file=self.stream, flush=True)

    def _shown(self, row: dict[str, Any]) -> bool:
        """Every log_interval-th step, an evaluated one, and the last (its loss is the run's result)."""
        step = row["step"]
        return step % self.log_interval == 0 or step == self.total_steps or row.get("eval_loss") is not None

    def print(self, text: str) -> None:
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf are not JSON: write them as null so every line stays parseable."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
