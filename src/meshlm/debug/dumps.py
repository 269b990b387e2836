"""What a rank leaves in `run.dir/debug/` when a run goes wrong: one JSON file per rank, read by
`meshlm debug analyze` (debug/analyze.py).

Each dump holds why it was written (`reason`: timeout, error, oom, nonfinite), the rank's step and
phase, its flight-recorder ring (every recent collective with its per-group sequence number, shape
and whether it finished), the ranks of every group it used, the Python stacks of all its threads
and, for a failure, the exception. Files are written to a temporary name and renamed, so a
reader never sees half a dump.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

DEBUG_DIR = "debug"


def debug_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / DEBUG_DIR


def thread_stacks() -> dict[str, list[str]]:
    """Every thread's Python stack, innermost frame last, by thread name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {f"{names.get(ident, 'thread')} ({ident})": traceback.format_stack(frame)
            for ident, frame in sys._current_frames().items()}


def write_dump(run_dir: Path | str, rank: int, world_size: int, reason: str, *, progress, comm,
               error: BaseException | None = None, **extra: Any) -> Path | None:
    """Write this rank's dump; returns its path, None if it could not be written (a full disk).
    Never raises (it runs while things are failing)."""
    path = debug_dir(run_dir) / f"rank{rank}.json"
    dump = {
        "rank": rank, "world_size": world_size, "reason": reason, "time": time.time(),
        "host": socket.gethostname(), "pid": os.getpid(),
        "step": progress.step if progress else None, "phase": progress.phase if progress else None,
        "groups": comm.groups() if comm else {}, "records": comm.recorder.dump() if comm else [],
        "stacks": thread_stacks(), **extra,
    }
    if error is not None:
        dump["error"] = {"type": type(error).__name__, "message": str(error).strip().splitlines()[0][:500]
                         if str(error).strip() else "",
                         "traceback": traceback.format_exception(type(error), error, error.__traceback__)}
    tmp = path.with_suffix(".json.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(dump, default=str))
        os.replace(tmp, path)
    except OSError as e:
        print(f"meshlm: rank {rank}: could not write {path}: {e}", file=sys.stderr, flush=True)
        try:
            tmp.unlink(missing_ok=True)  # a partial dump frees its space and is never read
        except OSError:
            pass
        return None
    return path


DUMP_NAME = re.compile(r"rank(\d+)\.json")
RECORD_KEYS = ("seq", "op", "numel", "dtype", "t_start")  # and axis, or peer for send/recv


def read_dumps(run_dir: Path | str, notes: list[str] | None = None) -> dict[int, dict]:
    """rank -> its dump. Files that are not a dump of this layout (another tool's, a hand-edited
    one, an older meshlm's) are skipped, and so are records without the keys the analysis compares,
    each with a line in `notes`, so the analysis of the rest goes on."""
    out = {}
    for path in sorted(debug_dir(run_dir).glob("rank*.json")):
        if not (m := DUMP_NAME.fullmatch(path.name)):
            continue  # rank0.json's neighbours: rank_notes.json, rank1.old.json, ...
        try:
            dump = json.loads(path.read_text())
        except (OSError, ValueError):  # half-written (a rank stopped while writing)
            continue
        missing = [k for k in ("rank", "world_size", "reason") if not isinstance(dump, dict) or k not in dump]
        if missing or not isinstance(dump["world_size"], int) or dump["rank"] != int(m[1]):
            _note(notes, f"{path}: not a meshlm dump (no {', '.join(missing) or 'matching rank or world_size'}): skipped")
            continue
        dump["records"] = usable_records(dump.get("records"), path, notes)
        dump["groups"] = dump["groups"] if isinstance(dump.get("groups"), dict) else {}
        out[dump["rank"]] = dump
    return out


def usable_records(records, source, notes: list[str] | None) -> list[dict]:
    """The records that have what the analysis compares; the rest noted and left out."""
    records = records if isinstance(records, list) else []
    good = [r for r in records if isinstance(r, dict) and all(k in r for k in RECORD_KEYS)
            and ("peer" if r["op"] in ("send", "recv") else "axis") in r and isinstance(r["seq"], int)]
    if len(good) < len(records):
        _note(notes, f"{source}: {len(records) - len(good)} record(s) without seq, op, numel, dtype, "
                     f"t_start, axis (or peer): skipped")
    return good


def _note(notes: list[str] | None, line: str) -> None:
    if notes is not None:
        notes.append(line)


def clear_dumps(run_dir: Path | str) -> None:
    """A new run's dumps and communication logs must not be read together with an earlier run's
    (one of more ranks, or that failed otherwise): `meshlm debug analyze` compares all it finds."""
    for path in [*debug_dir(run_dir).glob("rank*.json*"), *(Path(run_dir) / "logs").glob("comm_rank*.jsonl")]:
        path.unlink(missing_ok=True)


def wait_for_peers(run_dir: Path | str, world_size: int, grace_s: float) -> None:
    """Give the other ranks' watchdogs a moment to dump before this rank exits: once one rank
    exits, torchrun stops the rest, and a rank stopped before its dump leaves no trace."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if len(list(debug_dir(run_dir).glob("rank*.json"))) >= world_size:
            return
        time.sleep(0.05)
