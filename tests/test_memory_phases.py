"""The memory model phase by phase: every window of a training step (each forward, the loss,
each backward, the gradient reduction, the optimizer step) against the model's point for it, as
bytes above the step's starting state (tests/memory_phases.py); printed only, for the configs not
yet within 10% (two pipelines, with their weight-gradient flush, and autocast under full recompute).

The peak test (test_memory.py) holds the largest point to 10%; here every point is held to the
same 10% of what the window adds, so a term that never sets the peak is checked too. The
sequence is 48 tokens per row, so no two of the model's terms are equal by accident (at 32 the
logits and the head's weight gradient have the same size, and either could stand for the other).
`python tests/test_memory_phases.py` prints the table in docs/memory.md."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from helpers import small_cfg, write_offline_corpus  # noqa: E402
from memory_phases import compare, measure_windows  # noqa: E402

from meshlm.testing import run_ranks  # noqa: E402

TOLERANCE = 0.10
SEQ = ("train.seq_len=48",)
GRID: list[tuple[int, str, tuple[str, ...]]] = [  # (ranks, the collectives' backend, overrides)
    (1, "shm", ()),
    (1, "shm", ("train.recompute=full",)),
    (1, "shm", ("train.recompute=selective",)),
    (1, "shm", ("train.micro_batch_size=8",)),
    (1, "shm", ("model.tie_embeddings=true",)),
    (1, "shm", ("train.dtype=bfloat16",)),
    (2, "shm", ("parallel.zero=0",)),
    (2, "shm", ("parallel.zero=1",)),
    (2, "shm", ("parallel.zero=2",)),
    (2, "shm", ("parallel.zero=3",)),
    (2, "shm", ("parallel.zero=1", "model.tie_embeddings=true")),
    (2, "shm", ("parallel.zero=3", "model.tie_embeddings=true")),
    (2, "shm", ("parallel.zero=1", "train.dtype=bfloat16")),
    (2, "shm", ("parallel.zero=2", "train.dtype=bfloat16")),
    (2, "shm", ("parallel.zero=3", "train.dtype=bfloat16")),
    (2, "shm", ("parallel.tp=2",)),
    (2, "shm", ("parallel.tp=2", "parallel.sp=true")),
    (2, "shm", ("parallel.cp=2",)),
    (2, "gloo", ("parallel.zero=1",)),
    (2, "gloo", ("parallel.zero=2",)),
    (2, "gloo", ("parallel.zero=3",)),
    (4, "shm", ("parallel.zero=3",)),
]
# Not yet within 10% (docs/memory.md says where): printed by the table, not asserted.
NOT_YET: list[tuple[int, str, tuple[str, ...]]] = [
    (1, "shm", ("train.dtype=bfloat16", "train.recompute=full")),  # autocast's transients in a rebuilt block
    (2, "shm", ("parallel.pp=2", "parallel.pp_schedule=1f1b")),
    (2, "shm", ("parallel.pp=2", "parallel.pp_schedule=gpipe", "train.recompute=full")),
]


def measured_vs_predicted(corpus: Path, run_dir: Path, grid=GRID) -> list[tuple]:
    """(ranks, backend, overrides, pp rank, window, measured, predicted) for every window."""
    import os

    rows = []
    for (world, backend), configs in _groups(grid).items():
        extras = [(*SEQ, *extra) for extra in configs]
        saved = os.environ.get("MESHLM_SHM_DISABLE")
        os.environ["MESHLM_SHM_DISABLE"] = "1" if backend == "gloo" else "0"  # gloo: meshlm's rings
        try:
            if world == 1:
                per_rank = [measure_windows(1, extras, corpus, run_dir)]
            else:
                per_rank = run_ranks(measure_windows, world, world, extras, corpus, run_dir, timeout=300)
        finally:
            if saved is None:
                os.environ.pop("MESHLM_SHM_DISABLE")
            else:
                os.environ["MESHLM_SHM_DISABLE"] = saved
        for i, extra in enumerate(configs):
            cfg = small_cfg(corpus, run_dir, world, *SEQ, *extra)
            for row in compare(cfg, backend, [rank[i] for rank in per_rank]):
                rows.append((world, backend, extra, *row))
    return rows


def _groups(grid) -> dict[tuple[int, str], list[tuple[str, ...]]]:
    groups: dict[tuple[int, str], list[tuple[str, ...]]] = {}
    for world, backend, extra in grid:
        groups.setdefault((world, backend), []).append(extra)
    return groups


def test_every_phase_of_the_step_within_ten_percent_of_measured(tmp_path):
    corpus = write_offline_corpus(tmp_path / "corpus")
    rows = measured_vs_predicted(corpus, tmp_path / "run")
    bad = [row for row in rows if abs(row[-1] / row[-2] - 1) > TOLERANCE]
    assert not bad, bad


if __name__ == "__main__":  # the table in docs/memory.md
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_offline_corpus(Path(tmp) / "corpus")
        print("| ranks | backend | overrides | role | window | measured | predicted | error |")
        print("|---|---|---|---|---|---:|---:|---:|")
        rows = measured_vs_predicted(corpus, Path(tmp) / "run", GRID + NOT_YET)
        for world, backend, extra, pp_rank, window, measured, predicted in rows:
            print(f"| {world} | {backend} | {' '.join(extra) or '(defaults)'} | pp{pp_rank} | {window} | {measured:,} | "
                  f"{predicted:,} | {predicted / measured - 1:+.1%} |")
