"""`meshlm train`: the main job's command. It checks what it can before any rank starts (usage,
config, GPUs, the checkpoint to resume), takes the run directory's lock, prepares the data once,
then trains in this process (one rank) or through torchrun's launcher, and says how it ended.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from meshlm.config import load_config, resolve
from meshlm.config_toml import to_toml
from meshlm.errors import usage_error


def train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (the main job)",
                       description="Train a Llama-style model. With no arguments: the tiny preset on the "
                                   "default Shakespeare corpus, in a few minutes on a CPU.")
    p.add_argument("--config", help="a TOML config file (see configs/)")
    p.add_argument("--nproc", type=int, default=1, help="ranks per node, started through torchrun")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (multi-node: also --rdzv-endpoint)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's number in 0..nnodes-1, for meshlm's messages (the rendezvous decides which "
                        "node runs global rank 0)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (node 0) for multi-node runs")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts the ranks this many times after a failure; each restart resumes "
                        "from the newest checkpoint")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. train.steps=50 parallel.dp=2")


def cmd_train(args) -> int:
    if args.nproc < 1:
        return usage_error(f"--nproc: must be >= 1, got {args.nproc}")
    if args.nnodes < 1:
        return usage_error(f"--nnodes: must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        return usage_error(f"--node-rank: must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        return usage_error("--rdzv-endpoint: required when --nnodes > 1 (HOST:PORT of node 0)")
    if args.max_restarts < 0:
        return usage_error(f"--max-restarts: must be >= 0, got {args.max_restarts}")
    world_size = args.nproc * args.nnodes
    cfg = resolve(load_config(args.config, args.overrides), world_size=world_size)
    from meshlm.debug.doctor import local_gpu_shortfall

    # Before any rank starts: NCCL needs one GPU per local rank (else "invalid device ordinal" from each).
    shortfall = local_gpu_shortfall(args.nproc, cfg.parallel.backend)
    if shortfall:
        return usage_error(": ".join(shortfall))
    from meshlm.train.run_lock import run_dir_lock

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with run_dir_lock(run_dir, args.node_rank):  # one train per run.dir: before its checkpoints are read
        return _train_locked(args, cfg, run_dir, world_size)


def _train_locked(args, cfg, run_dir: Path, world_size: int) -> int:
    from meshlm.train.checkpoint.resume import check_same_data, precheck
    from meshlm.train.data import prepare_data

    # Before any rank starts: a requested checkpoint must be one, and fit this model (exit 2).
    resume_from = precheck(cfg, warn=lambda msg: print(msg, file=sys.stderr))
    (run_dir / "config.toml").write_text(to_toml(cfg))
    # Data is prepared once here, before ranks start, so N ranks never race to build the cache.
    data = prepare_data(cfg.data, cfg.model.vocab_size, log=lambda msg: print(msg, file=sys.stderr))
    check_same_data(resume_from, data, cfg)  # the checkpoint's loader position is over this data (exit 2)
    print(f"meshlm: {cfg.model.preset} model ({cfg.model.dim}d x {cfg.model.n_layers}L), "
          f"{world_size} rank(s) dp={cfg.parallel.dp}, {cfg.train.steps} steps of "
          f"{cfg.train.global_batch_size}x{cfg.train.seq_len} tokens, run dir {run_dir}"
          + (f", resuming from {resume_from}" if resume_from else ""), flush=True)
    from meshlm.debug.dumps import clear_dumps

    clear_dumps(run_dir)  # this run's dumps and logs only (meshlm debug analyze), with one rank or many
    t0 = time.perf_counter()
    interrupted = False  # Ctrl-C reached the launcher, which sent the ranks SIGTERM (launch.py)
    elsewhere = None  # where global rank 0 ran, when not among this launcher's ranks (train/rank0_node.py)
    if world_size == 1 and args.max_restarts == 0:
        from meshlm.train.worker import train_rank

        from meshlm.debug.guard import RankFailed, RankGuard

        try:  # a RunError (e.g. no usable checkpoint) is one line and exit 1, in main
            with RankGuard(cfg, 0, 1) as guard:
                train_rank(cfg, guard)
        except RankFailed:  # the guard printed its report (OOM, non-finite step, an exception)
            return 1
    else:
        from meshlm.launch import launch

        (run_dir / "preempted.json").unlink(missing_ok=True)  # only this run's ranks may leave one
        from meshlm.train.rank0_node import rank0_elsewhere, tag_launch

        launch_id = tag_launch(args.node_rank, run_dir)
        code = launch(args.nproc, "meshlm.train.worker", ["--config", str(run_dir / "config.toml")],
                      nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint,
                      max_restarts=args.max_restarts, explain=lambda: _failure_line(run_dir))
        if code and not (run_dir / "preempted.json").exists():
            return code
        interrupted = code == 130
        elsewhere = rank0_elsewhere(run_dir, launch_id) if args.nnodes > 1 else None
    preempted = _read_preempted(run_dir)
    if preempted:
        if interrupted:
            preempted["signal"] = "Ctrl-C"
        if preempted["checkpoint"] is None:  # several nodes without a shared run.dir: nothing to continue from
            print(f"meshlm: stopped by {preempted['signal']} after step {preempted['step']}; no checkpoint (the "
                  f"nodes do not share run.dir), so the run cannot be continued")
        else:
            print(f"meshlm: stopped by {preempted['signal']} after step {preempted['step']}; checkpoint "
                  f"{preempted['checkpoint']}; {_how_to_continue(cfg.checkpoint.resume)}")
        return 0
    if elsewhere is not None:  # rank 0's metrics, final/ and so the sample are on another node
        from meshlm.train.rank0_node import elsewhere_line

        print(f"meshlm: this node's ranks finished in {time.perf_counter() - t0:.0f} s; {elsewhere_line(elsewhere)}")
        return 0
    print(f"meshlm: trained in {time.perf_counter() - t0:.0f} s; metrics in {run_dir / 'metrics.jsonl'}")
    if cfg.run.sample_tokens:
        _print_sample(run_dir, cfg.run.sample_prompt, cfg.run.sample_tokens)
    return 0


def _how_to_continue(resume: str) -> str:
    """Only `auto` continues from the checkpoint just saved: the same command with `never` would
    start over (setting this run's checkpoints aside), with a path resume that path again."""
    if resume == "auto":
        return "run the same command again to continue"
    return f"to continue, run the same command with checkpoint.resume=auto (in place of checkpoint.resume={resume})"


def _failure_line(run_dir: Path) -> str | None:
    """The one-line verdict of a failed run, from the ranks' dumps (None: no rank left one)."""
    from meshlm.debug.analyze import analyze

    result = analyze(run_dir)
    if result["verdict"] in ("none", "ok"):
        return None
    return f"{result['line']} (details: meshlm debug analyze {run_dir})"


def _read_preempted(run_dir: Path) -> dict | None:
    """What the ranks left when a signal stopped them after a checkpoint (train/worker.py)."""
    import json

    marker = run_dir / "preempted.json"
    if not marker.exists():
        return None
    info = json.loads(marker.read_text())
    marker.unlink()
    return info


def _print_sample(model_dir: Path, prompt: str, n_tokens: int) -> None:
    from meshlm.train.generate import sample
    from meshlm.train.weights import load_trained

    model, tokenizer, _cfg, end_id = load_trained(model_dir)
    text = sample(model, tokenizer, prompt, max_new_tokens=n_tokens, end_id=end_id)
    print(f"\n--- sample ({n_tokens} tokens, temperature 0.8, top-k 40) ---\n{text}\n---")
