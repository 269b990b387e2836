"""One rank of a training job: what torchrun starts (`python -m meshlm.train.worker --config F`),
and what `meshlm train` runs in-process when the world is a single rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.config import Config, ConfigError, RunError, load_config, resolve
from meshlm.debug.guard import RankFailed, RankGuard
from meshlm.debug.watchdog import backend_timeout
from meshlm.mesh import ParallelContext, default_backend, default_device
from meshlm.train.data import prepare_data
from meshlm.train.host_memory import keep_freed_host_memory
from meshlm.train.metrics import format_bytes
from meshlm.train.rank0_node import meet_rank0
from meshlm.train.trainer import Trainer
from meshlm.train.weights import save_final


PREEMPTED = "preempted.json"  # rank 0 leaves it in run.dir when a signal stopped the run cleanly


def start_state(trainer: Trainer) -> None:
    """Where training starts: a checkpoint (checkpoint.resume), a model to fine-tune
    (model.init_from), or the seed's initialisation. Collective."""
    from meshlm.train.checkpoint import load_checkpoint
    from meshlm.train.checkpoint.resume import checkpoint_root, choose, set_aside_old_checkpoints
    from meshlm.train.checkpoint.store import list_checkpoints

    cfg = trainer.cfg
    path = choose(cfg, trainer.comm, trainer.ctx, warn=lambda m: trainer.metrics.print(f"warning: {m}"))
    if path is not None:
        meta = load_checkpoint(trainer, path)
        # The checkpoint's own row of its step, for a run killed before logging it: only for one of
        # this run.dir's checkpoints, whose metrics.jsonl holds the steps before it.
        own = path.resolve().parent == checkpoint_root(cfg).resolve()
        trainer.metrics.resume_at(trainer.step, meta.get("metrics_row") if own else None)
        trainer.progress.resumed_at(trainer.step)  # reports name the step the run is at
        trainer.metrics.print(f"resumed from {path} (step {trainer.step} of {cfg.train.steps}, saved under "
                              f"{_layout_text(meta['layout'])})")
    # Checkpoints of a timeline this run does not continue are not ours to mix with. Once every
    # rank has chosen and read: the set-aside changes what checkpoints/ lists.
    trainer.comm.barrier()
    if trainer.ctx.rank == 0 and (aside := set_aside_old_checkpoints(cfg, loaded=path)) is not None:
        moved = ", ".join(p.name for p in list_checkpoints(aside))
        trainer.metrics.print(f"moved checkpoints {moved} to {aside}: this run continues from "
                              f"{path if path is not None else 'step 0'}, not from them")
    if path is None and cfg.model.init_from:
        from meshlm.train.checkpoint.hf_import import init_from

        init_from(trainer, Path(cfg.model.init_from))
        trainer.metrics.print(f"initialised from {cfg.model.init_from}")


def _log_predicted_memory(trainer: Trainer) -> int | None:
    """The memory model's peak for this run, logged before the first step (docs/memory.md)."""
    from meshlm.analysis.memory import predict, runtime_backend

    try:
        report = predict(trainer.cfg, backend=runtime_backend(trainer.device.type, trainer.ctx.world_size))
    except Exception as e:  # an estimate must never stop a run
        trainer.metrics.print(f"memory: no prediction ({e})")
        return None
    worst = max(report.ranks, key=lambda r: r.peak_bytes)
    trainer.metrics.print(f"memory: predicted peak {format_bytes(report.peak_bytes)} per rank ({worst.role}, "
                          f"at the {worst.phase}; meshlm memory shows the breakdown)")
    if trainer.device.type == "cuda":
        from meshlm.debug.oom import device_capacity

        capacity = device_capacity(trainer.device)
        if report.peak_bytes > capacity:
            trainer.metrics.print(f"warning: the predicted peak exceeds this GPU's {format_bytes(capacity)}: expect "
                                  f"an out-of-memory error; `meshlm plan` finds layouts that fit")
    return report.peak_bytes


