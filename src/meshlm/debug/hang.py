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


def _wait_for(stuck: list[tuple]) -> dict[int, dict[int, tuple]]:
    """The wait-for graph: rank -> {rank it waits for: (key, seq, op) it waits in}. A rank waits
    on nothing when it is in no collective, or all it waits in holds every member (or left no dump)."""
    graph: dict[int, dict[int, tuple]] = {}
    for _, key, seq, op, waiters, absent in stuck:
        for w in waiters:
            for a in absent:
                graph.setdefault(w, {}).setdefault(a, (key, seq, op))
    return graph


def _reachable(graph: dict[int, dict[int, tuple]], start: list[int]) -> list[int]:
    seen, todo = set(start), list(start)
    while todo:
        for nxt in graph.get(todo.pop(), {}):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return sorted(seen)


def _cycle(graph: dict[int, dict[int, tuple]], start: int) -> list[int]:
    """Follow the lowest rank waited for until one repeats: every rank on the way waits on someone."""
    path = [start]
    while (nxt := min(graph[path[-1]])) not in path:
        path.append(nxt)
    cycle = path[path.index(nxt):]
    first = cycle.index(min(cycle))  # told from its lowest rank on
    return cycle[first:] + cycle[:first]


def find_hang(dumps: dict[int, dict]) -> dict | None:
    """The ranks the first stuck group waits for, followed through the wait-for graph to those that
    wait on nothing (the roots: the hang's cause). When every rank reached waits on another, no rank
    is the root: they wait on each other in a cycle (collectives called in different orders)."""
    stuck = _stuck_groups(dumps) or _behind_groups(dumps)
    if not stuck:
        return None
    _, key, seq, op, waiters, absent = stuck[0]
    graph = _wait_for(stuck)
    step = max((d.get("step") or 0) for d in dumps.values()) + 1
    roots = [r for r in _reachable(graph, absent) if not graph.get(r)]
    if not roots:
        return _deadlock(graph, _cycle(graph, absent[0]), step)
    culprits, root = roots, roots[0]
    waited = max((dumps[w].get("idle_s") or 0) for w in waiters) if waiters else 0
    chain = "" if roots == absent else f" (which wait on rank{'s' if len(roots) > 1 else ''} {', '.join(map(str, roots))})"
    line = (f"hang: {_never(key, seq, op, absent)} at step {step}{chain}; rank{'s' if len(waiters) > 1 else ''} "
            f"{', '.join(map(str, waiters))} waited in it {waited:.1f} s; rank {root} was {where(dumps.get(root))}")
    return {"verdict": "hang", "ranks": culprits, "group": key[1] if key[0] == "group" else "p2p",
            "group_ranks": list(members(key)), "seq": seq, "op": op, "step": step, "line": line}


def _never(key: tuple, seq: int, op: str, absent: list[int]) -> str:
    """What the absent ranks never did, by their own op: a point-to-point peer never posted its
    half (a receive where the waiter sends), not "entered the send"."""
    if key[0] == "p2p" and len(absent) == 1:
        sender, receiver = key[1], key[2]
        mine = f"receive from rank {sender}" if absent[0] == receiver else f"send to rank {receiver}"
        return f"rank {absent[0]} never posted the {mine} #{seq} (p2p {sender}->{receiver}; rank " \
               f"{sender if absent[0] == receiver else receiver} waits in its {op})"
    return (f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))} never entered collective #{seq} "
            f"({op} on {label(key)})")


def _deadlock(graph: dict[int, dict[int, tuple]], cycle: list[int], step: int) -> dict:
    waits = []
    for i, rank in enumerate(cycle):
        nxt = cycle[(i + 1) % len(cycle)]
        key, seq, op = graph[rank][nxt]
        waits.append(f"rank {rank} waits in {op} #{seq} on {label(key)} for rank {nxt}")
    key, seq, op = graph[cycle[0]][cycle[1 % len(cycle)]]
    line = (f"deadlock: ranks {', '.join(map(str, sorted(cycle)))} wait on each other at step {step}, each in a "
            f"collective the next has not reached: {'; '.join(waits)}; no rank is behind the others: the ranks "
            f"call the collectives of their groups in different orders")
    return {"verdict": "deadlock", "ranks": sorted(cycle), "group": key[1] if key[0] == "group" else "p2p",
            "group_ranks": list(members(key)), "seq": seq, "op": op, "step": step, "line": line}
