"""`meshlm` command line: thin entry points; the work lives in the modules they call.

Exit codes (DESIGN.md): 0 success, 2 bad usage or bad config (one line naming the key, no
traceback), 1 runtime failure.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from meshlm.config import ConfigError, RunError
from meshlm.debug.commands import cmd_debug, cmd_doctor, debug_parser, doctor_parser
from meshlm.errors import OneLineErrorParser, usage_error
from meshlm.train.command import cmd_train, train_parser


_fail_usage = usage_error  # errors.py: one line, exit 2 (debug/commands.py uses it too)


# --------------------------------------------------------------------------- generate


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a trained model",
                       description="Continue a prompt with a trained model (any layout's checkpoint, or final/).")
    p.add_argument("--checkpoint", required=True,
                   help="a run directory (its final/, else its newest good checkpoint), a final/ directory or a "
                        "checkpoint directory")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40, help="0 = no top-k filter")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the most probable tokens that sum to this probability (1 = off)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="stop at the end-of-text token the run separated documents with (default: go on)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:1, ...")


def cmd_generate(args) -> int:
    from meshlm.train.generate import sample
    from meshlm.train.weights import load_trained

    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        return _fail_usage(f"--temperature: must be a number >= 0, got {args.temperature}")
    if not 0 <= args.seed < 2**63:  # torch.Generator's seeds
        return _fail_usage(f"--seed: must be in 0..2**63-1, got {args.seed}")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        return _fail_usage(f"--top-p: must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens < 0 or args.top_k < 0:
        return _fail_usage("--max-new-tokens and --top-k must be >= 0")
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        return _fail_usage(f"--device: {args.device!r} is not a device ({str(e).splitlines()[0]})")
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        return _fail_usage(f"--device: {args.device}: no such CUDA device here ({torch.cuda.device_count()} visible)")
    if device.type not in ("cpu", "cuda"):
        return _fail_usage(f"--device: {args.device}: meshlm generate runs on cpu or cuda")
    model, tokenizer, _cfg, end_id = load_trained(args.checkpoint, device=device)
    print(sample(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, top_k=args.top_k or None, seed=args.seed,
                 end_id=end_id, top_p=args.top_p,
                 stop_at_end=args.stop_at_eos))
    return 0


# --------------------------------------------------------------------------- export


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a Hugging Face Llama directory from a checkpoint",
                       description="Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json "
                                   "that transformers' LlamaForCausalLM and AutoTokenizer load.")
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint directory, a run directory (its newest good checkpoint) or a final/ directory")
    p.add_argument("--out", required=True, help="the directory to write (replaced whole if it is an earlier export)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the weights' dtype in model.safetensors (default float32: the masters as trained)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def cmd_export(args) -> int:
    import json

    from meshlm.train.checkpoint.hf_export import export_hf

    try:  # a corrupt checkpoint is a RunError (one line, exit 1, in main)
        report = export_hf(Path(args.checkpoint), Path(args.out), dtype=args.dtype)
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
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def cmd_import(args) -> int:
    from meshlm.train.checkpoint.hf_import import import_hf

    try:
        final, aside = import_hf(Path(args.hf), Path(args.out), replace=args.force)
    except OSError as e:  # a full disk, a permission: runtime failures, one line as export's
        print(f"meshlm: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        import json

        print(json.dumps({"source": str(args.hf), "out": str(final),
                          "moved_checkpoints": None if aside is None else str(aside)}))
        return 0
    print(f"meshlm: imported {args.hf} to {final}")
    if aside is not None:
        print(f"meshlm: moved the checkpoints it replaces to {aside}")
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
                                   "the layout comes from parallel.* alone. Exits 1 when the peak exceeds the "
                                   "device's memory, 2 on bad input. See docs/memory.md.")
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
    parser = OneLineErrorParser(prog="meshlm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser(sub)
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
        command = sub.choices[args.command]  # its error names its own --help (a `bench`'s: meshlm bench's)
        command.error(f"unrecognized arguments: {' '.join(extra)}")
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
    collector's last pass over every torch object at interpreter exit (~0.5-1 s per process).
    A reader that went away (`meshlm generate ... | head -3`) ends the command quietly, exit 1:
    its output has nowhere to go, which is no reason for a traceback."""
    try:
        code = main()
        sys.stdout.flush()  # buffered output meets the closed pipe here, not at interpreter exit
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 1
    import gc

    gc.freeze()
    return code


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(entry())
