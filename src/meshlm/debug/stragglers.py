"""Stragglers: the rank that makes every other rank wait.

Reduces: a job running at the speed of its slowest rank without anyone knowing which, to a metrics
row that names the slowest and fastest rank of every step and a warning when one rank stays slow.
Costs: nothing extra: each rank's own working time (its step time minus the host time it spent
blocked in communication, which is where a fast rank waits for a slow one) rides in the small
per-step gather the trainer already makes for peak memory and stop signals.

On CUDA the blocked time is the host's: NCCL kernels queue without blocking, so a GPU-side
straggler shows up only where the host waits (the step's synchronisation).

A rank is compared with the ranks that do the same work (`peers`: one pipeline stage's ranks):
the last stage, which also runs the head and the loss, is slower than the first by design, not
a straggler; a stage run by one rank alone has nobody to be compared with.
"""

from __future__ import annotations

import statistics


class StragglerDetector:
    def __init__(self, threshold: float, patience: int = 3, warn=print) -> None:
        self.threshold = threshold  # slower than the median of the other ranks by this fraction
        self.patience = patience  # ... on this many consecutive steps
        self.warn = warn
        self._streak: dict[int, int] = {}
        self._warned: set[int] = set()

    def observe(self, step: int, busy_s: list[float], peers: list[list[int]] | None = None) -> dict:
        """busy_s[r]: rank r's working time in this step; `peers`: groups of ranks doing the same
        work (default: all). Returns the row's straggler fields (slowest and fastest of all)."""
        slowest = max(range(len(busy_s)), key=busy_s.__getitem__)
        fastest = min(range(len(busy_s)), key=busy_s.__getitem__)
        # the rank furthest above the median of its own peers
        group_of = {r: g for g in (peers or [list(range(len(busy_s)))]) for r in g}
        ratios = {}
        for r, b in enumerate(busy_s):
            others = [busy_s[q] for q in group_of[r] if q != r]
            median = statistics.median(others) if others else 0
            if median > 0:
                ratios[r] = (b / median, median)
        suspect = max(ratios, key=lambda r: ratios[r][0]) if ratios else None
        if suspect is not None and ratios[suspect][0] > 1 + self.threshold:
            self._streak = {suspect: self._streak.get(suspect, 0) + 1}
        else:
            self._streak = {}
        if suspect is not None and self._streak.get(suspect, 0) >= self.patience and suspect not in self._warned:
            self._warned.add(suspect)
            ratio, others = ratios[suspect]
            self.warn(f"warning: straggler: rank {suspect} worked {ratio - 1:.0%} longer than the median of the "
                      f"ranks doing its work for {self.patience} steps (step {step}: {busy_s[suspect]:.3f} s vs "
                      f"{others:.3f} s); the others wait for it in every collective: check its device, node and load")
        return {"slowest_rank": slowest, "slowest_rank_s": busy_s[slowest],
                "fastest_rank": fastest, "fastest_rank_s": busy_s[fastest]}
