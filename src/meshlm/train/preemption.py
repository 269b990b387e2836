"""Stopping cleanly on SIGTERM (a preemption) or Ctrl-C: save at the next step boundary, exit 0.

Reduces: the work lost to a preemption or an interrupt, to nothing (the step in flight finishes).
Costs: one number more in the all-reduce MAX over the world that each step already makes for the
peak memory, so that every rank stops after the same step (a signal reaches ranks at different
moments; a rank that stopped alone would leave the others waiting in a collective forever).

- The first SIGTERM or SIGINT sets a flag; the trainer's step (`Trainer._max_over_ranks`) reduces
  its number with the other ranks' and, if any rank was signalled, every rank saves a checkpoint
  after that step and returns. A watchdog thread exits the process if no step boundary came within
  `checkpoint.stop_timeout_s` (a rank stuck in a collective with a dead peer cannot save). It is
  stopped at the boundary (`reached_boundary`), before the save: a save longer than the deadline
  was killed half-written, "no step boundary" then false. A save that hangs on a dead peer is the
  collective watchdog's (debug.timeout_s); under torchrun, the agent's own deadline still holds.
- A second SIGINT (Ctrl-C twice) exits at once. Repeated SIGTERMs count as one: schedulers
  resend them, and torchrun forwards its own.
- Under torchrun, the launcher's elastic agent catches the signal and forwards it to the workers
  (which run in their own sessions); `die_with_parent` makes a worker die if the agent does, so
  no rank outlives its launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (torchrun's agent) exits, however it exits."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent was already gone before prctl took effect
        os._exit(1)


class StopSignals:
    """Context manager: SIGTERM/SIGINT handlers installed inside, the previous ones restored after."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.received: signal.Signals | None = None
        self._previous = {}
        self._timer: threading.Timer | None = None
        self._at_boundary = False  # the trainer stops here: no deadline from now on
        self._saving = False  # a checkpoint is being written: the deadline starts when it ends

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            if sig == signal.SIGINT and self.received == signal.SIGINT:
                print("meshlm: second interrupt: exiting now, without a checkpoint", file=sys.stderr, flush=True)
                os._exit(130)
            return
        self.received = sig
        # Said at once only for Ctrl-C (the user's), once per node: torchrun's agent also SIGTERMs
        # the ranks left when one failed, where "saving a checkpoint" would be false. A stop that
        # happens is said where it happens (Trainer.fit: "stopped after step N ...").
        if sig == signal.SIGINT and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print("meshlm: Ctrl-C: saving a checkpoint after this step, then exiting (Ctrl-C again to exit now)",
                  file=sys.stderr, flush=True)
        if self._at_boundary:  # a signal during the stop save (another rank's stopped this one): no deadline
            return
        if not self._saving:
            self._start_deadline()

    def _start_deadline(self) -> None:
        self._timer = threading.Timer(self.timeout_s, self._give_up)
        self._timer.daemon = True
        self._timer.start()

    @contextlib.contextmanager
    def saving(self):
        """A periodic checkpoint being written: a signal that lands in it starts the deadline when it
        ends. The save is past a step boundary, not stuck before one; timed, a save longer than the
        deadline was killed half-written on every rank ("no step boundary within N s"), losing it
        and the stop's checkpoint. A save stuck on a dead peer is the collective watchdog's."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False
            if self.received is not None and self._timer is None and not self._at_boundary:
                self._start_deadline()

    def reached_boundary(self) -> None:
        """The trainer stops after this step (every rank agreed): the deadline was for getting here,
        not for the save that follows."""
        self._at_boundary = True
        if self._timer is not None:
            self._timer.cancel()

    def _give_up(self) -> None:
        print(f"meshlm: no step boundary within {self.timeout_s:.0f} s of {self.received.name}: exiting without "
              f"a checkpoint", file=sys.stderr, flush=True)
        os._exit(1)

    @property
    def number(self) -> int:
        """The received signal's number, 0 if none: what the trainer's per-step all-reduce MAX
        carries, so that every rank learns that some rank was signalled."""
        return 0 if self.received is None else int(self.received)
