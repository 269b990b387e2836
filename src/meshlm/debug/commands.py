"""`meshlm doctor` and `meshlm debug`: the command-line side of debug/ (parsers and entry points;
the work is in doctor.py and analyze.py)."""

from __future__ import annotations

import json
from pathlib import Path

from meshlm.errors import usage_error


# --------------------------------------------------------------------------- doctor


def doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine before a run: versions, GPUs, limits, a local collective",
                       description="One line per check, ok or what to do; exit 1 if one fails. "
                                   "See docs/debugging.md.")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks per node you mean to train with (default: the GPUs on CUDA, else 2)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="as parallel.backend: auto = nccl with CUDA and NCCL, else gloo")
    p.add_argument("--port", type=int, default=None,
                   help="the rendezvous port to check (default: $MASTER_PORT or 29500)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_doctor(args) -> int:
    from meshlm.debug.doctor import run

    return run(args)


# --------------------------------------------------------------------------- debug


def debug_parser(sub) -> None:
    p = sub.add_parser("debug", help="explain a failed run: hang, desync, OOM, non-finite step",
                       description="See docs/debugging.md.")
    actions = p.add_subparsers(dest="action", required=True)
    a = actions.add_parser("analyze", help="one line on what went wrong, from the ranks' dumps in RUN_DIR/debug")
    a.add_argument("run_dir", metavar="RUN_DIR")
    a.add_argument("--json", action="store_true", help="print one JSON object (verdict, ranks, group, seq, op, ...)")


def cmd_debug(args) -> int:
    from meshlm.debug.analyze import analyze

    if not Path(args.run_dir).is_dir():
        return usage_error(f"RUN_DIR: {args.run_dir} is not a directory")
    result = analyze(args.run_dir)
    if result["verdict"] == "none":
        return usage_error(f"RUN_DIR: {result['line']}")
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print("\n".join([result["line"], *(f"  {line}" for line in result["details"])]))
    return 0
