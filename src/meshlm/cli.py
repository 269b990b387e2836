"""`meshlm` command line: thin entry points; the work lives in the modules they call.

Exit codes (DESIGN.md): 0 success, 2 bad usage or bad config (one line naming the key, no
traceback), 1 runtime failure.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from meshlm.config import ConfigError, RunError, load_config, resolve, to_toml
from meshlm.debug.commands import cmd_debug, cmd_doctor, debug_parser, doctor_parser
from meshlm.errors import usage_error


_fail_usage = usage_error  # errors.py: one line, exit 2 (debug/commands.py uses it too)


# --------------------------------------------------------------------------- train


def _train_parser(sub) -> None:
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
        return _fail_usage(f"--nproc: must be >= 1, got {args.nproc}")
    if args.nnodes < 1:
        return _fail_usage(f"--nnodes: must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        return _fail_usage(f"--node-rank: must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        return _fail_usage("--rdzv-endpoint: required when --nnodes > 1 (HOST:PORT of node 0)")
    if args.max_restarts < 0:
        return _fail_usage(f"--max-restarts: must be >= 0, got {args.max_restarts}")
    world_size = args.nproc * args.nnodes
    cfg = resolve(load_config(args.config, args.overrides), world_size=world_size)
    from meshlm.debug.doctor import local_gpu_shortfall

    # Before any rank starts: NCCL needs one GPU per local rank (else "invalid device ordinal" from each).
    shortfall = local_gpu_shortfall(args.nproc, cfg.parallel.backend)
    if shortfall:
        return _fail_usage(": ".join(shortfall))
    from meshlm.train.run_lock import run_dir_lock

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with run_dir_lock(run_dir, args.node_rank):  # one train per run.dir: before its checkpoints are read
        return _train_locked(args, cfg, run_dir, world_size)


def _train_locked(args, cfg, run_dir: Path, world_size: int) -> int:
    from meshlm.train.checkpoint.resume import precheck
    from meshlm.train.data import prepare_data

    # Before any rank starts: a requested checkpoint must be one, and fit this model (exit 2).
    resume_from = precheck(cfg, warn=lambda msg: print(msg, file=sys.stderr))
    (run_dir / "config.toml").write_text(to_toml(cfg))
    # Data is prepared once here, before ranks start, so N ranks never race to build the cache.
    prepare_data(cfg.data, cfg.model.vocab_size, log=lambda msg: print(msg, file=sys.stderr))
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
                  f"{preempted['checkpoint']}; run the same command again to continue")
        return 0
    if elsewhere is not None:  # rank 0's metrics, final/ and so the sample are on another node
        from meshlm.train.rank0_node import elsewhere_line

        print(f"meshlm: this node's ranks finished in {time.perf_counter() - t0:.0f} s; {elsewhere_line(elsewhere)}")
        return 0
    print(f"meshlm: trained in {time.perf_counter() - t0:.0f} s; metrics in {run_dir / 'metrics.jsonl'}")
    if cfg.run.sample_tokens:
        _print_sample(run_dir, cfg.run.sample_prompt, cfg.run.sample_tokens)
    return 0


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

    model, tokenizer, _ = load_trained(model_dir)
    text = sample(model, tokenizer, prompt, max_new_tokens=n_tokens)
    print(f"\n--- sample ({n_tokens} tokens, temperature 0.8, top-k 40) ---\n{text}\n---")


# --------------------------------------------------------------------------- generate


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a trained model")
    p.add_argument("--checkpoint", required=True, help="a run directory or its final/ directory")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40, help="0 = no top-k filter")
    p.add_argument("--seed", type=int, default=0)


def cmd_generate(args) -> int:
    from meshlm.train.generate import sample
    from meshlm.train.weights import load_trained

    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        return _fail_usage(f"--temperature: must be a number >= 0, got {args.temperature}")
    if not 0 <= args.seed < 2**63:  # torch.Generator's seeds
        return _fail_usage(f"--seed: must be in 0..2**63-1, got {args.seed}")
    if args.max_new_tokens < 0 or args.top_k < 0:
        return _fail_usage("--max-new-tokens and --top-k must be >= 0")
    model, tokenizer, _ = load_trained(args.checkpoint)
    print(sample(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, top_k=args.top_k or None, seed=args.seed))
    return 0


# --------------------------------------------------------------------------- export


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a Hugging Face Llama directory from a checkpoint",
                       description="Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json "
                                   "that transformers' LlamaForCausalLM and AutoTokenizer load.")
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint directory, a run directory (its newest good checkpoint) or a final/ directory")
    p.add_argument("--out", required=True, help="the directory to write (replaced whole if it is an earlier export)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def cmd_export(args) -> int:
    import json

    from meshlm.train.checkpoint.hf_export import export_hf

    try:  # a corrupt checkpoint is a RunError (one line, exit 1, in main)
        report = export_hf(Path(args.checkpoint), Path(args.out))
    except OSError as e:  # a full disk, a permission: runtime failures
        print(f"meshlm: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"out": str(report.out), "source": str(report.source), "step": report.step,
                          "n_params": report.n_params, "bytes": report.bytes, "seconds": round(report.seconds, 3)}))
    else:
        step = f" (step {report.step})" if report.step is not None else ""
        print(f"meshlm: exported {report.source}{step}: {report.n_params:,} parameters, "
              f"{report.bytes / 1e6:.1f} MB, to {report.out} in {report.seconds:.2f} s")
    return 0


def _import_parser(sub) -> None:
    p = sub.add_parser("import", help="a Hugging Face Llama directory as a meshlm final/ directory",
                       description="Write RUN_DIR/final/ (meshlm's weights, tokenizer and config) from a Hugging "
                                   "Face Llama directory, for meshlm generate. To train from one, use "
                                   "meshlm train model.init_from=DIR.")
    p.add_argument("--hf", required=True, help="a Hugging Face Llama directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--out", required=True, help="the run directory to write final/ into")
    p.add_argument("--force", action="store_true", help="replace a model the run directory already holds")


def cmd_import(args) -> int:
    from meshlm.train.checkpoint.hf_import import import_hf

    final = import_hf(Path(args.hf), Path(args.out), replace=args.force)
    print(f"meshlm: imported {args.hf} to {final}")
    return 0


# --------------------------------------------------------------------------- bench


BENCHES = {"comm": "meshlm.comm.bench", "dp": "meshlm.bench.dp", "tp": "meshlm.bench.tp", "pp": "meshlm.bench.pp", "cp": "meshlm.bench.cp",
           "data": "meshlm.bench.data", "scaling": "meshlm.bench.scaling", "gpu": "meshlm.bench.gpu"}


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks against PyTorch's own implementations",
                       description=f"meshlm bench {{{','.join(BENCHES)}}} [options]; see meshlm bench NAME --help")
    p.add_argument("name", choices=sorted(BENCHES))
    p.add_argument("bench_args", nargs=argparse.REMAINDER)


def cmd_bench(args) -> int:
    import importlib

    return importlib.import_module(BENCHES[args.name]).main(args.bench_args)


# --------------------------------------------------------------------------- simulate


SIMULATORS = {"pipeline": "meshlm.analysis.pipeline_sim"}


def _simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a schedule on per-op costs (no ranks started)",
                       description="meshlm simulate pipeline --schedule S --pp P --microbatches M [...]")
    p.add_argument("name", choices=sorted(SIMULATORS))
    p.add_argument("sim_args", nargs=argparse.REMAINDER)


def cmd_simulate(args) -> int:
    import importlib

    return importlib.import_module(SIMULATORS[args.name]).main(args.sim_args)


# --------------------------------------------------------------------------- memory


def _memory_parser(sub) -> None:
    p = sub.add_parser("memory", help="predicted per-rank memory of a config, by category (no ranks started)",
                       description="The memory model's breakdown per rank role for the same keys as meshlm train; "
                                   "the layout comes from parallel.* alone. See docs/memory.md.")
    p.add_argument("--config", help="a TOML config file (see configs/)")
    p.add_argument("--device-memory", help="capacity per rank, e.g. 80GiB (default: the visible GPU's)")
    p.add_argument("--backend", choices=("nccl", "gloo", "shm"), default="nccl",
                   help="collectives library: nccl (GPUs, default), shm (CPU ranks on one host) or gloo (CPU "
                        "ranks across hosts)")
    p.add_argument("--plot", metavar="FILE.png", help="stacked breakdown for zero 0-3, recompute on and off")
    p.add_argument("--phases", action="store_true",
                   help="also every point of each role's step where memory can peak, in order (the model's walk)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. model.preset=llama3-8b parallel.dp=8")


def cmd_memory(args) -> int:
    from meshlm.analysis.memory_report import run

    return run(args)


# --------------------------------------------------------------------------- plan


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="the layouts that fit a model on a cluster, ranked, bottleneck named",
                       description="Enumerate dp x tp x pp x cp x ZeRO x recompute x micro-batch, keep what fits "
                                   "(meshlm memory's model), rank by predicted throughput. No ranks started. "
                                   "See docs/planning.md.")
    p.add_argument("--model", required=True, help="a model preset, e.g. llama3-70b")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the GPU's usual node (8)")
    p.add_argument("--gpu", default="h100-80gb", help="h100-80gb, h200-141gb, a100-80gb, a100-40gb, b200-180gb")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's max_seq_len)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step (default: ~4M tokens, a multiple of --gpus)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (mixed precision) or float32")
    p.add_argument("--top", type=int, default=5, help="how many layouts to print")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_plan(args) -> int:
    from meshlm.analysis.plan_report import run

    return run(args)


# --------------------------------------------------------------------------- data


def _data_parser(sub) -> None:
    p = sub.add_parser("data", help="prepare or inspect the token cache of a config (no training)",
                       description="See docs/data.md.")
    actions = p.add_subparsers(dest="action", required=True)
    for name, text in (("prepare", "tokenize the corpus of a config into its cache (once, before a job)"),
                       ("inspect", "documents, tokens, bytes/token, longest documents, epochs per corpus")):
        a = actions.add_parser(name, help=text, description=text)
        a.add_argument("--config", help="a TOML config file (see configs/)")
        a.add_argument("--json", action="store_true", help="print one JSON object")
        a.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. data.path=corpus/ data.workers=8")


def cmd_data(args) -> int:
    from meshlm.data.inspect import run_inspect, run_prepare

    return run_prepare(args) if args.action == "prepare" else run_inspect(args)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshlm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _generate_parser(sub)
    _export_parser(sub)
    _import_parser(sub)
    _bench_parser(sub)
    _simulate_parser(sub)
    _plan_parser(sub)
    _memory_parser(sub)
    doctor_parser(sub)
    debug_parser(sub)
    _data_parser(sub)
    # Overrides may come on both sides of an option (`train a=1 --nproc 2 b=2`): argparse leaves the
    # ones after it over; they are overrides still, in order.
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any(a.startswith("-") or "=" not in a for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    commands = {"import": cmd_import, "train": cmd_train, "generate": cmd_generate, "export": cmd_export, "bench": cmd_bench,
                "simulate": cmd_simulate, "plan": cmd_plan, "memory": cmd_memory,
                "doctor": cmd_doctor, "debug": cmd_debug, "data": cmd_data}
    try:
        return commands[args.command](args)
    except ConfigError as e:
        return _fail_usage(str(e))
    except RunError as e:
        print(f"meshlm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("meshlm: interrupted", file=sys.stderr)
        return 130


def entry() -> int:
    """The `meshlm` command: `main`, then a quick exit. Freezing the objects left skips the garbage
    collector's last pass over every torch object at interpreter exit (~0.5-1 s per process)."""
    code = main()
    import gc

    gc.freeze()
    return code


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(entry())
