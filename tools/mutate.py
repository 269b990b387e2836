"""`make mutate [MODULES=...]`: mutation testing of the modules that hold meshlm's core maths.

A mutant is a one-token change (a `+` for a `-`, `<` for `<=`, a constant off by one, a loop that
never runs, ...). A test suite that passes with a mutant in place cannot tell that code from the
real one: the mutant *survived*, and either a test is missing or the change is equivalent.

The tool is cosmic-ray, not mutmut: meshlm's tests fork ranks. mutmut 3 switches mutants inside
one process through trampolines and learns which tests cover a function by recording its calls
in the pytest process, so code that runs only in forked ranks (the collectives, the sharded
engines) looks untested to it. cosmic-ray writes each mutant into the source file and runs an
ordinary test command, which every forked rank then executes as well.

Each module is mutated in a private copy of src/ and tests/ (build/mutate/NAME/), never in the
working tree, against the tests that exist for it. Results: build/mutate/NAME/summary.json and a
table on stdout; docs/testing.md records the scores and explains every surviving mutant.

    .venv/bin/python tools/mutate.py              # every module (what `make mutate` runs)
    .venv/bin/python tools/mutate.py ring config  # some
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mutate_modules import MODULES  # name: (module, its tests); tools/ is this script's sys.path[0]

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "mutate"

# Operators left out, and why: bit shifts, bitwise ops and powers in place of arithmetic crash or
# produce absurd sizes at once (killed, but each costs a test run and says nothing); `is`/`is not`
# for `==` on numbers is not a bug anyone writes; the variable inserter/replacer rename names into
# NameErrors. What is left: arithmetic and comparison swaps, constants +-1, and/or, not, booleans,
# break/continue, loops that never run, exception types, decorators.
EXCLUDED_OPERATORS = [
    r"core/ReplaceBinaryOperator_.*_(Pow|RShift|LShift|BitOr|BitAnd|BitXor)$",
    r"core/ReplaceComparisonOperator_.*_(Is|IsNot)$",
    r"core/VariableInserter", r"core/VariableReplacer",
]


def _copy_tree(workdir: Path) -> None:
    if workdir.exists():
        shutil.rmtree(workdir)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for part in ("src", "tests", "docs", "configs"):
        if (ROOT / part).exists():
            shutil.copytree(ROOT / part, workdir / part, ignore=skip)


def _test_command(test_args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                             *test_args])


def _env(workdir: Path) -> dict:
    """The copy's src/ first on the path (ahead of the editable install), one thread per rank."""
    return {**os.environ, "PYTHONPATH": str(workdir / "src"), "OMP_NUM_THREADS": "1"}


def _cosmic_ray(*args: str, cwd: Path, env: dict) -> None:
    bin_dir = Path(sys.executable).parent
    subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=cwd, env=env, check=True)


def _skip_annotations(session: Path, module: Path) -> int:
    """Mark mutants inside type annotations skipped: under `from __future__ import annotations`
    (every meshlm module) annotations are never evaluated, so `list[int] | None` turned into
    `list[int] // None` is the same program. Returns how many."""
    import ast

    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    tree = ast.parse(module.read_text())
    spans = []
    for node in ast.walk(tree):
        annotations = [getattr(node, "returns", None), getattr(node, "annotation", None)]
        for ann in filter(None, annotations):
            spans.append(((ann.lineno, ann.col_offset), (ann.end_lineno, ann.end_col_offset)))
    skipped = 0
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            start = tuple(item.mutations[0].start_pos)
            if any(lo <= start < hi for lo, hi in spans):
                db.set_result(item.job_id, WorkResult(output="in an annotation", worker_outcome=WorkerOutcome.SKIPPED))
                skipped += 1
    return skipped


def _sample(session: Path, size: int) -> dict | None:
    """Keep a deterministic random sample of `size` pending mutants and mark the rest skipped.

    A module with many mutants (the schedules: ~600) would take an hour at ~6 s per test run
    (pytest and torch start-up dominate); a sample of 250 estimates its score within a few
    percent in half the time. `--all` runs every mutant."""
    import random

    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    def where(item):  # job ids are random: order by what the mutant is, so the sample repeats
        m = item.mutations[0]
        return tuple(m.start_pos), m.operator_name, m.occurrence

    with use_db(str(session), WorkDB.Mode.open) as db:
        pending = sorted(db.pending_work_items, key=where)
        if len(pending) <= size:
            return None
        keep = {item.job_id for item in random.Random(0).sample(pending, size)}
        for item in pending:
            if item.job_id not in keep:
                db.set_result(item.job_id, WorkResult(output="not in the sample", worker_outcome=WorkerOutcome.SKIPPED))
    return {"sampled": size, "of": len(pending)}


