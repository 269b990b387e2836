"""The training loop: one global batch per step, split into data-parallel shards and micro-batches,
with the loss normalised by the global number of target tokens so every layout computes the same
step as one process would.

Per step: forward/backward each micro-batch (this rank's context-parallel chunks of it under cp)
on `loss_sum / global_target_tokens`, reduce gradients across the dp x cp ranks (a sum, since
each rank already divided by the global count), clip, AdamW, then reduce the metrics. The loss
reported is the global mean token loss.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.comm import Comm
from meshlm.analysis.flops import device_peak_tflops, flops_per_token, mfu
from meshlm.config import Config
from meshlm.debug.faults import FaultInjector
from meshlm.debug.fingerprint import check as check_fingerprints
from meshlm.debug.nonfinite import NonFiniteError, culprits, describe, locate
from meshlm.debug.progress import Progress
from meshlm.debug.stragglers import StragglerDetector
from meshlm.model.loss import IGNORE_INDEX
from meshlm.parallel.apply import build_engine, build_local_model, build_loss
from meshlm.parallel.grad_norm import GRAD_REDUCE_AXES
from meshlm.data.blend import eval_sets, make_loader
from meshlm.train.data import PreparedData, eval_share
from meshlm.train.memtrack import PeakMemory
from meshlm.train.metrics import MetricsWriter, rank_logger
from meshlm.train.optim import lr_at



@dataclass
class StepResult:
    loss: float
    grad_norm: float
    target_tokens: int
    step_time_s: float
    mem_peak_bytes: int | None
    stop: signal.Signals | None = None  # a stop signal some rank received (train/preemption.py)
    ranks: dict | None = None  # slowest/fastest rank fields (debug/stragglers.py)
    nonfinite: str | None = None  # the report of a skipped non-finite step (train.on_nonfinite=skip)


class Trainer:
    def __init__(self, cfg: Config, ctx, data: PreparedData, metrics: MetricsWriter | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.data = data
        self.comm = Comm(ctx)  # every collective goes through it: traced, summarised at the end
        self.device = ctx.device
        self.run_dir = Path(cfg.run.dir)
        self.log = rank_logger(self.run_dir, ctx.rank)
        self.metrics = metrics or MetricsWriter(self.run_dir, cfg.train.steps, cfg.train.log_interval,
                                                active=ctx.rank == 0)
        # The model is built sharded, every technique applied in one fixed order (parallel/apply.py).
        local = build_local_model(cfg, self.comm)
        self.model, self.tp, self.cp = local.module, local.tp, local.cp
        self.loss_sum = build_loss(cfg, local.tp, self.comm)  # TP's under TP; compiled chunks under train.compile
        self.dp = build_engine(local, cfg, self.comm)
        self.pipeline = None  # parallel.pp > 1: runs each step's micro-batches by the schedule
        if cfg.parallel.pp > 1:
            from meshlm.parallel.pipeline.runner import PipelineRunner

            self.pipeline = PipelineRunner(self.model, cfg, self.comm)
        t = cfg.train
        self.loader = make_loader(data, t.seq_len, t.global_batch_size, cfg.run.seed)  # a blend's too
        # Held-out batches per corpus (one, or each of a data.blend); eval_loss is over all of them.
        # train.eval_batches global batches of windows (Megatron's eval-iters), whatever the
        # micro-batch split: every layout measures the same tokens; micro-batches bound the memory.
        self.eval_sets = {name: [self._shard(batch) for batch in batches] for name, batches in
                          eval_sets(data, t.seq_len, windows=t.eval_batches * t.global_batch_size,
                                    batch_size=t.micro_batch_size).items()}
        self.eval_set = [batch for batches in self.eval_sets.values() for batch in batches]
        # FSDP frees gathered parameters by resizing storages in place: the tracker must follow that.
        self.memory = PeakMemory(self.device, enabled=t.track_memory, track_resizes=cfg.parallel.zero == 3,
                                 interval=t.memory_interval)
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.peak_tflops = t.peak_tflops or device_peak_tflops(self.device, t.dtype)
        self.step = 0
        self.progress = Progress()  # step and phase, for the watchdog and failure reports (debug/)
        self.faults = FaultInjector(cfg.debug, ctx.rank, self.comm, self.log)
        self.faults.install(self.model)
        self.stragglers = StragglerDetector(cfg.debug.straggler_threshold, warn=self.metrics.print)
        self.nonfinite_skipped = 0
        self.empty_skipped = 0  # steps whose global batch had no target token: no forward, no update
        self._same_work_ranks = ctx.layout.groups(("tp", "cp", "dp"))  # one pipeline stage each: desync check
        self._pipelines = ctx.layout.groups("pp")  # their collectives on the pp axis: alike on every stage
        self.stop_signals = None  # a preemption.StopSignals: checked after every step when set
        self.stopped_by: str | None = None  # the signal's name when fit() ended early on one
        self.last_checkpoint = None  # the SaveReport of the newest checkpoint this run wrote
        self.can_checkpoint = True  # False: the nodes do not share run.dir (train/rank0_node.py)
        self.pending_save = None  # a checkpoint.state.BackgroundSave in flight (checkpoint.async_save)

    # ------------------------------------------------------------------ setup

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded weights under the single-process model's names. Collective: every
        rank must call it (sharded layouts gather); the result is meaningful on global rank 0."""
        self.progress.at("gather")
        state = self.dp.full_state_dict()
        if self.tp:
            state = self.tp.full_state_dict(state)  # tp shards -> full tensors, vocabulary unpadded
        if self.pipeline is not None:
            state = self.pipeline.gather_full_state(state)  # every stage's weights to global rank 0
        return state

    @property
    def dp_size(self) -> int:
        return self.ctx.size("dp")

    def _autocast(self):
        if self.cfg.train.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Over dp x cp: the ranks that hold different tokens of the same model replica."""
        self.comm.all_reduce(tensor, GRAD_REDUCE_AXES, op=op)
        return tensor

    def _shard(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens of a micro-batch: its context-parallel chunks, or all of them."""
        return self.cp.shard(*batch) if self.cp else batch

    # ------------------------------------------------------------------ one step

    def forward_backward(self) -> tuple[torch.Tensor, float]:
        """Gradients of this step's global mean token loss, summed over dp x cp ranks, left in `.grad`.

        Returns (this rank's summed token loss, the global target-token count). Each micro-batch
        backpropagates `loss_sum / global_tokens`, so accumulation over micro-batches and ranks is
        a plain sum and every layout produces the gradient of the same global mean.
        """
        cfg = self.cfg.train
        micro_size = self.pipeline.micro_batch_size if self.pipeline else cfg.micro_batch_size
        micro = [self._shard(batch) for batch in
                 self.loader.microbatches(self.step, self.ctx.coord("dp"), self.dp_size, micro_size)]
        counts = torch.tensor([float(sum(int((tgt != IGNORE_INDEX).sum()) for _, tgt in micro))],
                              dtype=torch.float64, device=self.device)
        global_tokens = self._all_reduce(counts).item()
        if global_tokens == 0:  # every rank knows it: none runs a forward (nothing to learn from)
            return torch.zeros((), dtype=torch.float64, device=self.device), 0.0
        if self.pipeline is not None:  # the schedule runs every micro-batch, reduces grads after the last
            self.progress.at("forward+backward")
            return self.pipeline.forward_backward(micro, global_tokens, self.loss_sum, self.dp,
                                                  self._autocast), global_tokens
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (inputs, targets) in enumerate(micro):
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            # Gradients are reduced across dp ranks only with the last micro-batch's backward.
            with self.dp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                self.progress.at("forward")
                with self._autocast():
                    logits = self.dp.module(inputs)
                micro_loss = self.loss_sum(logits, targets)
                del logits  # the loss saved what its backward needs; one [b, s, vocab] buffer less at the peak
                self.progress.at("backward")
                (micro_loss / global_tokens).backward()
            loss_sum += micro_loss.detach().double()
        self.dp.finish_backward()
        return loss_sum, global_tokens

    def optimizer_step(self, loss_sum: torch.Tensor) -> tuple[float, str | None]:
        """Clip (the pre-clip global gradient norm is returned), AdamW at this step's LR, zero grads.
        A non-finite norm is never applied (the engines skip the update): with train.on_nonfinite
        = stop that ends the run (NonFiniteError), with skip the step is counted and training goes
        on; the report (second value) names the rank and parameter either way."""
        self.progress.at("optimizer")
        grad_norm = self.dp.clip_and_step(lr_at(self.step, self.cfg.train), self.cfg.train.grad_clip)
        report = None
        if not math.isfinite(grad_norm):
            views = locate(self.dp, self.model, loss_sum, self.ctx.rank, self.ctx.world_size)
            report = describe(self.step + 1, grad_norm, views)
            if self.cfg.train.on_nonfinite == "stop":
                raise NonFiniteError(report + "; the update was not applied and nothing was saved "
                                              "(train.on_nonfinite=skip drops such steps instead)", culprits(views))
            self.nonfinite_skipped += 1
        self.dp.zero_grad()
        return grad_norm, report

    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        blocked0 = self.comm.recorder.settle()
        # The step's own collectives only: evaluation gives dp ranks unequal batch counts.
        self.comm.recorder.fingerprint = self.comm.recorder.pipeline_fingerprint = 0
        self.progress.at("batch")  # counting the step's target tokens: its first collective
        self.faults.before_step(self.step + 1)
        with self.memory.step(self.dp.state_tensors(), self.step + 1):
            loss_sum, global_tokens = self.forward_backward()
            if global_tokens:
                grad_norm, nonfinite = self.optimizer_step(loss_sum)
            else:
                # No target token in the whole global batch (a masked loader): no update, which with
                # zero gradients would still move the weights (AdamW's momentum, decay) and count a step.
                grad_norm, nonfinite = 0.0, None
                self.empty_skipped += 1
        self.progress.at("end of step")  # the loss and the small all-gather below
        loss_sum = self._all_reduce(loss_sum).item()
        loss = loss_sum / global_tokens if global_tokens else math.nan
        blocked_s = self.comm.recorder.settle() - blocked0  # the loss's .item() has waited for the GPU
        peak, stop, ranks = self._gather_over_ranks(self.memory.last_peak, self.stop_signals.number
                                                    if self.stop_signals is not None else 0,
                                                    time.perf_counter() - t0 - blocked_s, blocked_s)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step += 1
        return StepResult(loss, grad_norm, int(global_tokens), time.perf_counter() - t0, peak,
                          signal.Signals(stop) if stop else None, ranks, nonfinite)

    def _gather_over_ranks(self, peak: int | None, stop: int, busy_s: float,
                           blocked_s: float) -> tuple[int | None, int, dict | None]:
        """Every rank's peak memory, stop-signal number, working time, collective fingerprint and
        time blocked in communication, in one small all-gather over the world: the largest peak,
        any stop (every rank must agree to stop after the same step, or the others would wait
        forever), the slowest and fastest rank, the ranks' mean exposed communication, and a
        desync check (DesyncError on every rank alike)."""
        if self.ctx.world_size == 1:
            return peak, stop, None
        recorder = self.comm.recorder
        mine = torch.tensor([-1.0 if peak is None else float(peak), float(stop), busy_s,
                             float(recorder.fingerprint), blocked_s, float(recorder.pipeline_fingerprint)],
                            dtype=torch.float64, device=self.device)
        every = torch.empty(self.ctx.world_size * len(mine), dtype=torch.float64, device=self.device)
        self.comm.all_gather(every, mine, "world")
        every = every.view(-1, len(mine)).tolist()
        check_fingerprints([row[3] for row in every], self._same_work_ranks, self.step + 1)
        check_fingerprints([row[5] for row in every], self._pipelines, self.step + 1)
        ranks = self.stragglers.observe(self.step + 1, [row[2] for row in every], self._same_work_ranks)
        # Communication the step did not hide behind computation, the ranks' mean: host time blocked
        # in collectives (gloo), or the time the GPU's streams stalled on them (NCCL; recorder.settle).
        ranks["comm_exposed_s"] = sum(row[4] for row in every) / len(every)
        return (None if peak is None else int(max(row[0] for row in every))), int(max(row[1] for row in every)), ranks

    def evaluate(self) -> float:
        """Mean token loss on the fixed held-out batches (all corpora's)."""
        return self.eval_losses()["eval_loss"]

    def eval_losses(self) -> dict[str, float]:
        """`eval_loss` over every held-out batch and, for a data.blend, `eval_loss/<corpus>` too,
        from one pass: the overall loss is the per-corpus totals summed."""
        totals = {name: self._eval_totals(batches) for name, batches in self.eval_sets.items()}
        loss_sum, tokens = sum(totals.values()).tolist()
        row = {"eval_loss": loss_sum / tokens}
        if len(totals) > 1:
            row.update({f"eval_loss/{name}": (t[0] / t[1]).item() for name, t in totals.items()})
        return row

    @torch.no_grad()
    def _eval_totals(self, eval_set: list) -> torch.Tensor:
        """(summed token loss, target tokens) over `eval_set`, all ranks together; each dp rank
        takes every dp-th batch, as many forwards on every dp rank (data.eval_share)."""
        self.progress.at("eval")
        mine = eval_share(eval_set, self.ctx.coord("dp"), self.dp_size)
        if self.pipeline is not None:
            return self.pipeline.eval_totals(mine, self.loss_sum, self._autocast)
        self.dp.module.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for inputs, targets in mine:
            with self._autocast():
                logits = self.dp.module(inputs.to(self.device))
            targets = targets.to(self.device)
            totals[0] += self.loss_sum(logits, targets).double()
            totals[1] += (targets != IGNORE_INDEX).sum()
        self.dp.module.train()
        return self._all_reduce(totals)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> list[dict]:
        cfg = self.cfg.train
        rows = []
        n_devices = self.ctx.world_size
        self.log.info("training %d steps, %d parameters", cfg.steps, sum(p.numel() for p in self.model.parameters()))
        if cfg.warmup_steps >= cfg.steps and self.step < cfg.steps:
            self.metrics.print(f"warning: train.warmup_steps={cfg.warmup_steps} >= train.steps={cfg.steps}: the "
                               f"learning rate never leaves its warmup (it ends at {lr_at(cfg.steps - 1, cfg):.3g}, "
                               f"not at train.lr, and never decays to min_lr)")
        for _ in range(self.step, cfg.steps):
            lr = lr_at(self.step, cfg)
            result = self.train_step()
            tokens = cfg.global_batch_size * cfg.seq_len
            tokens_per_s = tokens / result.step_time_s
            tflops = self.flops_per_token * tokens_per_s / 1e12
            row = {
                "step": self.step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                "tokens": tokens, "target_tokens": result.target_tokens, "tokens_per_s": tokens_per_s,
                "step_time_s": result.step_time_s, "tflops": tflops,
                "mfu": mfu(tokens_per_s, self.flops_per_token, self.peak_tflops, n_devices),
                "mem_peak_bytes": result.mem_peak_bytes, "mem_measured": self.memory.measured,
                **(result.ranks or {}),
            }
            if "comm_exposed_s" in row:
                row["comm_exposed_share"] = row["comm_exposed_s"] / result.step_time_s
            if result.nonfinite:  # train.on_nonfinite=skip: this step changed nothing
                row["nonfinite_skipped"] = self.nonfinite_skipped
                self.metrics.print(f"warning: {result.nonfinite}; update skipped "
                                   f"({self.nonfinite_skipped} so far, train.on_nonfinite=skip)")
            if not result.target_tokens:
                row["empty_skipped"] = self.empty_skipped
                self.metrics.print(f"warning: step {self.step}: no target token in the global batch (all "
                                   f"ignored); no update ({self.empty_skipped} such steps so far)")
            elif self.pipeline is not None:  # measured bubble beside the simulator's (collective over pp)
                row.update(self.pipeline.step_metrics())
            if cfg.eval_interval and (self.step % cfg.eval_interval == 0 or self.step == cfg.steps):
                row.update(self.eval_losses())
            done = self.pending_save
            if done is not None and not done.reported and not done.thread.is_alive():
                row["checkpoint_write_s"] = done.seconds  # this rank's background save has finished
                done.reported = True
            stop = result.stop
            if stop and self.stop_signals is not None:
                self.stop_signals.reached_boundary()  # the stop deadline ends here, before the save
            if self._checkpoint_due() or (stop and self.can_checkpoint):  # the last in the foreground: the run ends with it
                last = stop is not None or self.step == cfg.steps
                # The row is logged after the save (it holds checkpoint_s): the checkpoint carries it
                # too, so a kill in between loses no step of metrics.jsonl (MetricsWriter.resume_at).
                row["checkpoint_s"] = self.save_checkpoint(background=self.cfg.checkpoint.async_save and not last,
                                                           metrics_row=dict(row)).seconds
            self.log.info("step %d loss %.5f grad_norm %.4f", self.step, result.loss, result.grad_norm)
            self.metrics.log_step(row)
            rows.append(row)
            self.faults.after_step(self.step)
            self.progress.step_done(self.step)
            if stop:
                self.stopped_by = stop.name
                saved = (f"checkpoint {self.last_checkpoint.path}" if self.can_checkpoint and self.last_checkpoint
                         else "no checkpoint: the nodes do not share run.dir")
                self.metrics.print(f"stopped after step {self.step} ({self.stopped_by} on some rank); {saved}")
                break
        self.wait_for_checkpoint()
        if self.ctx.world_size > 1:
            self.metrics.print(self.comm.format_summary(f"communication on rank {self.ctx.rank} ({cfg.steps} steps)"))
        self.comm.recorder.write(self.run_dir / "logs" / f"comm_rank{self.ctx.rank}.jsonl")
        return rows

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_due(self) -> bool:
        interval = self.cfg.checkpoint.interval
        return interval > 0 and (self.step % interval == 0 or self.step == self.cfg.train.steps)

    def save_checkpoint(self, background: bool = False, metrics_row: dict | None = None):
        """Every rank writes its shard of the state at the current step (collective); see
        train/checkpoint/. `metrics_row`: the step's row, which the checkpoint carries. Returns the
        SaveReport (path, seconds training was blocked, bytes)."""
        from meshlm.train.checkpoint import save_checkpoint
        from meshlm.train.metrics import format_bytes

        self.progress.at("checkpoint")
        with self.stop_signals.saving() if self.stop_signals is not None else contextlib.nullcontext():
            report = save_checkpoint(self, self.run_dir / "checkpoints", self.cfg.checkpoint.keep,
                                     background=background, metrics_row=metrics_row)
        self.last_checkpoint = report
        if background:
            self.metrics.print(f"checkpoint {report.path.name}: {format_bytes(report.bytes)} (rank 0) copied in "
                               f"{report.seconds:.2f} s, written in the background")
        else:
            self.metrics.print(f"checkpoint {report.path.name}: {format_bytes(report.bytes)} in {report.seconds:.2f} s")
        return report

    def wait_for_checkpoint(self) -> None:
        """Finish a background save on every rank (collective); a no-op when none is in flight."""
        from meshlm.train.checkpoint.state import wait_for_save

        wait_for_save(self)
