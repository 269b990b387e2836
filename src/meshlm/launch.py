"""Starting ranks: torchrun (`torch.distributed.run`) used as a library, on one node or many.

`meshlm train --nproc N` validates the config and prepares the data once, in this process, then
asks torchrun to start N copies of `meshlm.train.worker` per node. torchrun sets RANK,
WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT, and tears every rank down if one fails.

How ranks start. With a CPU-only PyTorch, torchrun forks them from this process, which has
imported torch already: a rank is ready in milliseconds instead of the ~2.5 s of CPU a fresh
interpreter spends importing torch (N of them at once on a laptop's few cores). Where PyTorch
was built with CUDA (or ROCm), each rank is a fresh interpreter (`python -u -m module`), as
torchrun does by default: CUDA cannot be used in a child forked after the parent touched the
driver, which the GPU checks before launch do.
"""

from __future__ import annotations

import gc
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import uuid


def torchrun_args(nproc: int, module: str, module_args: list[str], nnodes: int = 1,
                  rdzv_endpoint: str | None = None, rdzv_id: str = "meshlm", max_restarts: int = 0) -> list[str]:
    """The torchrun command line: standalone on one node, c10d rendezvous across nodes."""
    if nnodes == 1 and not rdzv_endpoint:
        head = ["--standalone", "--nnodes", "1"]
    else:
        if not rdzv_endpoint:
            raise ValueError("--rdzv-endpoint HOST:PORT is required when --nnodes > 1")
        # No --node-rank: c10d ignores it (with a warning); the rendezvous orders the nodes, so
        # global rank 0 may run on any node (train/rank0_node.py); meshlm's --node-rank only names it.
        head = ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "--rdzv-id", rdzv_id]
    # SIGINT is not the agent's: see `launch`.
    return [*head, "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--signals-to-handle", "SIGTERM,SIGHUP,SIGQUIT", "--module", module, *module_args]


def launch(nproc: int, module: str, module_args: list[str], explain=None, **kwargs) -> int:
    """Run `python -m module module_args` on `nproc` ranks per node; returns an exit code.

    SIGTERM to this process: the ranks get it (they save at the next step boundary and exit 0,
    train/preemption.py). Spawned ranks: torchrun's agent forwards it and waits up to 30 s for
    them. Forked ranks: this process forwards it and the agent sees the ranks finish as usual (its
    own forwarding would wait the full 30 s: a forked rank that returned waits for the agent to
    collect its result, which an agent shutting down never does). Ctrl-C (SIGINT) is not the
    agent's: the first one stops the ranks the same way (spawned: by interrupting the agent's
    loop, whose clean-up sends them SIGTERM); a second one ends this process at once, and the
    ranks die with it (`die_with_parent`). (Were SIGINT the agent's, its handler would swallow the
    second one and wait the full 30 s.) `explain()`, after a failure, may return the one line that
    says why (meshlm's failure analysis); otherwise the line lists the failed ranks' exit codes."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    forked = ranks_can_fork()
    if forked:
        # Read where this process's command line lies before the agent's environment changes move
        # it (each rank renames itself with it: `forked_rank`).
        import setproctitle  # noqa: F401

    # One intra-op thread per rank unless the user chose otherwise: N ranks x all cores each
    # oversubscribes the CPU badly (torchrun would set the same, with a warning).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The launcher already used the tokenizers thread pool; ranks need none of it.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = get_args_parser().parse_args(torchrun_args(nproc, module, module_args, **kwargs))
    presses, forwarded = 0, []

    def forward_to_ranks(signum) -> bool:
        """Forked ranks: send them SIGTERM (False: none started yet)."""
        ranks = multiprocessing.active_children() if forked else []
        for rank in ranks:
            os.kill(rank.pid, signal.SIGTERM)
        if ranks:
            forwarded.append(signum)
        return bool(ranks)

    def on_ctrl_c(signum, _frame):
        nonlocal presses
        presses += 1
        if presses > 1:
            print("meshlm: second Ctrl-C: exiting now; the ranks stop without a checkpoint", file=sys.stderr, flush=True)
            os._exit(130)
        if not forward_to_ranks(signum):
            raise KeyboardInterrupt

    def on_sigterm(signum, _frame):
        if not forward_to_ranks(signum):
            raise SignalException("SIGTERM before the ranks started", signal.Signals(signum))

    # The agent logs each failed rank at ERROR, and warns "Terminating process N via signal SIGTERM"
    # for each rank it stops after one failed; meshlm prints one line that says why instead.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, on_ctrl_c)}
    if forked:
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if forked:
            _run_forked(args, module, module_args)
        else:
            run(args)
        if forwarded:  # the ranks stopped as asked and exited 0
            name = "interrupted" if forwarded[0] == signal.SIGINT else f"{signal.Signals(forwarded[0]).name}"
            print(f"meshlm: {name}: ranks stopped", file=sys.stderr)
            return 128 + int(forwarded[0])
    except ChildFailedError as e:
        if e.get_first_failure()[1].exitcode == 2:  # a config error only the ranks could find: said
            return 2
        failures = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(e.failures.items()))
        why = explain() if explain is not None else None
        print(f"meshlm: {why}" if why else f"meshlm: training failed on {failures}; see the rank logs in the run "
              f"directory", file=sys.stderr)
        return 1
    except SignalException as e:
        print(f"meshlm: {e.sigval.name}: ranks stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        print("meshlm: interrupted: ranks stopped", file=sys.stderr)
        return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def ranks_can_fork() -> bool:
    """True where ranks may be forked from the launcher: a PyTorch built without CUDA or ROCm."""
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def _run_forked(args, module: str, module_args: list[str]) -> None:
    """torchrun's own `run(args)` with the worker as a function entrypoint, started by fork."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if args.standalone:  # as torchrun's run(args): a fresh local c10d rendezvous on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500  # read only by the static rendezvous, never used here
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    config.signals_to_handle = "SIGHUP,SIGQUIT"  # SIGTERM and SIGINT: `launch` forwards them
    sys.stdout.flush()  # else each child inherits, and later prints, what this process buffered
    sys.stderr.flush()
    # Objects that exist now are never collected in the ranks: fork's copy-on-write pages stay
    # shared (a collection touches every object's header), and exit skips a pass over torch's.
    gc.freeze()
    elastic_launch(config=config, entrypoint=forked_rank)(module, *module_args)


def forked_rank(module: str, *argv: str) -> None:
    """A forked rank: what `python -u -m module argv...` would run, exiting with its status."""
    # The launcher's handlers (Ctrl-C, torchrun's agent's SIGTERM) are not the rank's.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):  # as `python -u`: lines reach the launcher's pipe at once
        stream.reconfigure(line_buffering=True)
    # What `ps`, `top` and `pgrep -f` show: the command a spawned rank would have run, with its rank.
    import setproctitle  # imported by `launch` before it forked us

    setproctitle.setproctitle(f"meshlm rank {os.environ.get('RANK', '?')}: {sys.executable} -u -m {module} "
                              f"{' '.join(argv)}")
    # A function entrypoint's return value is not its exit status: SystemExit carries it.
    sys.exit(importlib.import_module(module).main(list(argv)))