def _remove_orphaned_windows() -> None:
    """Mutants that break `SharedWindow.open`, or time out inside it, leave its /dev/shm file
    (comm/shared_memory.py): delete those whose creating process is gone."""
    for path in Path("/dev/shm").glob("meshlm-*-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


def run_module(name: str, sample: int) -> dict:
    module, test_args = MODULES[name]
    workdir = OUT / name
    _copy_tree(workdir)
    env = _env(workdir)
    t0 = time.perf_counter()
    baseline = subprocess.run(shlex.split(_test_command(test_args)), cwd=workdir, env=env, capture_output=True)
    baseline_s = time.perf_counter() - t0
    if baseline.returncode != 0:
        raise SystemExit(f"mutate: {name}: the unmutated tests fail:\n{baseline.stdout.decode()[-3000:]}")
    config = workdir / "cosmic-ray.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f'module-path = "{module}"\n'
        f"timeout = {max(60.0, 4 * baseline_s):.0f}.0\n"  # a hung collective counts as killed
        "excluded-modules = []\n"
        f"test-command = {json.dumps(_test_command(test_args))}\n"
        '[cosmic-ray.distributor]\nname = "local"\n'
        "[cosmic-ray.filters.operators-filter]\n"
        f"exclude-operators = {json.dumps(EXCLUDED_OPERATORS)}\n")
    session = workdir / "session.sqlite"
    session.unlink(missing_ok=True)
    _cosmic_ray("cosmic-ray", "init", str(config), str(session), cwd=workdir, env=env)
    _cosmic_ray("cr-filter-operators", str(session), str(config), cwd=workdir, env=env)
    _skip_annotations(session, workdir / module)
    sampled = _sample(session, sample) if sample else None
    t0 = time.perf_counter()
    _cosmic_ray("cosmic-ray", "exec", str(config), str(session), cwd=workdir, env=env)
    summary = _summarise(name, module, test_args, session, workdir, env)
    _remove_orphaned_windows()
    summary["sample"] = sampled
    summary["seconds"] = round(time.perf_counter() - t0)
    summary["baseline_seconds"] = round(baseline_s, 1)
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def recheck_survivors(name: str) -> dict:
    """Run the survivors of the last run of `name` again against the working tree's current
    tests (after new tests were written for them), without running every mutant again. The
    module itself must be unchanged since that run: mutants are stored as source positions."""
    import sqlite3

    module, test_args = MODULES[name]
    workdir = OUT / name
    session = workdir / "session.sqlite"
    if (ROOT / module).read_text() != (workdir / module).read_text():
        raise SystemExit(f"mutate: {module} differs from the copy of the last run of {name}: it changed (run it "
                         f"again in full), or that run was stopped with a mutant in place (copy the module back)")
    for part in ("tests", "docs"):
        shutil.rmtree(workdir / part)
        shutil.copytree(ROOT / part, workdir / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    config = workdir / "cosmic-ray.toml"
    config.write_text("\n".join(f"test-command = {json.dumps(_test_command(test_args))}"
                                if line.startswith("test-command") else line
                                for line in config.read_text().splitlines()) + "\n")
    with sqlite3.connect(session) as db:
        db.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'")
    env = _env(workdir)
    previous = json.loads((workdir / "summary.json").read_text())
    t0 = time.perf_counter()
    _cosmic_ray("cosmic-ray", "exec", str(config), str(session), cwd=workdir, env=env)
    summary = _summarise(name, module, test_args, session, workdir, env)
    _remove_orphaned_windows()
    summary.update(sample=previous["sample"], baseline_seconds=previous["baseline_seconds"],
                   seconds=previous["seconds"] + round(time.perf_counter() - t0))
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _summarise(name: str, module: str, test_args: list[str], session: Path, workdir: Path, env: dict) -> dict:
    dump = subprocess.run([str(Path(sys.executable).parent / "cosmic-ray"), "dump", str(session)], cwd=workdir,
                          env=env, capture_output=True, text=True, check=True).stdout
    counts = {"killed": 0, "survived": 0, "incompetent": 0, "skipped": 0}
    survivors = []
    for line in dump.splitlines():
        item, result = json.loads(line)
        if result is None or result.get("worker_outcome") == "skipped":
            counts["skipped"] += 1
            continue
        outcome = result.get("test_outcome") or "incompetent"
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome == "survived":
            mutation = item["mutations"][0]
            survivors.append({"line": mutation["start_pos"][0], "operator": mutation["operator_name"],
                              "diff": "\n".join(l for l in (result.get("diff") or "").splitlines()
                                                if l.startswith(("-", "+")) and not l.startswith(("---", "+++")))})
    tested = counts["killed"] + counts["survived"]
    return {"module": module, "tests": " ".join(test_args), **counts, "mutants": tested,
            "score": round(counts["killed"] / tested, 3) if tested else None,
            "survivors": sorted(survivors, key=lambda s: s["line"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", choices=[[], *MODULES], metavar="MODULE",
                        help=f"some of: {', '.join(MODULES)} (default: all)")
    parser.add_argument("--sample", type=int, default=250,
                        help="mutants per module, drawn at random (seed 0) where a module has more (default 250)")
    parser.add_argument("--all", action="store_true", help="every mutant, however many")
    parser.add_argument("--recheck", action="store_true",
                        help="only the last run's survivors, against the current tests")
    args = parser.parse_args()
    names = args.modules or list(MODULES)
    results = [recheck_survivors(name) if args.recheck else run_module(name, 0 if args.all else args.sample)
               for name in names]
    print(f"\n{'module':44} {'mutants':>11} {'killed':>6} {'survived':>8} {'score':>6} {'minutes':>7}")
    for r in results:
        of = f"{r['mutants']}/{r['sample']['of']}" if r["sample"] else str(r["mutants"])
        print(f"{r['module']:44} {of:>11} {r['killed']:6d} {r['survived']:8d} "
              f"{r['score'] if r['score'] is not None else '-':>6} {r['seconds'] / 60:7.1f}")
    for r in results:
        for s in r["survivors"]:
            print(f"\nsurvived: {r['module']}:{s['line']} ({s['operator']})\n{s['diff']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
