"""Profile meshlm's pipeline engine against torch.distributed.pipelining on identical stages.

usage: .venv/bin/python benchmarks/profile_pp.py SCHEDULE [swap]
Two forked gloo ranks, tiny preset, 8 micro-batches; 2 warm-up steps then 8 profiled steps per
side; `swap` runs torch's side first. Prints each rank's top functions by own time.
"""
import cProfile
import io
import pstats
import sys
import time

import torch
import torch.distributed as dist

from meshlm.testing import run_ranks


def rank_fn(kind):
    import meshlm.bench.pp as B
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from meshlm.comm import Comm
    from meshlm.config import load_config, resolve
    from meshlm.mesh import Layout, ParallelContext
    from meshlm.parallel.pipeline.engine import PipelineEngine
    from meshlm.parallel.pipeline.p2p import PipelineP2P
    from meshlm.parallel.pipeline.schedules import build_schedule
    from meshlm.model.loss import token_loss_sum
    pp = 2; m = 8
    ctx = ParallelContext(Layout(pp=pp)); comm = Comm(ctx); rank = ctx.rank; device = ctx.device
    cfg = resolve(load_config(None, ["model.preset=tiny", "model.tie_embeddings=false", "train.seq_len=128",
        "train.global_batch_size=16", f"parallel.pp={pp}", f"parallel.pp_schedule={kind}", f"parallel.pp_microbatches={m}"]), world_size=pp)
    gen = torch.Generator().manual_seed(0)
    b = torch.randint(0, cfg.model.vocab_size, (16, 129), generator=gen)
    inputs, targets = b[:, :-1], b[:, 1:]
    n = float(targets.numel())
    stage, opt = B.build_stage(cfg, pp, rank, 1, device)
    engine = PipelineEngine(stage, PipelineP2P(comm)); program = build_schedule(kind, pp, m, 1)[rank]
    def ours():
        micro = list(zip(inputs.chunk(m), targets.chunk(m)))
        engine.run(program, micro, loss_fn=token_loss_sum, loss_divisor=n, optimizer_step=opt.step)
        opt.zero_grad(set_to_none=True)
    ref_stage, ref_opt = B.build_stage(cfg, pp, rank, 1, device)
    st = PipelineStage(B.ChunkModule(ref_stage, 0), rank, pp, device)
    sched = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(st, m, loss_fn=lambda l, t: token_loss_sum(l, t) / n, scale_grads=False)
    def theirs():
        if rank == 0: sched.step(inputs, return_outputs=False)
        else: sched.step(target=targets, losses=[], return_outputs=False)
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    out = {}
    order = (("theirs", theirs), ("ours", ours)) if len(sys.argv) > 2 else (("ours", ours), ("theirs", theirs))
    for name, fn in order:
        for _ in range(2): fn()
        dist.barrier()
        pr = cProfile.Profile(); t = time.perf_counter(); pr.enable()
        for _ in range(8): fn()
        pr.disable(); dist.barrier(); el = time.perf_counter() - t
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        out[name] = (el, s.getvalue())
    return out

if __name__ == "__main__":
    res = run_ranks(rank_fn, 2, sys.argv[1], timeout=600)
    for r, o in enumerate(res):
        for name, (el, txt) in o.items():
            print(f"===== rank {r} {name} {el:.3f}s")
            print("\n".join(txt.splitlines()[:32]))