def _log_measured_memory(trainer: Trainer, rows: list[dict], predicted: int | None) -> None:
    measured = max((r["mem_peak_bytes"] for r in rows if r.get("mem_peak_bytes")), default=None)
    if measured is None or predicted is None:
        return
    trainer.metrics.print(f"memory: measured peak {format_bytes(measured)} per rank, predicted "
                          f"{format_bytes(predicted)} ({predicted / measured - 1:+.1%})")


def _layout_text(layout: dict) -> str:
    return " ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp", "cp", "zero") if k in layout)


def train_rank(cfg: Config, guard=None, can_checkpoint: bool = True) -> list[dict]:
    """Train on this rank (process group, if any, already initialised); rank 0 saves the result.
    A SIGTERM/SIGINT stops after the current step with a checkpoint (train/preemption.py), unless
    `can_checkpoint` is False (nodes that do not share run.dir: shards would land apart).
    `guard` (a debug.guard.RankGuard) watches the trainer once it exists."""
    from meshlm.train.preemption import StopSignals

    ctx = ParallelContext.from_config(cfg.parallel)
    if ctx.device.type == "cpu" and cfg.train.keep_host_memory:
        keep_freed_host_memory()
    # The launcher prepared the data before starting ranks, so this is a cache hit.
    data = prepare_data(cfg.data, cfg.model.vocab_size, log=lambda *a, **k: None)
    run_dir = Path(cfg.run.dir)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        (run_dir / PREEMPTED).unlink(missing_ok=True)
    with StopSignals(cfg.checkpoint.stop_timeout_s) as signals:
        trainer = Trainer(cfg, ctx, data)
        if guard is not None:
            guard.attach(trainer)
        trainer.stop_signals = signals
        trainer.can_checkpoint = can_checkpoint
        start_state(trainer)
        predicted = _log_predicted_memory(trainer)
        rows = trainer.fit()
        _log_measured_memory(trainer, rows, predicted)
    if trainer.stopped_by is not None:  # not finished: no final weights; the checkpoint is the result
        # Each node's launcher reads it in its own run.dir (nodes may not share one): written by
        # every node's first rank, the same content, renamed into place.
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            note = run_dir / f".{PREEMPTED}.{os.getpid()}"
            note.write_text(json.dumps({"step": trainer.step, "signal": trainer.stopped_by,
                                        "checkpoint": str(trainer.last_checkpoint.path)
                                        if trainer.last_checkpoint else None}))
            os.replace(note, run_dir / PREEMPTED)
        trainer.metrics.close()
        return rows
    state = trainer.full_state_dict()  # collective for sharded layouts: every rank takes part
    if ctx.rank == 0:
        final = save_final(state, cfg, data.tokenizer_path, run_dir)
        trainer.metrics.print(f"saved final weights to {final}")
    trainer.metrics.close()
    return rows


# Where a rank notes a config error for torchrun's later attempts (`--max-restarts`): the agent's
# store outlives the ranks, so a restart can read it before it starts training into it again.
CONFIG_ERROR_KEY = "meshlm/config_error"


def _agent_store():
    """torchrun's store: the same one through every attempt of this launch."""
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://"))
    return store


def remember_config_error(error: ConfigError) -> None:
    """A config error is the same on every attempt: restarting into it again only repeats it."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return
    try:
        _agent_store().set(CONFIG_ERROR_KEY, str(error))
    except Exception:  # the error line is already out; a lost note costs only the restarts
        pass


def config_error_already_said() -> bool:
    """On a restart: did an earlier attempt end in a config error (said then, on each node)?"""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return False
    return _agent_store().check([CONFIG_ERROR_KEY])


def init_process_group(backend: str, timeout) -> None:
    """The default process group from torchrun's environment. After a restart (--max-restarts)
    torchrun hands the new workers the same store, which still holds the dead workers' gloo
    addresses under the same keys: connecting to them hangs. Each attempt gets its own key prefix.
    `timeout`: the backend's own, longer than meshlm's watchdog (debug/watchdog.py)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        dist.init_process_group(backend, timeout=timeout)
        return
    from torch.distributed.rendezvous import rendezvous

    store, rank, world_size = next(rendezvous("env://"))
    dist.init_process_group(backend, store=dist.PrefixStore(f"meshlm/attempt{restart}", store), rank=rank,
                            world_size=world_size, timeout=timeout)


