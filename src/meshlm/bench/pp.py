"""`meshlm bench pp [--json]`: meshlm's pipeline engine against torch.distributed.pipelining.
Reduces: guessing; both run the same stages (same weights, same split), the same schedule and the
same batches at pp=2, alternating step for step in one job, and their losses are compared.
Costs: about a minute of the machine with the defaults (tiny preset, seq 128, 8 micro-batches).

The reference wraps meshlm's own stage modules (one per model chunk) in torch's `PipelineStage`
and runs `ScheduleGPipe`, `Schedule1F1B` or `ScheduleInterleaved1F1B` (scale_grads=False, the loss
divided by the batch's target tokens, as meshlm's trainer does). Embeddings are untied in both:
torch's pipelining has no tied-weight sync across stages. Each measurement is a training step
(pipeline forward/backward of all micro-batches, then AdamW); tokens/s is the whole batch over the
slowest rank's time. Memory is the per-rank peak of a warm step: on CPU live tensor bytes (the
state, every tensor the runtime keeps between steps, and what the step allocates), on GPU the
allocator's peak less what was resident before plus this side's own state.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from meshlm.bench.report import (first_sentence, bench_row, loss_check_passed, parse_checked, prepare_cpu_rank,
                                 run_and_emit)
from meshlm.errors import OneLineErrorParser
from meshlm.train.memtrack import measure_peak_bytes

VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved": 2}
# Per step, fp32: the same stages and schedule give the same losses (0 in every recorded run); a
# different reduction order of the accumulated gradients could move later steps' by rounding.
LOSS_TOLERANCE = 1e-4


class ChunkModule(nn.Module):
    """One model chunk of a meshlm stage as the single-input module torch's PipelineStage wants."""

    def __init__(self, stage, chunk: int):
        super().__init__()
        self.stage, self.chunk = stage, chunk

    def forward(self, x):
        return self.stage(x, self.chunk)


