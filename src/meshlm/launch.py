"""Starting ranks: torchrun (`torch.distributed.run`) used as a library, on one node or many.

`meshlm train --nproc N` validates the config and prepares the data once, in this process, then
asks torchrun to start N copies of `meshlm.train.worker` per node. torchrun sets RANK,
WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT, and tears every rank down if one fails.
"""

from __future__ import annotations

import logging
import os
import signal
import sys


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

    SIGTERM to this process: torchrun's agent forwards it to the ranks (they save at the next step
    boundary and exit 0, train/preemption.py) and waits up to 30 s for them. Ctrl-C (SIGINT) is
    not the agent's: the first one interrupts the agent's loop, whose clean-up sends the ranks
    SIGTERM and waits the same way; a second one ends this process at once, and the ranks die with
    it (`die_with_parent`). (Were SIGINT the agent's, its handler would swallow the second one and
    wait the full 30 s.) `explain()`, after a failure, may return the one line that says why
    (meshlm's failure analysis); otherwise the line lists the failed ranks' exit codes."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # One intra-op thread per rank unless the user chose otherwise: N ranks x all cores each
    # oversubscribes the CPU badly (torchrun would set the same, with a warning).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The launcher already used the tokenizers thread pool; ranks need none of it.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = get_args_parser().parse_args(torchrun_args(nproc, module, module_args, **kwargs))
    presses = 0

    def on_ctrl_c(_signum, _frame):
        nonlocal presses
        presses += 1
        if presses > 1:
            print("meshlm: second Ctrl-C: exiting now; the ranks stop without a checkpoint", file=sys.stderr, flush=True)
            os._exit(130)
        raise KeyboardInterrupt

    # The agent logs each failed rank at ERROR; meshlm prints one line that says why instead.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        run(args)
    except ChildFailedError as e:
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
        signal.signal(signal.SIGINT, previous)
    return 0