def say_restart(run_dir: str, timeout: timedelta = timedelta(minutes=10)) -> None:
    """Rank 0 of a restart (--max-restarts) says why the attempt before failed (the agent's own
    report is silenced: launch.py), from the dumps the verdict reads; a restart said only "a rank
    died", and the dumps that said why were gone by the next failure. Every rank of the attempt
    calls it before RankGuard drops its dump of the attempt before: the others wait here, in
    torchrun's store, until rank 0 has read them. (The process group cannot be that wait: NCCL's
    forms lazily, so init_process_group returns on each rank without waiting for rank 0; only
    gloo's connect does.)"""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if not restart:
        return
    said = f"meshlm/attempt{restart}/restart_said"
    store = _agent_store()
    if int(os.environ.get("RANK", "0")) != 0:
        try:
            store.wait([said], timeout)
        except Exception:  # noqa: BLE001 - rank 0 never got there (it failed): the agent ends the attempt
            pass
        return
    from meshlm.debug.analyze import analyze

    try:
        result = analyze(Path(run_dir))
        why = result["line"] if result["verdict"] not in ("none", "ok") else "a rank died without a dump"
    except Exception as e:  # noqa: BLE001 - the restart goes on whatever the analysis finds
        why = f"(no verdict: {e})"
    try:
        print(f"meshlm: restart {restart} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}, from the newest "
              f"checkpoint; the attempt before failed: {why}", file=sys.stderr, flush=True)
    finally:
        store.set(said, "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshlm.train.worker")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    from meshlm.train.preemption import die_with_parent

    die_with_parent()  # no rank outlives torchrun's agent, however the agent ends
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if config_error_already_said():  # torchrun restarts on any failure; exit as the last attempt did
        return 2
    try:
        # The launcher resolved this config for nproc x nnodes ranks; the world torchrun formed can
        # differ (nodes launched with different --nproc): one line, exit 2, not a silent exit 1.
        cfg = resolve(load_config(args.config), world_size=world_size)
    except ConfigError as e:
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"meshlm: error: {e} (the ranks torchrun started: every node must pass the same --nproc)",
                  file=sys.stderr, flush=True)
        remember_config_error(e)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    backend = default_backend(cfg.parallel.backend)
    device = default_device(backend)  # this rank's GPU (LOCAL_RANK) under NCCL, else the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL initialises, so it binds to the right GPU
    say_restart(cfg.run.dir, backend_timeout(cfg.debug))
    init_process_group(backend, backend_timeout(cfg.debug))
    try:
        here = meet_rank0(cfg)  # several nodes: note where global rank 0 runs; None: run.dir is everyone's
        with RankGuard(cfg, dist.get_rank(), world_size, dir_ranks=here) as guard:  # a failure: dump, report, exit 1
            train_rank(cfg, guard, can_checkpoint=here is None)
            # Leave together: a rank that tears gloo down while rank 0 still writes final/ can abort
            # in gloo's destructor ("terminate called without an active exception", seen once in CI).
            dist.barrier()
    except (RunError, ConfigError) as e:  # e.g. a bad checkpoint: one line, not a traceback per rank
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one line per node: each launcher shows why
            print(f"meshlm: error: {e}", file=sys.stderr, flush=True)
        if isinstance(e, ConfigError):
            remember_config_error(e)
            return 2  # bad config, as if found before the ranks
        return 1
    except RankFailed:  # reported by the guard; the others learn it from their peer's exit
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
