"""What one engine change buys: meshlm's pipeline engine with and without it, and torch's pipelining,
round-robin in one job (every order of the three in turn), on `meshlm bench pp`'s stages.

usage: .venv/bin/python benchmarks/ab_pp_engine.py SCHEDULE [ROUNDS] [defer|connection]
  defer (default): the second side has no deferred weight gradients (parallel.pp_defer_wgrad=false)
  connection:      the second side defers too, but sends both directions on one gloo connection
Two forked gloo ranks pinned to a core each, tiny preset, seq 128, 16 rows in 8 micro-batches.
Prints the median step of each side and the median (quartiles) of the per-round speed ratios.
"""
import itertools
import statistics
import sys
import time

import torch
import torch.distributed as dist

from meshlm.testing import run_ranks


def rank_fn(kind: str, rounds: int, change: str) -> dict[str, list[float]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from meshlm.bench.pp import VIRTUAL, ChunkModule, build_stage
    from meshlm.bench.report import prepare_cpu_rank
    from meshlm.comm import Comm
    from meshlm.config import load_config, resolve
    from meshlm.mesh import Layout, ParallelContext
    from meshlm.parallel.pipeline.engine import PipelineEngine
    from meshlm.parallel.pipeline.p2p import PipelineP2P
    from meshlm.parallel.pipeline.schedules import build_schedule
    from meshlm.model.loss import token_loss_sum

    pp, m, v = 2, 8, VIRTUAL[kind]
    ctx = ParallelContext(Layout(pp=pp))
    prepare_cpu_rank(ctx.rank, ctx.device)
    cfg = resolve(load_config(None, ["model.preset=tiny", "model.tie_embeddings=false", "train.seq_len=128",
                                     "train.global_batch_size=16", f"parallel.pp={pp}", f"parallel.pp_schedule={kind}",
                                     f"parallel.pp_virtual={v}", f"parallel.pp_microbatches={m}"]), world_size=pp)
    tokens = torch.randint(0, cfg.model.vocab_size, (16, 129), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    n_targets = float(targets.numel())
    program = build_schedule(kind, pp, m, v)[ctx.rank]
    comm = Comm(ctx)

    def meshlm_side(defer: bool, one_connection: bool = False):
        stage, opt = build_stage(cfg, pp, ctx.rank, v, ctx.device)
        p2p = PipelineP2P(comm)
        if one_connection:
            p2p._downward = None  # what PipelineP2P does on NCCL: every message on the world group
        engine = PipelineEngine(stage, p2p, defer_weight_grads=defer)

        def step():
            engine.run(program, list(zip(inputs.chunk(m), targets.chunk(m))), loss_fn=token_loss_sum,
                       loss_divisor=n_targets, optimizer_step=opt.step)
            opt.zero_grad(set_to_none=True)
        return step

    ref_stage, ref_opt = build_stage(cfg, pp, ctx.rank, v, ctx.device)
    stages = [PipelineStage(ChunkModule(ref_stage, c), c * pp + ctx.rank, pp * v, ctx.device) for c in range(v)]

    def loss_fn(logits, tgt):
        return token_loss_sum(logits, tgt) / n_targets
    schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=False) if v > 1 else \
        (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stages[0], m, loss_fn=loss_fn, scale_grads=False)

    def torch_side():
        if ref_stage.holds_embedding:
            schedule.step(inputs, return_outputs=False)
        else:
            schedule.step(target=targets, losses=[], return_outputs=False)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    without = meshlm_side(False) if change == "defer" else meshlm_side(True, one_connection=True)
    sides = {"meshlm": meshlm_side(True), "without": without, "torch": torch_side}
    orders = list(itertools.permutations(sides))
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(2 + rounds):  # two warm-up rounds
        for name in orders[i % len(orders)]:
            dist.barrier()
            t0 = time.perf_counter()
            sides[name]()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= 2:
                times[name].append(elapsed.item())
    return times


if __name__ == "__main__":
    kind, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 36
    change = sys.argv[3] if len(sys.argv) > 3 else "defer"
    times = run_ranks(rank_fn, 2, kind, rounds, change, timeout=3600)[0]
    missing = "deferred weight gradients" if change == "defer" else "a connection per direction"
    print(f"'without' = meshlm without {missing}")
    print(kind, ", ".join(f"{name} {statistics.median(t) * 1e3:.1f} ms" for name, t in times.items()))
    for fast, slow in (("meshlm", "torch"), ("without", "torch"), ("meshlm", "without")):
        ratios = [b / a for a, b in zip(times[fast], times[slow])]
        q = statistics.quantiles(ratios, n=4)
        print(f"  speed {fast}/{slow}: median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")
