"""Hangs: which rank the others wait for, from the ranks' dumps (debug/analyze.py calls it).
"""

from __future__ import annotations

from meshlm.debug.streams import entered, label, members, streams, where


def _stuck_groups(dumps: dict[int, dict]) -> list[tuple]:
    """(start time, key, seq, op, waiting ranks, ranks that never entered) for each group where a
    rank waits in #k that a member never entered (or left no dump to say)."""
    out = []
    for key, by_rank in streams(dumps).items():
        for rank, seqs in by_rank.items():
            waiting = [rec for rec in seqs.values() if rec.get("t_end") is None]
            if not waiting:
                continue
            first = min(waiting, key=lambda rec: rec["seq"])
            k = first["seq"]
            absent = [m for m in members(key) if m != rank and (m not in dumps or entered(by_rank, m) < k)]
            if absent:
                waiters = [r for r, s in by_rank.items() if k in s and s[k].get("t_end") is None]
                out.append((first["t_start"], key, k, first["op"], waiters, absent))
    return sorted(out, key=lambda x: x[0])


def _behind_groups(dumps: dict[int, dict]) -> list[tuple]:
    """The same tuples, for dumps in which no rank is inside a collective: on a GPU every record is
    finished once its op is queued (the stream waits, not the host, which blocks later, reading a
    result). There a hang shows as a group whose members reached different numbers: those ahead
    queued #k and their streams wait in it; those behind never issued it."""
    out = []
    for key, by_rank in streams(dumps).items():
        if key[0] != "group":
            continue
        reached = {m: entered(by_rank, m) for m in members(key)}  # -1: no record, or no dump
        top = max(reached.values())
        behind = [m for m, k in reached.items() if k < top]
        if behind:
            ahead = [m for m, k in reached.items() if k == top]
            first = by_rank[ahead[0]][top]
            out.append((first["t_start"], key, top, first["op"], ahead, behind))
    return sorted(out, key=lambda x: x[0])


def find_hang(dumps: dict[int, dict]) -> dict | None:
    stuck = _stuck_groups(dumps) or _behind_groups(dumps)
    if not stuck:
        return None
    _, key, seq, op, waiters, absent = stuck[0]
    culprits = absent
    seen = set(culprits)
    for _ in range(len(dumps)):  # follow a culprit that itself waits on someone else
        nxt = [s for s in stuck if set(s[4]) & set(culprits) and not set(s[5]) <= seen]
        if not nxt:
            break
        culprits = [r for r in nxt[0][5] if r not in seen] or culprits
        seen |= set(culprits)
    step = max((d.get("step") or 0) for d in dumps.values()) + 1
    root = culprits[0]
    waited = max((dumps[w].get("idle_s") or 0) for w in waiters) if waiters else 0
    chain = "" if culprits == absent else f" (which wait on rank{'s' if len(culprits) > 1 else ''} {', '.join(map(str, culprits))})"
    line = (f"hang: rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} never entered collective #{seq} "
            f"({op} on {label(key)}) at step {step}{chain}; rank{'s' if len(waiters) > 1 else ''} "
            f"{', '.join(map(str, waiters))} waited in it {waited:.1f} s; rank {root} was {where(dumps.get(root))}")
    return {"verdict": "hang", "ranks": culprits, "group": key[1] if key[0] == "group" else "p2p",
            "group_ranks": list(members(key)), "seq": seq, "op": op, "step": step, "line": line}
