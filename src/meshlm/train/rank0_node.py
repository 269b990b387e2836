"""Multi-node runs: which node global rank 0 ran on, and whether every node shares its run.dir.

With c10d rendezvous (`meshlm train --nnodes N --rdzv-endpoint HOST:PORT`) the rendezvous, not
`--node-rank`, orders the nodes, so global rank 0 may run on any of them. Rank 0's work lands in
the run.dir of the node it ran on: metrics.jsonl, final/, each checkpoint's manifest. A launcher
must not assume that node is its own (the other node's launcher went on to print the sample from
a final/ it did not have, and exited 2).

At start, when the job spans several nodes, every rank learns rank 0's node (one broadcast) and
each node notes it in its own run.dir (`rank0.json`); after the run, each launcher reads that note
to decide whether the sample and the "metrics in" line are its to print. Every rank writes its
checkpoint shard into its run.dir and rank 0 waits there for all of them, so with checkpoints on a
node that does not see rank 0's run.dir is an error at start (not a failed save, and rank 0 polling
for the missing shard, at the first checkpoint).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path

MARKER = "rank0.json"
LAUNCH_ENV = "MESHLM_LAUNCH_ID"  # set by the launcher, read by its ranks (torchrun copies the environment)
NODE_ENV = "MESHLM_NODE_RANK"


# --------------------------------------------------------------------------- the launcher's side


def tag_launch(node_rank: int, run_dir: Path) -> str:
    """A fresh id for this launch, passed to its ranks through the environment, and no note left
    from an earlier run: rank 0's id in the note later tells this launcher whether rank 0 was its."""
    launch_id = uuid.uuid4().hex
    os.environ[LAUNCH_ENV], os.environ[NODE_ENV] = launch_id, str(node_rank)
    # Safe on a shared run.dir: no rank writes the note before every node has joined the rendezvous.
    (run_dir / MARKER).unlink(missing_ok=True)
    return launch_id


def rank0_elsewhere(run_dir: Path, launch_id: str) -> dict | None:
    """After a good run: None if global rank 0 was one of this launcher's ranks, else what the
    ranks noted about it (node_rank, host, run_dir; {} if they noted nothing)."""
    try:
        info = json.loads((run_dir / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return None if info.get("launch") == launch_id else info


def elsewhere_line(info: dict) -> str:
    """The launcher's one line when global rank 0 ran on another node."""
    if not info:
        return "global rank 0 ran on another node: its run.dir holds metrics.jsonl, checkpoints and final/"
    return (f"global rank 0 ran on node {info['node_rank']} (host {info['host']}): its run.dir {info['run_dir']} "
            f"holds metrics.jsonl, checkpoints and final/ (this node's holds its ranks' logs/)")


# --------------------------------------------------------------------------- the ranks' side


def several_nodes() -> bool:
    return int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1  # torchrun's number of nodes


def meet_rank0(cfg) -> list[int] | None:
    """Every rank, after the process group is up (collective when the job spans several nodes; a
    single-node job does nothing): note where global rank 0 runs, and refuse a run.dir that
    checkpoints would split across nodes (ConfigError). Returns None when every rank sees global
    rank 0's run.dir (where a checkpoint's shards all go), else the global ranks whose dumps land
    in this rank's run.dir: the analysis there must not take the others for ranks that died."""
    import torch.distributed as dist

    if not several_nodes():
        return None
    run_dir, rank = Path(cfg.run.dir), dist.get_rank()
    rank0 = [_identity(run_dir) if rank == 0 else None]
    if rank == 0:
        (run_dir / rank0[0]["probe"]).touch()
    dist.broadcast_object_list(rank0, src=0)
    info = rank0[0]
    # A new name, never looked up before: no cached "does not exist" on a network filesystem.
    facts = [None] * dist.get_world_size()  # (sees rank 0's run.dir, its launcher: one per node)
    dist.all_gather_object(facts, ((run_dir / info["probe"]).exists(), os.environ.get(LAUNCH_ENV, "")))
    seen = [saw for saw, _ in facts]
    if rank == 0:
        (run_dir / info["probe"]).unlink(missing_ok=True)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        _write_note(run_dir, info)
    blind = [r for r, saw in enumerate(seen) if not saw]
    if blind and cfg.checkpoint.interval > 0:
        from meshlm.errors import ConfigError

        raise ConfigError(
            f"checkpoint.interval: rank {blind[0]} ({len(blind)} rank(s) in all) does not see the run.dir of global "
            f"rank 0 ({info['run_dir']} on node {info['node_rank']}, host {info['host']}); every rank writes its "
            f"checkpoint shard into run.dir, so with checkpoints run.dir must be one directory all nodes share, "
            f"or set checkpoint.interval=0 (docs/debugging.md, Multi-node runs)")
    if not blind:
        return None
    me = facts[rank]  # rank 0's run.dir is shared by the ranks that see it; any other, by one node's
    return [r for r, (saw, launch) in enumerate(facts) if saw == me[0] and (saw or launch == me[1])]


def _identity(run_dir: Path) -> dict:
    """Rank 0's node as its launcher named it, and a probe file name unique to this start."""
    return {"node_rank": int(os.environ.get(NODE_ENV, "0")), "host": socket.gethostname(),
            "run_dir": str(run_dir.resolve()), "launch": os.environ.get(LAUNCH_ENV, ""),
            "probe": f".rank0-probe-{uuid.uuid4().hex}"}


def _write_note(run_dir: Path, info: dict) -> None:
    """Renamed into place: on a shared run.dir every node writes the same note at once."""
    tmp = run_dir / f".{MARKER}.{socket.gethostname()}.{os.getpid()}"
    tmp.write_text(json.dumps({k: v for k, v in info.items() if k != "probe"}))
    os.replace(tmp, run_dir / MARKER)
