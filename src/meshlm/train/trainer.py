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
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from meshlm.comm import Comm
from meshlm.analysis.flops import device_peak_tflops, flops_per_token, mfu
from meshlm.config import Config
from meshlm.model.loss import IGNORE_INDEX, token_loss_sum  # noqa: F401 (IGNORE_INDEX: re-exported)
from meshlm.parallel.apply import build_engine, build_local_model
from meshlm.parallel.grad_norm import GRAD_REDUCE_AXES
from meshlm.train.data import PreparedData, TokenLoader, eval_batches
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
        self.loss_sum = self.tp.loss_sum if self.tp else token_loss_sum  # sharded logits need TP's loss
        self.dp = build_engine(local, cfg, self.comm)
        self.pipeline = None  # parallel.pp > 1: runs each step's micro-batches by the schedule
        if cfg.parallel.pp > 1:
            from meshlm.parallel.pipeline.runner import PipelineRunner

            self.pipeline = PipelineRunner(self.model, cfg, self.comm)
        t = cfg.train
        self.loader = TokenLoader(data.train_tokens(), t.seq_len, t.global_batch_size, cfg.run.seed)
        self.eval_set = [self._shard(batch) for batch in
                         eval_batches(data.val_tokens(), t.seq_len, t.micro_batch_size, t.eval_batches)]
        # FSDP frees gathered parameters by resizing storages in place: the tracker must follow that.
        self.memory = PeakMemory(self.device, enabled=t.track_memory, track_resizes=cfg.parallel.zero == 3)
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.peak_tflops = t.peak_tflops or device_peak_tflops(self.device, t.dtype)
        self.step = 0
        self.stop_signals = None  # a preemption.StopSignals: checked after every step when set
        self.stopped_by: str | None = None  # the signal's name when fit() ended early on one
        self.last_checkpoint = None  # the SaveReport of the newest checkpoint this run wrote
        self.pending_save = None  # a checkpoint.state.BackgroundSave in flight (checkpoint.async_save)

    # ------------------------------------------------------------------ setup

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded weights under the single-process model's names. Collective: every
        rank must call it (sharded layouts gather); the result is meaningful on global rank 0."""
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
        if self.pipeline is not None:  # the schedule runs every micro-batch, reduces grads after the last
            return self.pipeline.forward_backward(micro, global_tokens, self.loss_sum, self.dp,
                                                  self._autocast), global_tokens
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (inputs, targets) in enumerate(micro):
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            # Gradients are reduced across dp ranks only with the last micro-batch's backward.
            with self.dp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                with self._autocast():
                    logits = self.dp.module(inputs)
                micro_loss = self.loss_sum(logits, targets)
                del logits  # the loss saved what its backward needs; one [b, s, vocab] buffer less at the peak
                (micro_loss / global_tokens).backward()
            loss_sum += micro_loss.detach().double()
        self.dp.finish_backward()
        return loss_sum, global_tokens

    def optimizer_step(self) -> float:
        """Clip (returning the pre-clip global gradient norm), AdamW at this step's LR, zero grads."""
        grad_norm = self.dp.clip_and_step(lr_at(self.step, self.cfg.train), self.cfg.train.grad_clip)
        self.dp.zero_grad()
        return grad_norm

    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        with self.memory.step(self.dp.state_tensors()):
            loss_sum, global_tokens = self.forward_backward()
            grad_norm = self.optimizer_step()
        loss = self._all_reduce(loss_sum).item() / global_tokens
        peak, stop = self._max_over_ranks(self.memory.last_peak,
                                          self.stop_signals.number if self.stop_signals is not None else 0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step += 1
        return StepResult(loss, grad_norm, int(global_tokens), time.perf_counter() - t0, peak,
                          signal.Signals(stop) if stop else None)

    def _max_over_ranks(self, peak: int | None, stop: int) -> tuple[int | None, int]:
        """The largest per-rank peak memory and stop-signal number, in one all-reduce over the world
        (every rank must agree to stop after the same step, or the others would wait forever)."""
        if self.ctx.world_size == 1 or (peak is None and self.stop_signals is None):
            return peak, stop
        t = torch.tensor([-1.0 if peak is None else float(peak), float(stop)], dtype=torch.float64, device=self.device)
        self.comm.all_reduce(t, "world", op=dist.ReduceOp.MAX)
        return (None if peak is None else int(t[0].item())), int(t[1].item())

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss on the fixed held-out batches; each dp rank takes every dp-th batch."""
        if self.pipeline is not None:
            return self.pipeline.evaluate(self.eval_set, self.loss_sum, self._autocast)
        self.dp.module.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i, (inputs, targets) in enumerate(self.eval_set):
            if i % self.dp_size != self.ctx.coord("dp"):
                continue
            with self._autocast():
                logits = self.dp.module(inputs.to(self.device))
            targets = targets.to(self.device)
            totals[0] += self.loss_sum(logits, targets).double()
            totals[1] += (targets != IGNORE_INDEX).sum()
        self.dp.module.train()
        self._all_reduce(totals)
        return (totals[0] / totals[1]).item()

    # ------------------------------------------------------------------ the loop

    def fit(self) -> list[dict]:
        cfg = self.cfg.train
        rows = []
        n_devices = self.ctx.world_size
        self.log.info("training %d steps, %d parameters", cfg.steps, sum(p.numel() for p in self.model.parameters()))
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
                "mem_peak_bytes": result.mem_peak_bytes,
            }
            if self.pipeline is not None:  # measured bubble beside the simulator's (collective over pp)
                row.update(self.pipeline.step_metrics())
            if cfg.eval_interval and (self.step % cfg.eval_interval == 0 or self.step == cfg.steps):
                row["eval_loss"] = self.evaluate()
            done = self.pending_save
            if done is not None and not done.reported and not done.thread.is_alive():
                row["checkpoint_write_s"] = done.seconds  # this rank's background save has finished
                done.reported = True
            stop = result.stop
            if self._checkpoint_due() or stop:  # the last one in the foreground: the run ends with it
                last = stop is not None or self.step == cfg.steps
                row["checkpoint_s"] = self.save_checkpoint(background=self.cfg.checkpoint.async_save and not last).seconds
            self.log.info("step %d loss %.5f grad_norm %.4f", self.step, result.loss, result.grad_norm)
            self.metrics.log_step(row)
            rows.append(row)
            self._inject_fault()
            if stop:
                self.stopped_by = stop.name
                self.metrics.print(f"stopped after step {self.step} ({self.stopped_by} on some rank); "
                                   f"checkpoint {self.last_checkpoint.path}")
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

    def save_checkpoint(self, background: bool = False):
        """Every rank writes its shard of the state at the current step (collective); see
        train/checkpoint/. Returns the SaveReport (path, seconds training was blocked, bytes)."""
        from meshlm.train.checkpoint import save_checkpoint
        from meshlm.train.metrics import format_bytes

        report = save_checkpoint(self, self.run_dir / "checkpoints", self.cfg.checkpoint.keep, background=background)
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

    def _inject_fault(self) -> None:
        """debug.fault=kill: the chosen rank dies by SIGKILL after the chosen step (first attempt only)."""
        d = self.cfg.debug
        if d.fault != "kill" or self.ctx.rank != d.fault_rank or self.step != d.fault_step:
            return
        from meshlm.train.checkpoint.resume import is_restart

        if not is_restart():
            import os

            self.log.info("debug.fault=kill: SIGKILL to rank %d after step %d", self.ctx.rank, self.step)
            os.kill(os.getpid(), signal.SIGKILL)
