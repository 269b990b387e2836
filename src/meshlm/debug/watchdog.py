"""The watchdog: a hang becomes a dump of every rank and an exit, not a silent wait.

Reduces: a hang that would sit until the backend's own timeout (gloo 30 min, NCCL 10 min, then a
bare error) to, within `debug.timeout_s`, each rank's flight recorder, thread stacks and step in
`run.dir/debug/`, a one-line summary, and exit 1 on every rank.
Costs: one thread per rank that wakes about once a second and reads two timestamps.

A rank shows life by starting or finishing a collective (the flight recorder's `last_event`) or by
changing phase (debug/progress.py). When neither has happened for `timeout_s`
(`startup_timeout_s` until the first step is done, since building, loading and the first step's
warm-up may take long, and while checkpoints or the final weights are written), the rank dumps
and exits. Every rank of a hung job stops showing life at about the
same moment (the culprit at its last collective, the others as they enter the next one), so all
of them dump; `meshlm debug analyze` then compares the dumps. The process group is created with a
timeout longer than these (`backend_timeout_s`), so the backend never kills a rank first.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from meshlm.debug.dumps import debug_dir, wait_for_peers, write_dump

PEER_GRACE_S = 5.0  # how long a rank that dumped waits for the others' dumps before exiting
# Phases where ranks wait on another's disk writes (a checkpoint, the final weights) without any
# collective, and evaluation (its held-out forwards reach no collective under data parallelism
# until their final sum, and may compile again): the longer startup limit, as these take minutes.
SLOW_PHASES = ("checkpoint", "gather", "eval")


def backend_timeout(debug_cfg) -> timedelta:
    """The process group's own timeout: past every watchdog limit, so the watchdog speaks first."""
    return timedelta(seconds=max(debug_cfg.timeout_s, debug_cfg.startup_timeout_s) + 60)


class Watchdog:
    def __init__(self, comm, progress, run_dir: Path, timeout_s: float, startup_timeout_s: float,
                 *, exit_process: bool = True, dir_ranks: list[int] | None = None) -> None:
        self.comm, self.progress, self.run_dir = comm, progress, Path(run_dir)
        self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
        self.exit_process = exit_process  # False in tests that only want the dump
        self.dir_ranks = dir_ranks  # the ranks whose dumps share run.dir (None: all; train/rank0_node.py)
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshlm-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def limit_s(self) -> float:
        slow = self.progress.step == self.progress.started_at or self.progress.phase in SLOW_PHASES
        return self.startup_timeout_s if slow else self.timeout_s

    def idle_s(self) -> float:
        return time.perf_counter() - max(self.comm.recorder.last_event, self.progress.last_change)

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            idle = self.idle_s()
            if idle > self.limit_s():
                self._fire(idle)
                return

    def _fire(self, idle: float) -> None:
        rank, world = self.comm.ctx.rank, self.comm.ctx.world_size
        pending = self.comm.recorder.pending()
        write_dump(self.run_dir, rank, world, "timeout", progress=self.progress, comm=self.comm,
                   idle_s=round(idle, 3), limit_s=self.limit_s(), dir_ranks=self.dir_ranks)
        where = (f"waiting in {pending[0]['op']} #{pending[0]['seq']} on {pending[0]['axis']}" if pending
                 else "in no collective")
        # One write with its newline: print() writes the text and the end apart, and the ranks'
        # lines, written at the same moment, interleaved ("...rank2.jsonmeshlm: rank 3: ...").
        sys.stderr.write(f"meshlm: rank {rank}: no progress for {idle:.1f} s at step {self.progress.step + 1} "
                         f"({self.progress.phase}, {where}); dumped to {debug_dir(self.run_dir) / f'rank{rank}.json'}\n")
        sys.stderr.flush()
        self.fired.set()
        if self.exit_process:
            wait_for_peers(self.run_dir, len(self.dir_ranks or range(world)), PEER_GRACE_S)
            os._exit(1)
