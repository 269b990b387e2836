"""One `meshlm train` at a time in a run directory (per node): two would resume from each other's
checkpoints and interleave their metrics, final/ and config.toml, and both exit 0.

flock, as the token cache's build lock: the kernel releases it when the holder dies, so a killed
run never leaves its directory locked. The lock file is per node rank, so the nodes of one job
sharing a run.dir (as checkpoints need) do not exclude each other; it is never removed (removing
a lock file races with a process that opened it but has not locked it yet)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path
from typing import Iterator

from meshlm.errors import ConfigError


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, node_rank: int = 0) -> Iterator[None]:
    """Hold `run_dir`'s lock for this node while the block runs; ConfigError naming run.dir and the
    holder if another meshlm train holds it."""
    with open(run_dir / f".train-node{node_rank}.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise ConfigError(f"run.dir: {run_dir} is in use by another meshlm train ({holder}); wait for it to "
                              f"finish, or choose another run.dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
