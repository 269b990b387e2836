"""`meshlm debug analyze RUN_DIR`: what went wrong, in one line, from the ranks' dumps.

Reduces: reading N flight-recorder rings side by side to one verdict naming the culprit rank and
collective. Costs: nothing during training (it reads what the watchdog and the failure reports
wrote to run.dir/debug/, or the recorder files of a finished run in run.dir/logs/).

Every collective carries a per-group sequence number (comm/recorder.py): on every rank of a
group, the k-th collective on that group is #k. So, comparing the ranks of one group:
- desync: at the same #k, ranks called different ops, shapes or dtypes;
- hang: some rank waits in #k that another rank of the group never entered; the culprit is the
  rank that never entered it (followed through other groups to the ranks waiting in none);
  deadlock: every rank reached waits on another, in a cycle (debug/hang.py);
- a rank's own failure (oom, nonfinite, error) is the cause when no desync explains it; ranks
  that only lost their peer ("connection closed") are its consequence.
Point-to-point ops pair rank A's "send to B" #k with B's "receive from A" #k.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from meshlm.debug.dumps import read_dumps, usable_records
from meshlm.debug.hang import find_hang
from meshlm.debug.streams import label, members, pending, signature, streams, where

OWN_FAILURES = ("oom", "nonfinite", "desync", "error")
LOG_NAME = re.compile(r"comm_rank(\d+)\.jsonl")


def told_culprits(dumps: dict[int, dict]) -> list[int] | None:
    """The odd ranks as the step-end fingerprint check found them (debug/fingerprint.py): an
    all-gather over every rank, so it stands even when some ranks' dumps are missing (stopped by
    torchrun before writing) and a vote over the dumps present would blame an innocent rank."""
    told = [d for d in dumps.values() if d.get("reason") == "desync" and d.get("culprits")]
    return sorted(min(told, key=lambda d: d.get("time", 0))["culprits"]) if told else None


def find_desync(dumps: dict[int, dict]) -> dict | None:
    culprits = told_culprits(dumps)
    found = []
    for key, by_rank in streams(dumps).items():
        seqs = sorted(set().union(*(set(s) for s in by_rank.values())))
        for seq in seqs:
            calls = {r: s[seq] for r, s in by_rank.items() if seq in s}
            if len(calls) < 2 or len({signature(c) for c in calls.values()}) == 1:
                continue
            counts = Counter(signature(c) for c in calls.values())
            top, n = counts.most_common(1)[0]
            tie = list(counts.values()).count(n) > 1
            odd = sorted(calls) if tie else sorted(r for r, c in calls.items() if signature(c) != top)
            if culprits is not None:  # the fingerprint's verdict over every rank outranks a vote of the dumps here
                odd = sorted(set(culprits) & set(calls))
                if not odd:
                    break  # a difference that involves no culprit is a consequence: look at other groups
            t0 = min(c["t_start"] for c in calls.values())
            found.append((t0, key, seq, calls, odd))
            break  # later numbers of this group only repeat the shift
    if not found:
        return None
    _, key, seq, calls, odd = min(found, key=lambda f: f[0])
    what = "; ".join(f"rank {r}: {signature(c)}" for r, c in sorted(calls.items()))
    names = ", ".join(map(str, odd))
    return {"verdict": "desync", "ranks": odd, "group": key[1] if key[0] == "group" else "p2p",
            "group_ranks": list(members(key)), "seq": seq, "op": calls[odd[0]]["op"],
            "line": f"desync: at collective #{seq} on {label(key)}, rank{'s' if len(odd) > 1 else ''} {names} "
                    f"called something else than {'each other' if len(odd) == len(calls) else 'the others'} ({what})"}


def find_failure(dumps: dict[int, dict]) -> dict | None:
    own = [d for d in dumps.values() if d.get("reason") in OWN_FAILURES]
    if not own:
        return None
    first = min(own, key=lambda d: d.get("time") or 0)
    kind = first["reason"]
    ranks = sorted(first.get("culprits") or [first["rank"]])
    report = first.get("report") or [first.get("error", {}).get("message", "")]
    if kind == "error":  # the exception's own traceback: where the bug is
        report = [report[0], *(line.rstrip() for line in (first.get("error") or {}).get("traceback", [])[-8:])]
    waits = pending(first)
    return {"verdict": kind, "ranks": ranks, "group": waits[0]["axis"] if waits else None,
            "seq": waits[0]["seq"] if waits else None, "op": waits[0]["op"] if waits else None,
            "step": (first.get("step") or 0) + 1, "phase": first.get("phase"), "line": f"{kind}: {report[0]}",
            "details": report[1:]}


def analyze(run_dir: Path | str) -> dict:
    """The verdict for a run directory: a dict with verdict, line, ranks, group, seq, op (and more)."""
    run_dir = Path(run_dir)
    notes: list[str] = []  # files and records skipped as unreadable: said, not a traceback
    dumps = read_dumps(run_dir, notes)
    if not dumps:
        return _noted(analyze_finished(run_dir, notes), notes)
    world = max(d["world_size"] for d in dumps.values())
    missing = sorted(set(range(world)) - set(dumps))
    here = _dir_ranks(dumps, world)
    away = [r for r in missing if r not in here]  # their dumps are in another node's run.dir
    missing = [r for r in missing if r in here]
    lost = [r for r, d in dumps.items() if d.get("reason") == "peer_lost"]
    died = (missing or away) and len(lost) == len(dumps)  # ranks gone without a word here, the rest found them gone
    result = find_desync(dumps) or find_failure(dumps) or (None if died else find_hang(dumps))
    if result is None:
        if missing:
            result = {"verdict": "crash", "ranks": missing, "line": f"crash: rank{'s' if len(missing) > 1 else ''} "
                      f"{', '.join(map(str, missing))} died without a report (killed, or a native crash); "
                      f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} lost {'their' if len(lost) > 1 else 'its'} peer"}
        elif away:
            # this node's ranks lost their peers, or stopped (a watchdog's timeout) waiting in no
            # collective of theirs: either way the cause is with the ranks of another node
            ranks = lost or sorted(dumps)
            what = ("lost " + ("their" if len(ranks) > 1 else "its") + " peer" if lost else
                    "stopped (" + ", ".join(sorted({dumps[r].get("reason", "?") for r in ranks})) + ") waiting on no rank here")
            result = {"verdict": "elsewhere", "ranks": away, "line": f"elsewhere: rank{'s' if len(ranks) > 1 else ''} "
                      f"{', '.join(map(str, ranks))} of this node {what} (the cause is on another node)"}
        else:
            result = {"verdict": "unknown", "ranks": sorted(dumps), "line": "unknown: every rank dumped, none waits "
                      "on another; see each rank's stacks in the dumps"}
    if away:  # never "died without a report": their node's run.dir holds their dumps
        result["line"] += (f"; rank{'s' if len(away) > 1 else ''} {_ranges(away)} left no dump here: "
                           f"{'they' if len(away) > 1 else 'it'} ran on another node: see its run.dir "
                           f"(meshlm debug analyze there)")
    result.setdefault("details", [])
    result.update(missing_dumps=missing, dumps=sorted(dumps), elsewhere=away)
    result["details"] = result["details"] + [_rank_line(d) for _, d in sorted(dumps.items())]
    if result.get("step") is None:
        result["step"] = max((d.get("step") or 0) for d in dumps.values()) + 1
    for key in ("group", "group_ranks", "seq", "op"):
        result.setdefault(key, None)
    return _noted(result, notes)


def _noted(result: dict, notes: list[str]) -> dict:
    result["notes"] = notes
    result["details"] = result["details"] + [f"note: {n}" for n in notes]
    return result


def _dir_ranks(dumps: dict[int, dict], world: int) -> set[int]:
    """The ranks whose dumps land in this run.dir: every rank, unless the nodes of a multi-node
    run each have their own run.dir (each dump then lists its run.dir's ranks, train/rank0_node.py)."""
    noted = [d.get("dir_ranks") for d in dumps.values() if d.get("dir_ranks") is not None]
    return set().union(*map(set, noted)) if noted else set(range(world))


def _ranges(ranks: list[int]) -> str:
    """'1, 3' or '4-7' (a node's ranks are usually consecutive)."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _rank_line(d: dict) -> str:
    waits = pending(d)
    inside = (f"waiting in {waits[0]['op']} #{waits[0]['seq']} on {waits[0]['axis']}" if waits
              else "in no collective")
    return (f"rank {d['rank']} ({d.get('host')}, pid {d.get('pid')}): {d['reason']} at step {(d.get('step') or 0) + 1} "
            f"({d.get('phase')}), {inside}, {where(d)}")


def analyze_finished(run_dir: Path, notes: list[str] | None = None) -> dict:
    """A run without dumps: compare the recorder files every rank wrote at the end."""
    ranks = {}
    for f in sorted((run_dir / "logs").glob("comm_rank*.jsonl")):
        if m := LOG_NAME.fullmatch(f.name):
            ranks[int(m[1])] = f
        elif notes is not None:  # a copy kept by hand (comm_rank1.old.jsonl): not this run's
            notes.append(f"{f}: not a recorder file name (comm_rankN.jsonl): skipped")
    files = list(ranks.values())
    if not files:
        return {"verdict": "none", "ranks": [], "group": None, "seq": None, "op": None, "step": None, "details": [],
                "line": f"nothing to analyze: no dumps in {run_dir / 'debug'} and no recorder files in {run_dir / 'logs'}"}
    world = _world_from_config(run_dir) or max(ranks) + 1  # not the number of files: one may be missing
    dumps = {}
    for rank, f in sorted(ranks.items()):
        records = []
        for line in filter(str.strip, f.read_text().splitlines()):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut off as the rank was killed: what came before stands
                break
        records = usable_records(records, f, notes)
        dumps[rank] = {"rank": rank, "records": records, "groups": _groups_from_config(run_dir, rank, records, world)}
    result = find_desync(dumps)
    missing = sorted(set(range(world)) - set(ranks))
    if result is None and missing:
        result = {"verdict": "incomplete", "ranks": missing, "group": None, "seq": None, "op": None,
                  "line": f"incomplete: no recorder file from rank{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(map(str, missing))} of {world} (killed before the end?); the other "
                          f"{len(ranks)} ranks' collectives agree"}
    elif result is None:
        result = {"verdict": "ok", "ranks": [], "group": None, "seq": None, "op": None,
                  "line": f"ok: {len(files)} ranks' collectives agree (no dump: nothing timed out or failed)"}
    result.update(step=None, details=[], dumps=[], missing_dumps=[], elsewhere=[])
    result.setdefault("group_ranks", None)
    return result


def _world_from_config(run_dir: Path) -> int | None:
    """dp*tp*cp*pp as the run's config.toml holds them (dp is written resolved), or None."""
    from meshlm.config import load_config

    try:
        p = load_config(str(run_dir / "config.toml")).parallel
        return p.dp * p.tp * p.cp * p.pp
    except Exception:  # no or unreadable config: the files then tell the world size
        return None


def _groups_from_config(run_dir: Path, rank: int, records: list[dict], world: int) -> dict[str, list[int]]:
    """Group members for a finished run's labels, from the layout in its config.toml."""
    from meshlm.config import load_config, resolve
    from meshlm.mesh import Layout, normalize_axes

    try:
        cfg = resolve(load_config(str(run_dir / "config.toml")), world_size=world)
        layout = Layout.from_config(cfg.parallel, world)
    except Exception:
        return {}
    groups = {}
    for axis in {r["axis"] for r in records if r["op"] not in ("send", "recv")}:
        try:
            groups[axis] = list(layout.group_of(rank, normalize_axes("world" if axis == "world" else axis.split("+"))))
        except ValueError:  # a label that is not an axis combination: compared by label alone
            continue
    return groups
