"""ZeRO-1 and ZeRO-2: the optimizer's state (stage 1), then the gradients too (stage 2), sharded.

Reduces: per-rank model state from 16 bytes/parameter (Adam, mixed precision) to 4 + 12/n
(stage 1: fp32 master weights and Adam moments sharded) or 2 + 14/n (stage 2: gradients too).
Costs: the same bytes on the wire as DDP, split differently: a reduce-scatter of the gradients
((n-1)/n) and an all-gather of the updated parameters ((n-1)/n) instead of one all-reduce.

Layout (Megatron-core's distributed optimizer): parameters live in one flat buffer cut into
buckets (reverse registration order, as in DDP), each bucket padded to a multiple of n; rank r
owns the r-th 1/n slice of every bucket. A slice crosses parameter boundaries; the optimizer
works on the overlaps (`SegmentAdamW`).
- Stage 1 keeps DDP's full gradient buffer; a full bucket is reduce-scattered in place (a real
  reduce-scatter, not DeepSpeed's all-reduce-then-keep-a-slice, which sends twice the bytes).
  Micro-batches accumulate under `no_sync()` as in DDP.
- Stage 2 has no full gradient buffer: a bucket's gradients are copied into a staging buffer as
  autograd produces them (the per-parameter gradient is dropped at once), the full bucket is
  reduce-scattered and everything but this rank's slice freed. Every micro-batch's backward is
  reduced this way (`no_sync()` has no effect): holding unsharded gradients across micro-batches
  would cost the full gradient memory that stage 2 exists to remove. For the same reason the
  buckets are at most 1/8 of the model (a model smaller than one DDP bucket would otherwise stage
  all of its gradients at once) and at most one reduction is left in flight when the next bucket
  is launched: at most about two buckets of full gradients live at any moment.
- After AdamW on the slices, each bucket's parameters are all-gathered in place.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from meshlm.comm import Comm
from meshlm.config import TrainConfig
from meshlm.parallel.ddp import DDP, DEFAULT_BUCKET_BYTES
from meshlm.parallel.flat_buffer import point_params_into
from meshlm.parallel.mixed_precision import FP32, MasterSegment, MixedPrecision, storage_bytes

_engine = torch.autograd.Variable._execution_engine

STAGE2_BUCKETS = 8  # stage 2 cuts the model into at least this many buckets


def stage2_bucket_bytes(trainable_bytes: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Stage 2's bucket cap: small enough that the staged full gradients stay a fraction of the
    model's (the memory model uses the same rule)."""
    return min(bucket_bytes, max(1, -(-trainable_bytes // STAGE2_BUCKETS)))


class ZeroDataParallel(DDP):
    """ZeRO stage 1 or 2 on meshlm's bucketed reducer. Same interface as DDP."""

    dp_sharded = True  # after the reduce-scatter each rank holds distinct gradient elements

    def __init__(self, module: nn.Module, comm: Comm, train_cfg: TrainConfig, *, stage: int, axes=("cp", "dp"),
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, precision: MixedPrecision = FP32) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements stages 1 and 2, got {stage} (3 is FullyShardedDataParallel)")
        self.stage = stage
        if stage == 2:
            item = torch.empty((), dtype=precision.param_dtype).element_size()
            bucket_bytes = stage2_bucket_bytes(item * sum(p.numel() for p in module.parameters() if p.requires_grad),
                                               bucket_bytes)
        super().__init__(module, comm, train_cfg, axes=axes, bucket_bytes=bucket_bytes, precision=precision)

    # ------------------------------------------------------------------ buffers

    def _align(self) -> int:
        return self.n

    def _keeps_autograd_grads(self) -> bool:
        return False  # the shard buffers are the layout, at any size (ZeRO at one rank is a test case)

    def _shard_offsets(self) -> list[int]:
        """Where each bucket's slice of this rank sits in the rank's shard buffers."""
        offsets, total = [], 0
        for b in self.layout.buckets:
            offsets.append(total)
            total += b.numel // self.n
        return offsets + [total]

    def _setup_buffers(self) -> None:
        dtype, numel = self.precision.param_dtype, self.layout.numel
        self._offsets = self._shard_offsets()
        self.master = None  # fp32: the parameter buffer's own slices are the master weights
        if self.precision.enabled:  # the masters take the initial values before they are rounded
            self.master = torch.zeros(self._offsets[-1], dtype=torch.float32, device=self.device)
            for b, seg in self.layout.shard_segments(self.rank, self.n):
                at = self._offsets[b.index] + seg.lo - b.shard(self.rank, self.n)[0]
                self.master[at: at + seg.hi - seg.lo].copy_(seg.slot.param.detach().reshape(-1)[seg.p_lo: seg.p_hi])
        self.param_buffer = torch.zeros(numel, dtype=dtype, device=self.device)
        point_params_into(self.param_buffer, self.layout.slots)
        self.grad_buffer = None  # stage 1: the full gradient buffer, allocated in backward
        self.grad_shard = None  # stage 2: this rank's reduced slices, allocated in backward
        if self.stage == 2:
            self._staging: dict[int, torch.Tensor] = {}  # bucket -> full bucket gradients, while in flight
            self._end_queued = False

    def _my_slice(self, shard_buffer: torch.Tensor, bucket) -> torch.Tensor:
        """This rank's slice of `bucket` inside a shard-sized buffer."""
        return shard_buffer[self._offsets[bucket.index]: self._offsets[bucket.index + 1]]

    def _shard_grads(self) -> torch.Tensor:
        if self.grad_shard is None:
            self.grad_shard = torch.zeros(self._offsets[-1], dtype=self.precision.param_dtype, device=self.device)
        return self.grad_shard

    def _ensure_grads(self) -> None:
        super()._ensure_grads() if self.stage == 1 else self._shard_grads()

    def _grad_slice(self, bucket) -> torch.Tensor:
        if self.stage == 1:
            return self._grad_storage()[slice(*bucket.shard(self.rank, self.n))]
        return self._my_slice(self._shard_grads(), bucket)

    def _master_segments(self) -> list[MasterSegment]:
        out = []
        for b, seg in self.layout.shard_segments(self.rank, self.n):
            lo = b.shard(self.rank, self.n)[0]
            a, z = seg.lo - lo, seg.hi - lo  # within this rank's slice of the bucket
            if self.master is not None:
                master = self._my_slice(self.master, b)[a:z]
            else:
                master = self.param_buffer[seg.lo: seg.hi]
            out.append(MasterSegment(seg, master, lambda b=b, a=a, z=z: self._grad_slice(b)[a:z]))
        return out

    # ------------------------------------------------------------------ backward

    @contextlib.contextmanager
    def no_sync(self):
        if self.stage == 1:
            with super().no_sync():
                yield
        else:
            yield  # stage 2 reduces every micro-batch (see the module docstring)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if self.stage == 1:
            return super()._on_grad_ready(param)
        if not self._end_queued:  # stage 2 finishes each backward by itself
            _engine.queue_callback(self._end_of_backward)
            self._end_queued = True
        b = self.layout.buckets[self.tracker.bucket_of[id(param)]]
        staging = self._staging.get(b.index)
        if staging is None:
            staging = self._staging[b.index] = torch.zeros(b.numel, dtype=self.precision.reduce_dtype,
                                                           device=self.device)
        slot = self._slot_of[id(param)]
        with torch.no_grad():
            staging[slot.start - b.start: slot.end - b.start].copy_(param.grad.reshape(-1))
        param.grad = None  # the unreduced per-parameter gradient is gone at once
        self.tracker.mark(param)

    def _launch(self, index: int) -> None:
        b = self.layout.buckets[index]
        lo, hi = b.shard(self.rank, self.n)
        if self.stage == 1:
            view = self.grad_buffer[b.start: b.end]
            mine = self.grad_buffer[lo:hi]
            if view.dtype == self.precision.reduce_dtype:  # in place: my slice receives the sum
                self._pending.append((self.comm.reduce_scatter(mine, view, self.axes, async_op=True), None))
            else:
                self._finish_pending()  # one widened copy at a time (DDP._finish_pending)
                wide = view.to(self.precision.reduce_dtype)
                out = wide[lo - b.start: hi - b.start]
                self._pending.append((self.comm.reduce_scatter(out, wide, self.axes, async_op=True),
                                      lambda mine=mine, out=out: mine.copy_(out)))
            return
        staging = self._staging.get(index)
        if staging is None:  # a bucket whose parameters all went unused: reduce zeros
            staging = self._staging[index] = torch.zeros(b.numel, dtype=self.precision.reduce_dtype,
                                                         device=self.device)
        self._finish_pending()  # the previous bucket's: its staging freed now, not at the end
        out = staging[lo - b.start: hi - b.start]
        handle = self.comm.reduce_scatter(out, staging, self.axes, async_op=True)
        self._pending.append((handle, lambda index=index, out=out: self._accumulate(index, out)))

    def _accumulate(self, index: int, reduced: torch.Tensor) -> None:
        self._grad_slice(self.layout.buckets[index]).add_(reduced)
        del self._staging[index]  # free the full bucket: only this rank's slice is kept

    def _end_of_backward(self) -> None:
        self._end_queued = False
        super().finish_backward()

    def finish_backward(self) -> None:
        if self.stage == 1:
            super().finish_backward()
        else:  # each backward already finished itself (flushed, waited) in its end-of-backward callback
            self._ensure_grads()

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def _after_step(self) -> None:
        """The new parameters: this rank's slices (cast from the fp32 master), then all-gathered."""
        handles = []
        for b in self.layout.buckets:
            lo, hi = b.shard(self.rank, self.n)
            if self.master is not None:
                self.param_buffer[lo:hi].copy_(self._my_slice(self.master, b))
            bucket = self.param_buffer[b.start: b.end]
            handles.append(self.comm.all_gather(bucket, self.param_buffer[lo:hi], self.axes, async_op=True))
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        if self.stage == 1:
            return super().zero_grad()
        self.grad_shard = None
        for s in self.layout.slots:
            s.param.grad = None

    # ------------------------------------------------------------------ inspection

    def state_tensors(self) -> Iterator[torch.Tensor]:
        yield self.param_buffer
        grads = self.grad_buffer if self.stage == 1 else self.grad_shard
        if grads is not None:
            yield grads
        if self.master is not None:
            yield self.master
        yield from self.optim.state_tensors()

    def model_state_bytes(self) -> dict[str, int]:
        return {"params": storage_bytes([self.param_buffer]),
                "grads": storage_bytes([self.grad_buffer if self.stage == 1 else self.grad_shard]),
                "master": storage_bytes([self.master]),
                "optimizer": storage_bytes(self.optim.state_tensors())}

    @torch.no_grad()
    def _gather_flat(self, shard_of_bucket) -> torch.Tensor:
        """The full flat buffer (fp32) from every rank's slices, one all-gather per bucket."""
        full = torch.zeros(self.layout.numel, dtype=torch.float32, device=self.device)
        for b in self.layout.buckets:
            self.comm.all_gather(full[b.start: b.end], shard_of_bucket(b).float(), self.axes)
        return full

    def _full_values(self, grads: bool) -> dict[int, torch.Tensor]:
        if grads:
            full = self._gather_flat(self._grad_slice)
        elif self.master is not None:
            full = self._gather_flat(lambda b: self._my_slice(self.master, b))
        else:
            full = self.param_buffer.float()
        return {id(s.param): full[s.start: s.end].view(s.shape).clone() for s in self.layout.slots}
