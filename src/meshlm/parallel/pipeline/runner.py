"""The seam between the trainer and the pipeline: what `Trainer` calls when parallel.pp > 1.

Reduces: the trainer's knowledge of pipelines to four calls (forward_backward, evaluate,
step_metrics, gather_full_state); the schedule, the engine and the stage do the rest.
Costs: per step, one all-reduce of the loss over pp (so every rank can report it), one P2P
exchange of the tied embedding's gradient between first and last stage, and one tiny all-gather
of the step's timings over pp for the measured-versus-predicted bubble.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from meshlm.analysis.pipeline_sim import OpCosts, simulate
from meshlm.comm import Comm
from meshlm.config import Config
from meshlm.model.loss import IGNORE_INDEX
from meshlm.parallel.data_parallel import precision_for
from meshlm.parallel.grad_norm import GRAD_REDUCE_AXES
from meshlm.parallel.pipeline.engine import PipelineEngine, RunStats
from meshlm.parallel.pipeline.p2p import PipelineP2P
from meshlm.parallel.pipeline.schedules import PipelineShape, build_schedule, send_receipts
from meshlm.parallel.pipeline.stage import PipelineStageModel, stage_state_shapes

Batch = tuple[torch.Tensor, torch.Tensor]


def microbatch_plan(cfg: Config) -> tuple[int, int]:
    """(micro-batches per step, rows per micro-batch) of one pipeline, i.e. one dp replica:
    global / (dp * micro_batch_size) micro-batches, unless parallel.pp_microbatches sets the count."""
    t, p = cfg.train, cfg.parallel
    local = t.global_batch_size // p.dp
    if p.pp_microbatches:
        return p.pp_microbatches, local // p.pp_microbatches
    return local // t.micro_batch_size, t.micro_batch_size


class PipelineRunner:
    def __init__(self, stage: PipelineStageModel, cfg: Config, comm: Comm) -> None:
        p = cfg.parallel
        self.stage, self.cfg, self.comm, self.ctx = stage, cfg, comm, comm.ctx
        self.kind, self.pp, self.virtual = p.pp_schedule, p.pp, p.pp_virtual
        self.microbatches, self.micro_batch_size = microbatch_plan(cfg)
        self.pp_rank = self.ctx.coord("pp")
        self.shape = PipelineShape(self.pp, self.microbatches, self.virtual)
        self.schedules = build_schedule(self.kind, self.pp, self.microbatches, self.virtual)
        self.program = self.schedules[self.pp_rank]
        self.receipts = send_receipts(self.schedules, self.pp_rank)
        self.p2p = PipelineP2P(comm)
        # What travels between stages is the residual stream in the weights' dtype: bf16 with
        # bf16 weights (ZeRO 1-3), fp32 otherwise (autocast keeps the residual stream fp32).
        self.engine = PipelineEngine(stage, self.p2p, activation_dtype=precision_for(cfg).param_dtype,
                                     sequence_shards=comm.ctx.size("tp") if cfg.parallel.sp else 1,
                                     defer_weight_grads=p.pp_defer_wgrad and p.zero <= 1)
        self.last_stats: RunStats | None = None
        self._eval_programs: dict[int, tuple] = {}  # batches -> (program, its send receipts)

    # ------------------------------------------------------------------ training

    def forward_backward(self, micro: Sequence[Batch], global_tokens: float,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dp,
                         autocast: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
        """Run the step's schedule; gradients end reduced over dp and tied copies; returns the
        summed token loss of this dp replica on every pipeline rank (float64)."""
        if len(micro) != self.microbatches:
            raise ValueError(f"the schedule has {self.microbatches} micro-batches, the loader gave {len(micro)}")
        stats = self.engine.run(self.program, micro, loss_fn=loss_fn, loss_divisor=global_tokens,
                                autocast=autocast, no_sync=dp.no_sync,
                                reduce_grads=lambda: self.reduce_grads(dp), receipts=self.receipts)
        self.last_stats = stats
        loss_sum = stats.loss_sum
        self.comm.all_reduce(loss_sum, "pp")  # only the last stage has it; the others add 0
        return loss_sum

    def reduce_grads(self, dp) -> None:
        """Data-parallel reduction, then the sum of the two tied-embedding copies' gradients."""
        dp.finish_backward()
        self._sync_tied_grads(dp)

    @torch.no_grad()
    def _sync_tied_grads(self, dp) -> None:
        """Add the other copy's reduced gradient to this copy's (first and last stage, same tp,
        cp and dp coordinates), through the optimizer's segments, so it works whatever the engine
        holds: the whole gradient (DDP) or only this rank's slice of it (ZeRO-1/2/3, whose slices
        fall at different offsets on the two stages). Sharded engines first assemble the whole
        reduced gradient over dp x cp: one gather of the tied weight's gradient, then one P2P
        exchange of it, as DDP does."""
        weight = self.stage.tied_weight
        if weight is None:
            return
        segments = [s for s in dp.optim.segments if s.param is weight]
        ranges = [(s.segment.lo - s.segment.slot.start, s.segment.hi - s.segment.slot.start) for s in segments]
        mine = torch.zeros(weight.numel(), dtype=torch.float32, device=weight.device)
        for (a, z), s in zip(ranges, segments):
            mine[a:z] = s.grad
        if getattr(dp, "dp_sharded", False):  # every element is owned by exactly one rank: a gather
            self.comm.all_reduce(mine, GRAD_REDUCE_AXES)
        peer = self.pp - 1 if self.pp_rank == 0 else 0
        theirs = torch.empty_like(mine)
        self.p2p.post([("send", mine, peer), ("recv", theirs, peer)]).wait()
        # In place: the gradient is a view into the engine's buffer. IEEE addition commutes, so
        # both stages get bit-identical sums and their AdamW updates (same state, same gradient)
        # keep the two copies bit-identical.
        for (a, z), s in zip(ranges, segments):
            s.grad.add_(theirs[a:z].to(s.grad.dtype))

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def eval_totals(self, mine: Sequence[Batch], loss_fn, autocast) -> torch.Tensor:
        """(summed token loss, target tokens), all ranks together, of this dp replica's held-out
        batches (`mine`, data.eval_share) streamed through the pipeline forward-only."""
        program, receipts = self._eval_programs.get(len(mine), (None, None))
        if program is None and mine:
            schedules = build_schedule(self.kind, self.pp, len(mine), self.virtual, forward_only=True)
            program, receipts = schedules[self.pp_rank], send_receipts(schedules, self.pp_rank)
            self._eval_programs[len(mine)] = program, receipts
        self.stage.eval()
        try:
            loss_sum = self.engine.run(program, mine, loss_fn=loss_fn, autocast=autocast, train=False,
                                       receipts=receipts).loss_sum \
                if mine else torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        finally:
            self.stage.train()
        self.comm.all_reduce(loss_sum, "pp")
        totals = torch.stack([loss_sum, torch.tensor(float(sum(int((t != IGNORE_INDEX).sum()) for _, t in mine)),
                                                     dtype=torch.float64, device=self.ctx.device)])
        self.comm.all_reduce(totals, GRAD_REDUCE_AXES)  # dp x cp: the ranks holding other tokens
        return totals

    # ------------------------------------------------------------------ metrics

    def step_metrics(self) -> dict[str, float]:
        """Measured bubble of the last step beside the simulator's prediction for the same schedule
        on the op costs this step measured (per rank: mean forward and backward per chunk; P2P
        latency: the shortest receive wait seen; the deferred weight gradients' mean share of a
        backward, where the engine defers them). Collective over pp."""
        s = self.last_stats
        if s is None:
            return {}
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        mine = torch.tensor([s.busy_s, s.wall_s, mean(s.forward_s), mean(s.backward_s),
                             min(s.recv_wait_s, default=0.0), mean(s.weight_s) / max(mean(s.backward_s), 1e-12)
                             if s.weight_s else -1.0], dtype=torch.float64, device=self.ctx.device)
        gathered = torch.empty(self.pp * mine.numel(), dtype=torch.float64, device=self.ctx.device)
        self.comm.all_gather(gathered, mine, "pp")
        rows = gathered.view(self.pp, -1).cpu().tolist()
        step = max(r[1] for r in rows)
        measured = 1.0 - sum(r[0] for r in rows) / (self.pp * step) if step > 0 else 0.0
        shares = [r[5] for r in rows if r[5] >= 0]  # ranks that deferred weight gradients
        costs = OpCosts(forward=[r[2] for r in rows], backward=[r[3] for r in rows], p2p=min(r[4] for r in rows),
                        weight_fraction=min(0.9, mean(shares)) if shares else 0.0)
        predicted = simulate(self.schedules, self.shape, costs, kind=self.kind)
        return {"pp_bubble_measured": measured, "pp_bubble_predicted": predicted.bubble_fraction,
                "pp_step_s": step, "pp_step_predicted_s": predicted.step_time,
                "pp_op_costs_s": {"forward": costs.forward, "backward": costs.backward, "p2p": costs.p2p,
                                  "weight_fraction": costs.weight_fraction}}

    # ------------------------------------------------------------------ weights

    def gather_full_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every stage's weights on global rank 0, under single-process names (collective over the
        pipeline that holds rank 0; other ranks return `state` unchanged). Each stage sends one
        flat buffer; rank 0 knows the names and shapes from a meta-device split, so nothing but
        the values travels."""
        coords = self.ctx.coords
        if any(coords[a] != 0 for a in ("tp", "cp", "dp")):
            return state
        dtype = torch.float32
        split = self.stage.layers_per_stage
        if self.pp_rank > 0:
            names = [name for name, _ in stage_state_shapes(self.cfg.model, self.pp, self.pp_rank, self.virtual, split)]
            flat = torch.cat([state[n].detach().to(dtype).reshape(-1) for n in names]) if names else \
                torch.empty(0, dtype=dtype, device=self.ctx.device)
            self.p2p.post([("send", flat.contiguous(), 0)]).wait()
            return state
        full = dict(state)
        layouts, ops = {}, []
        for rank in range(1, self.pp):
            layout = stage_state_shapes(self.cfg.model, self.pp, rank, self.virtual, split)
            buffer = torch.empty(sum(s.numel() for _, s in layout), dtype=dtype, device=self.ctx.device)
            layouts[rank] = (layout, buffer)
            ops.append(("recv", buffer, rank))
        self.p2p.post(ops).wait()
        for layout, buffer in layouts.values():
            offset = 0
            for name, shape in layout:
                full[name] = buffer[offset: offset + shape.numel()].view(shape)
                offset += shape.numel()
        return full


class ParameterlessStageDataParallel:
    """The DataParallel of a pipeline stage that holds no parameters (an explicit split can give a
    stage zero layers): nothing to reduce or update, but it still joins the gradient-norm
    all-reduces over tp and pp that the other stages of its pipeline issue. Its dp peers are the
    same stage of the other replicas, so they skip the same dp reductions."""

    def __init__(self, module, comm: Comm) -> None:
        self.module, self.comm = module, comm

    def no_sync(self):
        return contextlib.nullcontext()

    def finish_backward(self) -> None:
        pass

    def clip_and_step(self, lr: float, max_norm: float) -> float:
        from meshlm.parallel.grad_norm import global_grad_norm

        zero = torch.zeros((), dtype=torch.float32, device=self.comm.ctx.device)
        return global_grad_norm(zero, self.comm).item()

    def zero_grad(self) -> None:
        pass

    def refresh_from_masters(self) -> None:
        pass

    def state_tensors(self):
        return iter(())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {}