def _tensors_in(obj, seen=None, depth=0) -> list[torch.Tensor]:
    """Tensors an object keeps in its attributes, lists, tuples and dicts (a few levels deep):
    the buffers a pipeline runtime holds between steps."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 5:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, nn.Module):
        return []  # parameters are counted as state
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple, set)):
        items = obj
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("torch.distributed.pipelining", "meshlm")):
        items = vars(obj).values()
    else:
        return []
    return [t for item in items for t in _tensors_in(item, seen, depth + 1)]


def build_stage(cfg, pp: int, rank: int, virtual: int, device):
    from meshlm.model import Llama, init_weights
    from meshlm.parallel.pipeline.stage import PipelineStageModel
    from meshlm.train.optim import build_optimizer

    model = Llama(cfg.model)
    init_weights(model, cfg.run.seed)
    stage = PipelineStageModel(model.to(device), pp, rank, virtual)
    return stage, build_optimizer(stage, cfg.train)


def _bench_rank(a: dict) -> list[dict]:
    """On every rank: alternate meshlm and torch steps per schedule; rank 0's rows."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from meshlm.comm import Comm
    from meshlm.config import load_config, resolve
    from meshlm.mesh import Layout, ParallelContext
    from meshlm.parallel.pipeline.engine import PipelineEngine
    from meshlm.parallel.pipeline.p2p import PipelineP2P
    from meshlm.parallel.pipeline.schedules import build_schedule
    from meshlm.model.loss import token_loss_sum

    pp = dist.get_world_size()
    ctx = ParallelContext(Layout(pp=pp))
    comm, rank, device = Comm(ctx), ctx.rank, ctx.device
    prepare_cpu_rank(rank, device)
    m = a["microbatches"]
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 4096, (a["batch"], a["seq_len"] + 1), generator=gen) for _ in range(4)]
    rows = []
    for kind in a["schedules"]:
        v = VIRTUAL[kind]
        cfg = resolve(load_config(None, [f"model.preset={a['preset']}", "model.tie_embeddings=false",
                                         f"train.seq_len={a['seq_len']}", f"train.global_batch_size={a['batch']}",
                                         f"parallel.pp={pp}", f"parallel.pp_schedule={kind}", f"parallel.pp_virtual={v}",
                                         f"parallel.pp_microbatches={m}"]), world_size=pp)
        tokens = [(b[:, :-1].remainder(cfg.model.vocab_size).to(device), b[:, 1:].remainder(cfg.model.vocab_size)
                   .to(device)) for b in batches]
        n_targets = float(tokens[0][1].numel())

        def loss_fn(logits, targets):
            return token_loss_sum(logits, targets) / n_targets

        # meshlm: the engine on this rank's stage, messages through the traced Comm.
        stage, opt = build_stage(cfg, pp, rank, v, device)
        engine = PipelineEngine(stage, PipelineP2P(comm), defer_weight_grads=a["defer_wgrad"])
        program = build_schedule(kind, pp, m, v)[rank]

        def meshlm_step(i):
            inputs, targets = tokens[i % len(tokens)]
            micro = list(zip(inputs.chunk(m), targets.chunk(m)))
            loss = engine.run(program, micro, loss_fn=token_loss_sum, loss_divisor=n_targets,
                              optimizer_step=opt.step).loss_sum / n_targets
            opt.zero_grad(set_to_none=True)
            return loss.item()

        # torch.distributed.pipelining on an identical copy of the same stage.
        ref_stage, ref_opt = build_stage(cfg, pp, rank, v, device)
        stages = [PipelineStage(ChunkModule(ref_stage, c), c * pp + rank, pp * v, device) for c in range(v)]
        if kind == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=False)
        else:
            schedule = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stages[0], m, loss_fn=loss_fn,
                                                                           scale_grads=False)

        def torch_step(i):
            inputs, targets = tokens[i % len(tokens)]
            losses = []
            # return_outputs=False: torch would otherwise keep the last stage's logits for the caller.
            if ref_stage.holds_embedding:
                schedule.step(inputs, return_outputs=False)
            else:
                schedule.step(target=targets, losses=losses, return_outputs=False)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            return float(sum(l.item() for l in losses))

        sides = {"meshlm": (meshlm_step, stage, opt, engine), "torch": (torch_step, ref_stage, ref_opt, schedule)}
        times = {k: [] for k in sides}
        losses = {k: [] for k in sides}
        peaks = {}
        # Memory once, on the last untimed step, and never on a side's first: that step creates
        # AdamW's state and the runtime's buffers, so it would weigh ~2 x params too little. With
        # --warmup 1 this adds one untimed step (step 0 warms, step 1 measures).
        untimed = max(a["warmup"], 2)
        for i in range(untimed + a["pairs"]):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]  # alternate who goes first
            for name in order:
                step, module, optimizer, runtime = sides[name]
                if i == untimed - 1:  # warm: optimizer state and runtime buffers exist
                    state = [*module.parameters(), *(t for s in optimizer.state.values() for t in s.values()
                                                     if isinstance(t, torch.Tensor)), *_tensors_in(runtime)]
                    peaks[name] = measure_peak_bytes(lambda: losses[name].append(step(i)), state, device)
                    continue
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                losses[name].append(step(i))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                # On the run's device: NCCL reduces only device tensors.
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
                if i >= untimed:
                    times[name].append(elapsed.item())
        # Same weights, same batches, same schedule: the two must compute the same losses. A
        # non-finite loss on any rank is flagged apart: NaN does not survive max() or a MAX reduction.
        finite = all(math.isfinite(x) for x in losses["meshlm"] + losses["torch"])
        diff = max(abs(x - y) for x, y in zip(losses["meshlm"], losses["torch"])) if finite else 0.0
        peak = torch.tensor([float(peaks["meshlm"]), float(peaks["torch"]), diff, float(not finite)],
                            dtype=torch.float64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        loss_diff = None if peak[3].item() else peak[2].item()  # null: some loss was NaN or infinite
        tokens_per_step = a["batch"] * a["seq_len"]
        rows.append(bench_row(
            f"pp{pp}-{kind}" + (f"-v{v}" if v > 1 else ""), pp, f"torch pipelining {type(schedule).__name__}",
            [tokens_per_step / t for t in times["meshlm"]], [tokens_per_step / t for t in times["torch"]],
            int(peak[0]), int(peak[1]), schedule=kind, microbatches=m, virtual=v, preset=a["preset"],
            seq_len=a["seq_len"], batch=a["batch"], loss_max_abs_diff=loss_diff, loss_tolerance=LOSS_TOLERANCE,
            loss_check_passed=loss_check_passed({"loss_max_abs_diff": loss_diff}, ("loss_max_abs_diff",),
                                                LOSS_TOLERANCE),
            device=device.type, backend=ctx.backend))
        del sides, schedule, stages
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="meshlm bench pp", description=first_sentence(__doc__))
    parser.add_argument("--json", action="store_true", help="print DESIGN.md's JSON rows")
    parser.add_argument("--nproc", type=int, default=2, help="pipeline ranks to fork when not under torchrun")
    parser.add_argument("--schedule", choices=("all", *VIRTUAL), default="all")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="rows per step (all micro-batches)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per side; memory is measured on the last, at the earliest the second")
    parser.add_argument("--no-defer-wgrad", dest="defer_wgrad", action="store_false",
                        help="meshlm without deferred weight gradients (parallel.pp_defer_wgrad=false)")
    # --warmup 0 is allowed (as by every bench): memory is weighed on the second step at the earliest
    args, code = parse_checked(parser, argv, "pp", {"nproc": 2, "pairs": 1, "warmup": 0, "microbatches": 1, "batch": 1,
                                                    "seq_len": 1},
                               lambda a: f"--batch: {a.batch} rows do not split into --microbatches {a.microbatches}"
                               if a.batch % a.microbatches else None)
    if code is not None:
        return code
    from meshlm.config import ConfigError, load_config, resolve

    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    schedules = list(VIRTUAL) if args.schedule == "all" else [args.schedule]
    try:
        for kind in schedules:
            resolve(load_config(None, [f"model.preset={args.preset}", f"train.seq_len={args.seq_len}",
                                       f"train.global_batch_size={args.batch}", f"parallel.pp={world}",
                                       f"parallel.pp_schedule={kind}", f"parallel.pp_virtual={VIRTUAL[kind]}",
                                       f"parallel.pp_microbatches={args.microbatches}"]), world_size=world)
    except ConfigError as e:
        print(f"meshlm bench pp: error: {e}", file=sys.stderr, flush=True)
        return 2
    run_and_emit(_bench_rank, {**vars(args), "schedules": schedules}, args.nproc, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
