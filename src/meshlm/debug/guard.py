"""One rank's safety net: the watchdog while it trains, and for any failure a dump in
`run.dir/debug/` and a short report on stderr instead of a traceback per rank.

Reduces: N interleaved tracebacks (one per rank, most of them "connection closed by peer") to
the failing rank's own report: an OOM block, a non-finite step's culprit, or the exception's
last line, each with rank, step and phase.
Costs: the watchdog's thread (debug/watchdog.py); nothing else until something fails.
"""

from __future__ import annotations

import sys

from meshlm.comm.shm_barrier import GONE, STUCK
from meshlm.debug.dumps import debug_dir, wait_for_peers, write_dump
from meshlm.debug.fingerprint import DesyncError
from meshlm.debug.nonfinite import NonFiniteError
from meshlm.debug.oom import is_out_of_memory, oom_report
from meshlm.debug.watchdog import PEER_GRACE_S, Watchdog
from meshlm.errors import ConfigError, RunError

# Failures every rank raises at the same step end (the fingerprint and the non-finite check are
# all-gathers), and a wait that timed out (the stuck peer's own watchdog dumps about then): the
# first rank to exit makes torchrun SIGTERM the rest, so each waits, as the watchdog does, for the
# others' dumps; the verdict then compares a full set, whatever the order.
EVERY_RANK = ("desync", "nonfinite", "timeout")
# Errors a rank sees because another rank died first: the other rank's dump holds the cause.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
             "NCCL communicator was aborted")
# comm/shm_barrier.py's two failures: a peer "is gone" (lost), or "has not arrived" within the
# group's timeout, still running: a hang, analysed as the watchdog's dumps are, not a lost peer
# (whose verdict is a crash of the rank without a dump, or blames the slow rank's peer).
SHM_BARRIER = "shared-memory barrier: peer"


class RankFailed(Exception):
    """Raised by RankGuard after the failure was dumped and reported: exit 1, print nothing more."""

    def __init__(self, kind: str, line: str) -> None:
        super().__init__(line)
        self.kind = kind


def failure_kind(error: BaseException) -> str:
    if isinstance(error, NonFiniteError):
        return "nonfinite"
    if isinstance(error, DesyncError):
        return "desync"
    if is_out_of_memory(error):
        return "oom"
    text = str(error)
    if SHM_BARRIER in text and STUCK in text:
        return "timeout"
    if any(marker in text for marker in PEER_LOST) or (SHM_BARRIER in text and GONE in text):
        return "peer_lost"
    return "error"


class RankGuard:
    """`with RankGuard(cfg, rank, world) as guard: ... guard.attach(trainer) ...`"""

    def __init__(self, cfg, rank: int, world_size: int, dir_ranks: list[int] | None = None) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        # The ranks whose dumps share this run.dir (None: all): nodes with a run.dir each see only theirs.
        self.dir_ranks = dir_ranks
        self.trainer = None
        self.watchdog: Watchdog | None = None

    def __enter__(self) -> "RankGuard":
        # A restarted rank's dump of the attempt before would be read as this attempt's (by the
        # analysis, and by the peers waiting for every rank's dump): each rank drops its own.
        (debug_dir(self.cfg.run.dir) / f"rank{self.rank}.json").unlink(missing_ok=True)
        return self

    def attach(self, trainer) -> None:
        """From now on the failure report knows the step, phase and engine; ranks are watched."""
        self.trainer = trainer
        if self.world_size > 1:
            d = self.cfg.debug
            self.watchdog = Watchdog(trainer.comm, trainer.progress, self.cfg.run.dir, d.timeout_s,
                                     d.startup_timeout_s, dir_ranks=self.dir_ranks).__enter__()

    def release(self) -> None:
        if self.watchdog is not None:
            self.watchdog.__exit__(None, None, None)
            self.watchdog = None

    def __exit__(self, exc_type, error, tb) -> bool:
        self.release()
        if error is None or isinstance(error, (ConfigError, KeyboardInterrupt, SystemExit, RankFailed)) or (
                isinstance(error, RunError) and not isinstance(error, DesyncError)):
            return False
        kind = failure_kind(error)
        lines = self.report(kind, error)
        t = self.trainer
        dumped = write_dump(self.cfg.run.dir, self.rank, self.world_size, kind, progress=t.progress if t else None,
                            comm=t.comm if t else None, error=error, report=lines,
                            culprits=getattr(error, "ranks", [self.rank]), dir_ranks=self.dir_ranks)
        if kind in EVERY_RANK and self.world_size > 1:
            wait_for_peers(self.cfg.run.dir, len(self.dir_ranks or range(self.world_size)), PEER_GRACE_S)
        if dumped is None and kind == "error":  # (a full disk) no traceback file to point at
            lines = lines[:1]
        # Under a launcher its one-line verdict says the rest (train/command.py's _failure_line); an
        # OOM's block is longer. Without a dump the verdict cannot read the failure: said here.
        if kind == "oom" or self.world_size == 1 or (dumped is None and kind != "peer_lost"):
            print("\n".join(f"meshlm: {line}" if i == 0 else line for i, line in enumerate(lines)),
                  file=sys.stderr, flush=True)
        raise RankFailed(kind, lines[0]) from error

    def report(self, kind: str, error: BaseException) -> list[str]:
        t = self.trainer
        step = t.progress.step + 1 if t else 0
        phase = t.progress.phase if t else "setup"
        if kind == "oom":
            device = t.device if t else _device_of(self.cfg)
            return oom_report(self.cfg, self.rank, step, phase, t.dp if t else None, device)
        if kind in ("nonfinite", "desync"):
            return [str(error)]
        last = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        return [f"rank {self.rank} failed at step {step} ({phase}): {type(error).__name__}: {last}",
                f"  traceback: {debug_dir(self.cfg.run.dir) / f'rank{self.rank}.json'} (meshlm debug analyze shows it)"]


def _device_of(cfg):
    """This rank's device when the failure came before the trainer existed."""
    from meshlm.mesh import default_backend, default_device

    return default_device(default_backend(cfg.parallel.backend))
