"""A fork-based multi-rank launcher for tests: N ranks on gloo in about 0.2 s.

torchrun takes 4-12 s to start ranks; forking the test process and rendezvousing through a
FileStore in a temporary directory is ~50x faster, so every parallel technique can be tested
against its single-process reference at world sizes 2..8 within the suite's time budget.

Guarantees: each rank runs with one intra-op thread (two threads per rank on a 2-core machine is
10-15x slower), a rank that raises fails the call with that rank's traceback, a call that runs
past its timeout fails (it never hangs the suite), and every child is reaped in all cases.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable


_GRACE_AFTER_FAILURE_S = 2.0
_CONSEQUENCE_MARKERS = ("Connection closed by peer", "remote worker crashing", "Connection reset by peer")


def _is_consequence(failure_text: str) -> bool:
    return any(marker in failure_text for marker in _CONSEQUENCE_MARKERS)


class RankFailure(AssertionError):
    """A rank raised; the message holds its traceback."""


class RankTimeout(AssertionError):
    """Ranks were still running when the timeout expired (a hang or deadlock)."""


def _child(fn, rank, world_size, store_path, backend, conn, args, kwargs, pg_timeout=None):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        store = dist.FileStore(store_path, world_size)
        extra = {} if pg_timeout is None else {"timeout": pg_timeout}  # the process group's own (default: torch's)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **extra)
        try:
            result = fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()
        # Plain pickle serialises tensors by value; multiprocessing's pickler would pass them
        # as shared-memory handles that die with this process.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    start_method: str = "fork",
    pg_timeout=None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` forked ranks with torch.distributed initialised.

    Inside ``fn``, ``torch.distributed.get_rank()`` gives the rank. Returns the per-rank return
    values in rank order (they must be picklable). Raises RankFailure if any rank raised and
    RankTimeout if any rank is still running after ``timeout`` seconds. ``start_method="spawn"``
    for ranks that use CUDA: a forked child cannot, once the parent has touched CUDA; ``fn``
    must then be importable by name (a module-level function). ``pg_timeout`` (a timedelta): the
    process group's own timeout, as `meshlm train` sets it (default: torch's).
    """
    ctx = mp.get_context(start_method)
    tmpdir = tempfile.mkdtemp(prefix="meshlm-ranks-")
    store_path = os.path.join(tmpdir, "store")
    procs, conns = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(fn, rank, world_size, store_path, backend, child_end, args, kwargs, pg_timeout),
                daemon=True,
            )
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)

        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        pending = {conn: rank for rank, conn in enumerate(conns)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(pending), timeout=remaining):
                rank = pending.pop(conn)
                try:
                    results[rank] = pickle.loads(conn.recv_bytes())
                except EOFError:
                    results[rank] = ("error", f"rank {rank} died without a result (exit code {procs[rank].exitcode})")
                if results[rank][0] == "error":
                    # Peers of a failed rank are usually blocked in a collective or fail in turn;
                    # give them a moment to report, then stop waiting.
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
        failures = {r: v for r, (status, v) in results.items() if status == "error"}
        if failures:
            # The root cause first: a rank whose peer died reports only a closed connection.
            order = sorted(failures, key=lambda r: (_is_consequence(failures[r]), r))
            text = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in order)
            raise RankFailure(f"rank {order[0]} of {world_size} failed:\n{text}")
        if pending:
            stuck = sorted(pending.values())
            raise RankTimeout(f"ranks {stuck} of {world_size} still running after {timeout:.0f}s (hang?)")
        return [results[r][1] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        for conn in conns:
            conn.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
