"""The flight-recorder records of several ranks' dumps, lined up: which ordered stream (a group's
collectives, one direction of point-to-point) each record belongs to, and where a rank was. Shared
by the verdicts of debug/analyze.py and debug/hang.py.
"""

from __future__ import annotations

from pathlib import Path


def channel(record: dict, me: int) -> tuple:
    """The ordered stream a record belongs to, named the same way on every rank that shares it."""
    if record["op"] == "send":
        return ("p2p", me, record["peer"])
    if record["op"] == "recv":
        return ("p2p", record["peer"], me)
    return ("group", record["axis"])


def streams(dumps: dict[int, dict]) -> dict[tuple, dict[int, dict[int, dict]]]:
    """(group key) -> rank -> seq -> record. A group key is ('group', label, ranks) or
    ('p2p', sender, receiver)."""
    out: dict[tuple, dict[int, dict[int, dict]]] = {}
    for rank, dump in dumps.items():
        groups = dump.get("groups", {})
        for rec in dump.get("records", []):
            ch = channel(rec, rank)
            key = ch if ch[0] == "p2p" else ("group", ch[1], tuple(groups.get(ch[1], ())))
            out.setdefault(key, {}).setdefault(rank, {})[rec["seq"]] = rec
    return out


def members(key: tuple) -> tuple[int, ...]:
    return key[2] if key[0] == "group" else (key[1], key[2])


def label(key: tuple) -> str:
    return f"{key[1]} {list(key[2])}" if key[0] == "group" else f"p2p {key[1]}->{key[2]}"


def signature(rec: dict) -> str:
    op = "send/recv" if rec["op"] in ("send", "recv") else rec["op"]
    return f"{op} [{rec['numel']}] {rec['dtype']}"


def entered(by_rank: dict[int, dict[int, dict]], rank: int) -> int:
    return max(by_rank.get(rank, {}), default=-1)


def pending(dump: dict) -> list[dict]:
    """The ops a rank had started and not finished when it dumped."""
    return [r for r in dump.get("records", []) if r.get("t_end") is None]


def where(dump: dict | None) -> str:
    """Where the rank's main thread was, e.g. 'in before_step (faults.py:NN)': the innermost
    meshlm frame of the exception's traceback, or of the main thread's stack for a timeout."""
    if not dump:
        return "left no dump"
    frames = (dump.get("error") or {}).get("traceback") or next(
        (f for name, f in dump.get("stacks", {}).items() if name.startswith("MainThread")), [])
    heads = [line.strip().splitlines()[0] for line in frames if line.strip().startswith("File ")]
    ours = [h for h in heads if "/meshlm/" in h and "/meshlm/comm/" not in h] or heads  # the op's caller
    if ours:
        parts = ours[-1].replace('"', "").replace(",", "").split()  # File PATH line N in FUNC
        if len(parts) >= 6:
            return f"in {parts[5]} ({Path(parts[1]).name}:{parts[3]})"
    return f"in the {dump.get('phase')} phase"
