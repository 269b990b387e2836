"""Stragglers: the rank that makes every other rank wait.

Reduces: a job running at the speed of its slowest rank without anyone knowing which, to a metrics
row that names the slowest and fastest rank of every step and a warning when one rank stays slow.
Costs: nothing extra: each rank's own working time (its step time minus the host time it spent
blocked in communication, which is where a fast rank waits for a slow one) rides in the small
per-step gather the trainer already makes for peak memory and stop signals.

On CUDA the blocked time is the host's: NCCL kernels queue without blocking, so a GPU-side
straggler shows up only where the host waits (the step's synchronisation).
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

    def observe(self, step: int, busy_s: list[float]) -> dict:
        """busy_s[r]: rank r's working time in this step. Returns the row's straggler fields."""
        slowest = max(range(len(busy_s)), key=busy_s.__getitem__)
        fastest = min(range(len(busy_s)), key=busy_s.__getitem__)
        others = statistics.median(b for r, b in enumerate(busy_s) if r != slowest)
        if others > 0 and busy_s[slowest] > (1 + self.threshold) * others:
            self._streak = {slowest: self._streak.get(slowest, 0) + 1}
        else:
            self._streak = {}
        if self._streak.get(slowest, 0) >= self.patience and slowest not in self._warned:
            self._warned.add(slowest)
            self.warn(f"warning: straggler: rank {slowest} worked {busy_s[slowest] / others - 1:.0%} longer than "
                      f"the other ranks' median for {self.patience} steps (step {step}: {busy_s[slowest]:.3f} s vs "
                      f"{others:.3f} s); the others wait for it in every collective: check its device, node and load")
        return {"slowest_rank": slowest, "slowest_rank_s": busy_s[slowest],
                "fastest_rank": fastest, "fastest_rank_s": busy_s[fastest]}
