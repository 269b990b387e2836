"""Where a rank is: its step and phase, written by the trainer, read by the watchdog and the failure
reports (a hang or an OOM is explained by "step 7, backward" as much as by any stack).

Costs: an attribute write per phase change; nothing is measured.
"""

from __future__ import annotations

import time

PHASES = ("setup", "forward", "backward", "optimizer", "eval", "checkpoint", "gather", "done")


class Progress:
    def __init__(self) -> None:
        self.step = 0  # steps completed (a resumed run's count from its checkpoint on)
        self.started_at = 0  # the step this process started from: its own first step is still slow
        self.phase = "setup"
        self.last_change = time.perf_counter()  # the watchdog's sign of life outside collectives

    def resumed_at(self, step: int) -> None:
        self.step = self.started_at = step

    def at(self, phase: str) -> None:
        self.phase = phase
        self.last_change = time.perf_counter()

    def step_done(self, step: int) -> None:
        self.step = step
        self.last_change = time.perf_counter()
