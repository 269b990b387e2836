"""DDP: data parallelism with bucketed gradient all-reduce overlapped with backward.

Reduces: the wall time of gradient synchronisation; each bucket's all-reduce starts the moment
its last gradient is ready, so most communication hides under the rest of backward.
Costs: 2(n-1)/n x gradient bytes on the wire per step (the ring all-reduce) and full model state
(16 bytes/parameter with Adam) on every rank; nothing is sharded.

How it works (PyTorch's DistributedDataParallel reducer, in ~200 lines of Python):
- Gradients live in one contiguous buffer; each parameter's `.grad` is a view into it, so
  autograd accumulates straight into the buffer and a bucket is a slice, reduced in place.
- Parameters are laid out in reverse registration order (backward produces the head's gradient
  first and the embedding's last), cut into buckets of about `bucket_bytes`.
- A post-accumulate-grad hook on every parameter marks it ready; a full bucket launches an async
  all-reduce at once, buckets strictly in order so every rank issues the same sequence.
- `finish_backward` launches what is left (buckets holding parameters that got no gradient:
  found on the first step and not waited for afterwards) and waits for every bucket.
- `no_sync()` turns the hooks off: micro-batches accumulate locally and only the last one's
  backward communicates. The loss is already divided by the global token count, so the
  reduction is a SUM.
- At one rank (no dp or cp peers: single-GPU runs, tp- or pp-only layouts) there is nothing to
  reduce: autograd's own `.grad` tensors are the gradients the optimizer reads. No hook runs and
  no buffer exists (a hook costs ~45 us of Python per parameter, plus a copy of every gradient).
Works for any nn.Module. Mixed precision (`MixedPrecision(bf16)`): bf16 parameters (frozen ones
too) and gradient buffer, each bucket upcast and all-reduced in fp32, an fp32 master copy of the
trainable ones for AdamW.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from meshlm.comm import Comm
from meshlm.config import TrainConfig
from meshlm.parallel.flat_buffer import FlatLayout, ReadyTracker, Segment, weak_hook
from meshlm.parallel.mixed_precision import FP32, MasterSegment, MixedPrecision, SegmentAdamW, storage_bytes

DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb


class DDP:
    """meshlm's DistributedDataParallel. Gradients are summed (not averaged) over `axes`."""

    dp_sharded = False  # gradients after reduction: replicated on every rank (the norm is local)

    def __init__(self, module: nn.Module, comm: Comm, train_cfg: TrainConfig, *, axes=("cp", "dp"),
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, precision: MixedPrecision = FP32) -> None:
        self.module = module
        self.comm = comm
        self.ctx = comm.ctx
        self.axes = axes
        self.n = self.ctx.size(axes)
        self.rank = self.ctx.group_rank(axes)
        self.precision = precision
        self.device = self.ctx.device
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if precision.enabled:  # frozen weights compute in bf16 too (no master: they never change)
            for p in module.parameters():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(precision.param_dtype)
        itemsize = torch.empty((), dtype=precision.param_dtype).element_size()
        self.layout = FlatLayout(list(reversed(named)), bucket_bytes, align=self._align(), itemsize=itemsize)
        self._sync = True
        self._reduced = False  # finish_backward ran since zero_grad: the buffer holds the ranks' sum
        self._pending: list = []  # (handle, callback) of launched async reductions
        self._slot_of = {id(s.param): s for s in self.layout.slots}  # ZeRO-2's hook finds its slot
        self.autograd_grads = self._keeps_autograd_grads()
        self._setup_buffers()
        self.tracker = ReadyTracker([[(s.name, s.param) for s in b.slots] for b in self.layout.buckets],
                                    self._launch)
        if not self.autograd_grads:
            hook = weak_hook(self._on_grad_ready)
            for s in self.layout.slots:
                s.param.register_post_accumulate_grad_hook(hook)
        self.optim = SegmentAdamW(self._master_segments(), train_cfg)
        self.unused_parameters: list[str] = []

    # ------------------------------------------------------------------ buffers (overridden by ZeRO)

    def _align(self) -> int:
        return 1

    def _keeps_autograd_grads(self) -> bool:
        """Whether the gradients stay in autograd's `.grad` (no buffer, no hooks): at one rank."""
        return self.n == 1

    def _setup_buffers(self) -> None:
        self.grad_buffer = None  # allocated by the step's first gradient, freed by zero_grad
        # fp32 runs update the parameters themselves; bf16 runs keep an fp32 master copy.
        self.master = None
        if self.precision.enabled:  # the masters take the initial values before they are rounded
            self.master = torch.zeros(self.layout.numel, dtype=torch.float32, device=self.device)
            for s in self.layout.slots:
                self.master[s.start: s.end].copy_(s.param.detach().reshape(-1))
                s.param.data = s.param.data.to(self.precision.param_dtype)

    def _grad_storage(self) -> torch.Tensor:
        """The flat gradient buffer, allocated on the first gradient of a step and freed by
        `zero_grad`, which keeps it out of the forward's activation peak. (Freed and allocated
        again every step, it costs no page faults where freed memory is reused: CUDA's caching
        allocator, and glibc malloc tuned by train/host_memory.py, as every CPU rank is.)

        It is left uninitialised: each parameter's first gradient of the step is copied into its
        view (`_adopt_grad`); zeroing the whole buffer and letting autograd add into it would
        cost a fill and a read-modify-write pass over every gradient. Zeroed at allocation: the
        slots of parameters found unused on the first step, whose
        bucket goes on the wire without them (under no_sync, "unused" can also mean "reduced by
        another backward": a gradient that arrives later is added). Bucket padding holds whatever
        it holds: no optimizer segment, norm or gathered value reads it."""
        if self.grad_buffer is None:
            self.grad_buffer = torch.empty(self.layout.numel, dtype=self.precision.param_dtype, device=self.device)
            # each parameter's view, made once: this runs in a hook per parameter per step
            self._grad_views = {id(s.param): self.grad_buffer[s.start: s.end].view(s.shape) for s in self.layout.slots}
            # every slot waits for its first gradient but those of unused parameters, zeroed now
            self._unwritten = set(self._grad_views)
            for key in self.tracker.unused:
                self._unwritten.discard(key)
                self._grad_views[key].zero_()
        return self.grad_buffer

    def _ensure_grads(self) -> None:
        """Every parameter's .grad is its buffer view; those no gradient reached hold zeros."""
        if self.autograd_grads:
            for s in self.layout.slots:
                if s.param.grad is None:
                    s.param.grad = torch.zeros_like(s.param)
            return
        self._grad_storage()
        for key in self._unwritten:
            self._grad_views[key].zero_()
        self._unwritten.clear()
        for s in self.layout.slots:
            if s.param.grad is None:
                s.param.grad = self._grad_views[id(s.param)]

    def _adopt_grad(self, param: torch.Tensor) -> None:
        """Make param.grad the buffer's view: the step's first gradient of `param` is copied in,
        a later one (or one into a slot zeroed up front) added. (The buffer needs no autograd, so
        neither do these ops: no no_grad block.)"""
        if self._reduced:
            raise RuntimeError(
                "DDP: a gradient arrived after finish_backward() and before zero_grad(): the buffer holds "
                "the ranks' sum, and adding this rank's gradient to it would count the earlier backwards "
                "n times at the next reduction; accumulate micro-batches under no_sync() (syncing the "
                "last one only), or call zero_grad() first")
        grad = param.grad
        self._grad_storage()
        key = id(param)
        view = self._grad_views[key]
        if grad.data_ptr() == view.data_ptr():
            return  # autograd already accumulated in place
        if key in self._unwritten:
            self._unwritten.discard(key)
            view.copy_(grad)
        else:
            view.add_(grad)
        param.grad = view

    def _master_segments(self) -> list[MasterSegment]:
        out = []
        for s in self.layout.slots:
            seg = Segment(s, s.start, s.end)
            master = self.master[s.start: s.end] if self.master is not None else s.param.data.view(-1)
            out.append(MasterSegment(seg, master, lambda s=s: self._flat_grad(s)))
        return out

    def _flat_grad(self, slot) -> torch.Tensor:
        """`slot`'s gradient, 1-D: its buffer view, or autograd's own tensor at one rank."""
        if self.autograd_grads:
            return slot.param.grad.view(-1)
        return self._grad_storage()[slot.start: slot.end]

    # ------------------------------------------------------------------ backward

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside the block."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._adopt_grad(param)
        if self._sync:
            self.tracker.mark(param)

    def _launch(self, index: int) -> None:
        """All-reduce bucket `index` asynchronously (in fp32 if the buffer is lower precision)."""
        b = self.layout.buckets[index]
        view = self.grad_buffer[b.start: b.end]
        if view.dtype == self.precision.reduce_dtype:
            self._pending.append((self.comm.all_reduce(view, self.axes, async_op=True), None))
        else:
            self._finish_pending()  # one widened copy at a time (see there)
            wide = view.to(self.precision.reduce_dtype)
            self._pending.append((self.comm.all_reduce(wide, self.axes, async_op=True),
                                  lambda view=view, wide=wide: view.copy_(wide)))

    def _finish_pending(self) -> None:
        """Wait for the reductions in flight, in launch order, and copy back those that were widened.

        A bf16 buffer is reduced in fp32 through a widened copy of each bucket. Called before a
        bucket is widened, it keeps one such copy alive at a time; left to `finish_backward`,
        every bucket's copy would be alive at the end of backward: 4 bytes per parameter beside
        the buffer's 2. The wait costs overlap only where it blocks (gloo: the next bucket's
        gradients are not computed while the previous one is still on the wire)."""
        for handle, done in self._pending:
            handle.wait()
            if done is not None:
                done()
        self._pending.clear()

    def finish_backward(self) -> None:
        """Launch the buckets still waiting (unused parameters), then wait for every reduction."""
        if self.autograd_grads:
            if self.tracker.first_step:
                self.unused_parameters = [s.name for s in self.layout.slots if s.param.grad is None]
                self.tracker.first_step = False
            self._ensure_grads()
            return
        self._ensure_grads()  # they exist even if no gradient arrived (every parameter unused)
        first = self.tracker.first_step
        missing = self.tracker.flush()
        if first:
            self.unused_parameters = missing
        self._finish_pending()
        self.tracker.reset()
        self._reduced = True

    # ------------------------------------------------------------------ step

    def local_grad_squares(self) -> torch.Tensor:
        return self.optim.local_grad_squares(self.ctx, self.device)

    def clip_and_step(self, lr: float, max_norm: float) -> float:
        """Global gradient norm (pre-clip), clip, AdamW; returns the norm."""
        from meshlm.parallel.grad_norm import global_grad_norm

        norm = global_grad_norm(self.local_grad_squares(), self.comm, dp_sharded=self.dp_sharded)
        if self.optim.clip_and_step(lr, norm, max_norm):
            self._after_step()
        return norm.item()

    def refresh_from_masters(self) -> None:
        """The masters were written from outside (a checkpoint load): rebuild what derives from
        them, as after an optimizer step (collective for ZeRO: the slices are all-gathered)."""
        self._after_step()

    @torch.no_grad()
    def _after_step(self) -> None:
        if self.master is not None:  # bf16: the new fp32 values, rounded, become the parameters
            for s in self.layout.slots:
                s.param.data.copy_(self.master[s.start: s.end].view(s.shape))

    def zero_grad(self) -> None:
        """Free the gradients (set_to_none semantics): the next backward allocates them again."""
        self.grad_buffer = self._grad_views = None
        self._reduced = False
        for s in self.layout.slots:
            s.param.grad = None

    # ------------------------------------------------------------------ inspection

    def state_tensors(self) -> Iterator[torch.Tensor]:
        yield from self.module.parameters()
        if self.grad_buffer is not None:
            yield self.grad_buffer
        if self.autograd_grads:
            yield from (s.param.grad for s in self.layout.slots if s.param.grad is not None)
        if self.master is not None:
            yield self.master
        yield from self.optim.state_tensors()

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by kind (views of one storage counted once)."""
        return {"params": storage_bytes(s.param for s in self.layout.slots),
                "grads": storage_bytes([s.param.grad for s in self.layout.slots] if self.autograd_grads
                                       else [self.grad_buffer]),
                "master": storage_bytes([self.master]),
                "optimizer": storage_bytes(self.optim.state_tensors())}

    def _full_values(self, grads: bool) -> dict[int, torch.Tensor]:
        """id(param) -> its full fp32 value (or reduced gradient). Collective in sharded engines."""
        out = {}
        if grads:
            self._ensure_grads()
        for s in self.layout.slots:
            if grads:
                value = self._flat_grad(s).view(s.shape)
            else:
                value = s.param.detach() if self.master is None else self.master[s.start: s.end].view(s.shape)
            out[id(s.param)] = value.float().clone()
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights under the module's own names (every rank; collective when sharded)."""
        return named_state(self.module, self._full_values(grads=False))

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The reduced gradients, full and fp32, by parameter name (for tests; collective when sharded)."""
        values = self._full_values(grads=True)
        return {name: values[id(p)] for name, p in self.module.named_parameters() if id(p) in values}


def named_state(module: nn.Module, values: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """module.state_dict()'s names (tied weights under each of their names), parameters replaced
    by `values` (keyed by id of the parameter), persistent buffers as they are."""
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        out[name] = values[id(t)] if id(t) in values else t.detach().clone()
    return out
