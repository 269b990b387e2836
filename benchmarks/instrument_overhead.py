"""What meshlm's default instruments cost per step: defaults against the same step with the memory
tracker off, and with it on every step (the precise mode), round-robin in one job.

usage: PYTHONPATH=src .venv/bin/python benchmarks/instrument_overhead.py [STEPS] [ROUNDS]
(STEPS x ROUNDS steps per side, the three sides taking turns step by step)
Layouts: dp=2 with zero 0-3, tp=2, pp=2 (2 forked gloo ranks pinned to a core each), the shape of
issue 15 (dim 256, 4 layers, vocab 1024, seq 128, micro-batch 4, global batch 8, fp32).
Per layout it prints the median step time of each side and:
  default overhead = (default - off) / off + (every - off) / off / memory_interval
the first term the instruments of every step (flight recorder, fingerprint, the step-end gather,
phase marks), the second the memory tracker's sampled steps spread over the interval.
The flight recorder and fingerprint run in "off" too (they cannot be turned off): `meshlm bench
comm` measures the recorder per op.
"""
import statistics
import sys
import time

from meshlm.testing import run_ranks

SHAPE = ["model.preset=debug", "model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
         "model.vocab_size=1024", "train.seq_len=128", "train.micro_batch_size=4", "train.global_batch_size=8",
         "train.dtype=float32", "train.eval_interval=0"]
LAYOUTS = {"dp2-zero0": ["parallel.dp=2", "parallel.zero=0"], "dp2-zero1": ["parallel.dp=2", "parallel.zero=1"],
           "dp2-zero2": ["parallel.dp=2", "parallel.zero=2"], "dp2-zero3": ["parallel.dp=2", "parallel.zero=3"],
           "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2", "parallel.pp_schedule=1f1b"]}
SIDES = {"default": [], "off": ["train.track_memory=false"], "every": ["train.memory_interval=1"]}


def rank_fn(layout: list[str], steps: int, rounds: int, corpus: str, run_dir: str) -> dict[str, list[float]]:
    import torch

    from meshlm.bench.report import prepare_cpu_rank
    from meshlm.config import load_config, resolve
    from meshlm.mesh import ParallelContext
    from meshlm.train.data import prepare_data
    from meshlm.train.trainer import Trainer

    times: dict[str, list[float]] = {side: [] for side in SIDES}
    trainers = {}
    for side, extra in SIDES.items():
        cfg = resolve(load_config(None, [*SHAPE, *layout, *extra, f"data.path={corpus}", f"run.dir={run_dir}"]),
                      world_size=2)
        ctx = ParallelContext.from_config(cfg.parallel)
        prepare_cpu_rank(ctx.rank, ctx.device)
        torch.manual_seed(0)
        trainer = Trainer(cfg, ctx, prepare_data(cfg.data, cfg.model.vocab_size, log=lambda m: None))
        trainer.metrics.active = False
        for _ in range(2):  # steps 1 and 2 are measured by every side: warm up past them
            trainer.train_step()
        trainers[side] = trainer
    for _ in range(rounds * steps):  # the sides alternate step by step: a load change hits all of them
        for side, trainer in trainers.items():
            t0 = time.perf_counter()
            trainer.train_step()
            times[side].append(time.perf_counter() - t0)
    return times


def main() -> None:
    import tempfile
    from pathlib import Path

    from meshlm.config import TrainConfig

    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    root = Path(tempfile.mkdtemp(prefix="meshlm-overhead-"))
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(f"word{i % 997} the of and to" for i in range(60000)))
    print(f"{'layout':<10} {'default ms':>11} {'off ms':>8} {'every ms':>9} {'per-step':>9} {'sampled':>8} {'default overhead':>17}")
    for name, layout in LAYOUTS.items():
        times = run_ranks(rank_fn, 2, layout, steps, rounds, str(corpus), str(root / name), timeout=900)[0]
        med = {side: statistics.median(t) for side, t in times.items()}
        # medians of the paired ratios (the same round), not ratios of medians
        per_step = statistics.median(d / o for d, o in zip(times["default"], times["off"])) - 1
        every = statistics.median(e / o for e, o in zip(times["every"], times["off"])) - 1
        sampled = every / TrainConfig().memory_interval
        print(f"{name:<10} {med['default'] * 1e3:>11.1f} {med['off'] * 1e3:>8.1f} {med['every'] * 1e3:>9.1f} "
              f"{per_step:>+9.1%} {sampled:>+8.1%} {per_step + sampled:>+17.1%}")


if __name__ == "__main__":
    main()
