"""ZeRO-3 / FSDP: parameters sharded too, gathered one unit (a transformer block) at a time.

Reduces: model state to 16/n bytes per parameter (fp32 shard, fp32 gradient shard, Adam's two
moments: nothing is replicated); at any moment only the units being computed are unsharded.
Costs: 1.5x DDP's bytes on the wire (an all-gather before forward, another before backward,
a reduce-scatter after it: 3 x (n-1)/n instead of 2 x (n-1)/n); less if `reshard_after_forward`
is off (no second all-gather, but every unit stays unsharded from its forward to its backward).

Per unit (one module chosen by the wrapping policy, plus a root unit with everything left:
embeddings, final norm, head), the parameters are flattened into one padded buffer of which
rank r keeps the r-th 1/n slice (fp32: it is the master copy). The unsharded buffer exists only
while needed: its storage is resized to zero when resharded (the parameters stay views of it,
so autograd's saved references to them see the re-gathered values in backward).
- forward pre-hook: all-gather the unit (waiting for a prefetch if one is in flight), then
  prefetch the next unit's all-gather so it overlaps this unit's compute;
- forward post-hook: reshard (free), and hook the output's gradient: that hook runs just before
  the unit's backward, re-gathers it and prefetches the unit before it;
- a gradient-ready hook per parameter marks it; when the unit is complete its gradients are
  flattened into one buffer (in the reduce dtype), reduce-scattered asynchronously (units
  strictly in order: of those the module calls whose backward this is ran, see `_end_call`), the
  unit resharded, and only this rank's slice kept;
- a callback queued on the autograd engine ends each backward: waits, reshards what is left.
Every micro-batch's backward reduce-scatters (`no_sync()` has no effect, as in ZeRO-2).
Activation checkpointing works unchanged: recomputation runs after the output-gradient hook.
The root unit is gathered where a call first enters a module holding its parameters (a chunk of
an interleaved pipeline without them never gathers it) and stays unsharded from forward to
backward (no second all-gather for it), except its embedding tables: their weights are laid out
last in the root's buffer and, with `reshard_after_forward`, cut off its storage after forward,
since an embedding's backward needs only the indices. That is done only when the forward saved
nothing for backward in that range (checked on every forward by a saved-tensor hook, e.g. a tied
head keeps it); it frees the embedding during the loss and the head's backward, where the logits
peak.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from meshlm.comm import Comm
from meshlm.config import TrainConfig
from meshlm.parallel.ddp import named_state
from meshlm.parallel.flat_buffer import ReadyTracker, Segment, Slot, weak_hook
from meshlm.parallel.fsdp_units import (Unit, ValueSource, WrapPolicy, by_class, by_size,  # noqa: F401 (by_*: API)
                                        choose_units, values_from_parameters)
from meshlm.parallel.mixed_precision import FP32, MasterSegment, MixedPrecision, SegmentAdamW, storage_bytes
from meshlm.parallel.vocab_parallel import VocabParallelEmbedding

_engine = torch.autograd.Variable._execution_engine

class FullyShardedDataParallel:
    dp_sharded = True

    def __init__(self, module: nn.Module, comm: Comm, train_cfg: TrainConfig, *, axes=("cp", "dp"),
                 policy: WrapPolicy | None = None, reshard_after_forward: bool = True, prefetch: bool = True,
                 forward_prefetch: bool = False, precision: MixedPrecision = FP32,
                 values: ValueSource = values_from_parameters) -> None:
        """`values`: where each unit's shard comes from; the default reads the parameters, a
        meta-device model passes sharded_init's (so only this rank's elements are ever made)."""
        self.module, self.comm, self.ctx, self.axes = module, comm, comm.ctx, axes
        self.n, self.rank = self.ctx.size(axes), self.ctx.group_rank(axes)
        self.device, self.precision = self.ctx.device, precision
        # prefetch: gather the next unit of backward while this one computes. forward_prefetch:
        # the same in forward; off by default (as in FSDP2): it holds one more unit unsharded
        # during forward, where the activation peak is, for a gain only when compute is short.
        self.reshard_after_forward, self.prefetch, self.forward_prefetch = reshard_after_forward, prefetch, forward_prefetch
        # Units in forward order: the root (embeddings ... head) first, then the policy's modules.
        self.units: list[Unit] = []
        groups = choose_units(module, policy)
        # The root's embedding tables (nn.Embedding's or the vocabulary-parallel one's, not shared
        # with another module) go last, cut off after forward as their lookups save only indices
        # (`Unit.trim`); left in, tensor parallelism kept the table through the loss and head.
        owners: dict[int, list[nn.Module]] = {}
        for sub in module.modules():
            for p in sub.parameters(recurse=False):
                owners.setdefault(id(p), []).append(sub)
        tail_ids = {pid for pid, mods in owners.items()
                    if len(mods) == 1 and type(mods[0]) in (nn.Embedding, VocabParallelEmbedding)}
        if groups and groups[0][1]:
            root_params = groups[0][1]
            groups[0] = (groups[0][0], [x for x in root_params if id(x[1]) not in tail_ids]
                         + [x for x in root_params if id(x[1]) in tail_ids])
        for name, params in groups:
            if not params:
                continue
            if any(not p.requires_grad for _, p in params):
                raise ValueError(f"FullyShardedDataParallel: unit {name} has frozen parameters (not supported)")
            slots, offset = [], 0
            for pn, p in params:
                slots.append(Slot(pn, p, offset, p.numel(), p.shape))
                offset += p.numel()
            unit = Unit(len(self.units), name, slots, self.n, self.rank, precision, self.device, values)
            self.units.append(unit)
        self.root = self.units[0] if groups[0][1] else None
        if self.root is not None:
            tail = [s.start for s in self.root.slots if id(s.param) in tail_ids]
            self.root.tail = min(tail) if tail else self.root.slots[-1].end
        self._tail_used = False  # this forward saved part of the root's tail for backward
        self._saved_hooks = None  # the saved-tensor hooks context during the root's forward
        # Gradients complete in reverse forward order, the root (holding the embedding) last.
        backward_order = [u for u in reversed(self.units) if u is not self.root] + ([self.root] if self.root else [])
        self._backward_order = backward_order
        # The order output-gradient hooks fire in (the head's backward first): prefetch order.
        blocks = [u for u in self.units if u is not self.root]
        self._forward_next = {id(a): b for a, b in zip(self.units, self.units[1:])}
        hooks_order = [*([self.root] if self.root else []), *reversed(blocks)]
        self._backward_next = {id(a): b for a, b in zip(hooks_order, hooks_order[1:])}
        # A block's backward is followed by that of the block that ran before it in the same call:
        # under an interleaved pipeline a rank's blocks form chunks, each called alone, and the
        # rank's next block may be another chunk's (prefetched, it stayed gathered for nothing).
        # The root's prefetch (the rank's top block) is for a backward the root starts (the
        # head's); where a block's has started first, its hook comes after the blocks' own.
        self._forward_prev: dict[int, Unit | None] = {}  # learned from the first forward
        self._called: list[Unit] = []  # the blocks entered in the module's current call
        self._blocks_in_backward = False  # a block's backward has started in this backward
        # The root is gathered when the call first enters a module holding one of its parameters
        # (the embedding, the final norm, the head), not on entering the module: an interleaved
        # rank's chunk that holds none of them (a pipeline's middle) never gathers it. Only where
        # the module holds root parameters itself is it gathered on entry.
        root_owners = {m for s in (self.root.slots if self.root is not None else ()) for m in owners[id(s.param)]}
        self._lazy_root = bool(root_owners) and module not in root_owners
        self._in_call = False  # inside a call of the module
        self._root_in_call = False  # the current call gathered (uses) the root
        module.register_forward_pre_hook(lambda m, a: self._begin_call())
        for owner in root_owners if self._lazy_root else ():
            owner.register_forward_pre_hook(lambda m, a: None if self._root_in_call else self._pre_forward(self.root))
        self._backward_index = {id(u): i for i, u in enumerate(backward_order)}
        self.tracker = ReadyTracker([[(s.name, s.param) for s in u.slots] for u in backward_order], self._launch)
        self.tracker.reset(order=[])  # a backward reduces the units its calls ran: `_end_call`
        self._pending: list = []
        self._end_queued = False
        self.unused_parameters: list[str] = []
        for unit in self.units:
            owner = module if unit is self.root else module.get_submodule(unit.name)
            if not (unit is self.root and self._lazy_root):  # (else: its owners' pre-hooks)
                owner.register_forward_pre_hook(lambda m, a, u=unit: self._pre_forward(u))
            owner.register_forward_hook(lambda m, a, out, u=unit: self._post_forward(u, out))
            if unit is self.root:  # always_call: pop the saved-tensor hooks even if forward raises
                owner.register_forward_hook(lambda m, a, out: self._end_tail_check(), always_call=True)
            for s in unit.slots:
                s.param.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))
        if self.root is None:  # still need the end-of-forward bookkeeping for evaluation
            module.register_forward_hook(lambda m, a, out: self._post_forward(None, out))
        module.register_forward_hook(lambda m, a, out: self._end_call(out))
        segments = []
        for unit in self.units:
            for s in unit.slots:
                a, z = max(unit.lo, s.start), min(unit.hi, s.end)
                if a < z:
                    segments.append(MasterSegment(Segment(s, a, z), unit.shard[a - unit.lo: z - unit.lo],
                                                  lambda u=unit, a=a - unit.lo, z=z - unit.lo: u.grads()[a:z]))
        self.optim = SegmentAdamW(segments, train_cfg)

    # ------------------------------------------------------------------ gather / free

    def _gather(self, unit: Unit, wait: bool = True) -> None:
        if not unit.gathered:
            if unit.bound:
                unit.full.untyped_storage().resize_(unit.padded * unit.itemsize)
            else:
                unit.bind()
            src = unit.shard if unit.shard.dtype == unit.full.dtype else unit.shard.to(unit.full.dtype)
            unit.handle = self.comm.all_gather(unit.full, src, self.axes, async_op=True)
            unit.gathered = True
        if wait and unit.handle is not None:
            unit.handle.wait()
            unit.handle = None

    def _pre_forward(self, unit: Unit) -> None:
        if unit is not self.root:
            self._forward_prev.setdefault(id(unit), self._called[-1] if self._called else None)
            self._called.append(unit)
        if unit is self.root:
            return self._use_root()
        self._gather(unit)
        nxt = self._forward_next.get(id(unit))
        if self.forward_prefetch and nxt is not None:
            self._gather(nxt, wait=False)

    def _begin_call(self) -> None:
        self._called.clear()
        self._in_call, self._root_in_call = True, False

    def _use_root(self) -> None:
        """The call enters a module holding root parameters (or the module itself, see __init__)."""
        root = self.root
        if root.trimmed:  # a second forward before the backward: needs the embedding again
            root.free()
        self._gather(root)
        if self._in_call:  # (an owner called on its own, outside the module: no call to watch)
            self._root_in_call = True
            self._begin_tail_check()
        nxt = self._forward_next.get(id(root))  # the rank's first block: where the root comes first
        if self.forward_prefetch and nxt is not None and not self._called:
            self._gather(nxt, wait=False)

    def _end_call(self, output):
        """The module's call ends: its output's gradient hook starts the backward of the units it
        ran (its blocks, and the root where it used it), which is what that backward reduces, in
        the rank's backward order. Under an interleaved pipeline a chunk's backward so reduces
        its own units only, the same on every dp rank: the other chunk's, which get no gradient
        in it, used to be waited behind and reduce-scattered with zero gradients at its end."""
        if torch.is_grad_enabled():
            units = [self._backward_index[id(u)] for u in self._called]
            if self._root_in_call:
                units.append(self._backward_index[id(self.root)])
            for t in (output if isinstance(output, (tuple, list)) else (output,)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, units=units: self._begin_backward(units))
        return output

    def _begin_backward(self, units: list[int]) -> None:
        self._queue_end()
        self.tracker.extend(units)

    def _post_forward(self, unit: Unit | None, output):
        if not torch.is_grad_enabled():  # evaluation: no backward follows; the root ends the forward
            if unit is None or unit is self.root:
                for u in self.units:
                    u.free()
            elif unit is not None:
                unit.free()
            return output
        if unit is None or (unit is self.root and not self._root_in_call):  # (a call without the root)
            return output
        if unit is not self.root and self.reshard_after_forward:
            unit.free()
        if unit is self.root and self.reshard_after_forward and self._saved_hooks is not None \
                and not self._tail_used and unit.tail < unit.padded:
            unit.trim()
        for t in (output if isinstance(output, (tuple, list)) else (output,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad, u=unit: self._pre_backward(u))
        return output

    def _begin_tail_check(self) -> None:
        """Watch what the forward saves for backward: does anything alias the root's tail?
        Only where no other saved-tensor hooks are active (they would be overridden): else the
        tail is simply kept."""
        self._tail_used = False
        root = self.root
        if (not torch.is_grad_enabled() or not self.reshard_after_forward or root.tail >= root.slots[-1].end
                or self._saved_hooks is not None or torch._C._autograd._top_saved_tensors_default_hooks(False)
                is not None or not torch._C._autograd._saved_tensors_hooks_is_enabled()):
            return
        storage = root.full.untyped_storage()
        ptr, tail_byte = storage.data_ptr(), root.tail * root.itemsize

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not self._tail_used and t.device == root.full.device and t.numel() > 0:
                try:
                    same = t.untyped_storage().data_ptr() == ptr
                except RuntimeError:  # no plain storage: a jagged nested tensor, a sparse one
                    same = False      # (a sparse tensor's error subclasses RuntimeError)
                if same:
                    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
                    if (t.storage_offset() + extent) * t.element_size() > tail_byte:
                        self._tail_used = True
            return t

        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._saved_hooks.__enter__()

    def _end_tail_check(self) -> None:
        self._in_call = False
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None

    def _pre_backward(self, unit: Unit) -> None:
        self._queue_end()
        # A root of embedding tables alone (a pipeline's first stage) has nothing its backward
        # reads (an embedding's gradient needs the indices, not the table): freed after an earlier
        # micro-batch's backward, it is not gathered again for the next one's.
        if not (unit is self.root and unit.tail == 0 and self.reshard_after_forward and not self._tail_used):
            self._gather(unit)
        if unit is self.root:
            nxt = None if self._blocks_in_backward else self._backward_next.get(id(unit))
        else:
            self._blocks_in_backward = True
            nxt = self._forward_prev.get(id(unit), self._backward_next.get(id(unit)))
        if self.prefetch and nxt is not None:
            self._gather(nxt, wait=False)

    def _queue_end(self) -> None:
        if not self._end_queued:
            _engine.queue_callback(self._end_of_backward)
            self._end_queued = True

    # ------------------------------------------------------------------ gradients

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._queue_end()
        self.tracker.mark(param)

    def _launch(self, index: int) -> None:
        """A unit's gradients are complete: flatten them (in the reduce dtype) into one buffer,
        drop the per-parameter ones, reduce-scatter it asynchronously, free the unsharded params.
        Flattening at completion rather than at the first gradient keeps the buffer out of the
        middle of backward, where activations peak (the root's head gradient arrives first and
        its embedding gradient last)."""
        unit = self._backward_order[index]
        # The previous unit's reduce-scatter had this whole unit's backward to finish: waited (and
        # its full buffer freed) before this one's is made, one staging buffer lives at a time.
        self._drain()
        staging = torch.zeros(unit.padded, dtype=self.precision.reduce_dtype, device=self.device)
        with torch.no_grad():
            for s in unit.slots:
                if s.param.grad is not None:  # None: an unused parameter, its gradient stays zero
                    staging[s.start: s.end].copy_(s.param.grad.reshape(-1))
                    s.param.grad = None
        out = staging[unit.lo: unit.hi]
        handle = self.comm.reduce_scatter(out, staging, self.axes, async_op=True)
        self._pending.append((handle, unit, out, staging))
        unit.free()

    def _drain(self) -> None:
        """Wait for the reduce-scatters in flight, keep this rank's slices, free the full buffers."""
        for handle, unit, out, _staging in self._pending:
            handle.wait()
            unit.grads().add_(out)
        self._pending.clear()

    def _end_of_backward(self) -> None:
        self._end_queued = False
        self._blocks_in_backward = False
        # Under a pipeline each backward covers one chunk (and an interleaved rank's chunk may have
        # no layers): what is unused is decided at the step's end, in finish_backward.
        self.tracker.flush(end_of_step=False)
        self._drain()
        self.tracker.reset(order=[])
        for u in self.units:
            u.free()

    @contextlib.contextmanager
    def no_sync(self):
        yield  # every backward reduce-scatters (see the module docstring)

    def finish_backward(self) -> None:
        """Each backward reduced and freed its own (the queued end-of-backward callback); this
        ends the first step: what none of its backwards reached is unused from now on (also
        done by the first optimizer step, for callers that step without finishing)."""
        if self.tracker.first_step:
            self.unused_parameters = self.tracker.end_first_step()

    # ------------------------------------------------------------------ step

    def local_grad_squares(self) -> torch.Tensor:
        return self.optim.local_grad_squares(self.ctx, self.device)

    def clip_and_step(self, lr: float, max_norm: float) -> float:
        from meshlm.parallel.grad_norm import global_grad_norm

        self.finish_backward()
        norm = global_grad_norm(self.local_grad_squares(), self.comm, dp_sharded=True)
        self.optim.clip_and_step(lr, norm, max_norm)
        return norm.item()  # the next forward gathers the updated shards

    def refresh_from_masters(self) -> None:
        pass  # the fp32 shards are the masters; the next forward gathers them

    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_shard = None  # set_to_none: the next backward allocates them again

    # ------------------------------------------------------------------ inspection

    def state_tensors(self) -> Iterator[torch.Tensor]:
        for u in self.units:
            yield u.shard
            if u.grad_shard is not None:
                yield u.grad_shard
        yield from self.optim.state_tensors()

    def model_state_bytes(self) -> dict[str, int]:
        return {"params": storage_bytes([u.shard for u in self.units] + [u.full for u in self.units]),
                "grads": storage_bytes([u.grad_shard for u in self.units]), "master": 0,
                "optimizer": storage_bytes(self.optim.state_tensors())}

    @torch.no_grad()
    def _full_values(self, grads: bool) -> dict[int, torch.Tensor]:
        out = {}
        for u in self.units:
            full = torch.empty(u.padded, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full, u.grads() if grads else u.shard, self.axes)
            for s in u.slots:
                out[id(s.param)] = full[s.start: s.end].view(s.shape).clone()
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights under the module's names (collective: every rank must call it)."""
        return named_state(self.module, self._full_values(grads=False))

    def full_grads(self) -> dict[str, torch.Tensor]:
        values = self._full_values(grads=True)
        return {name: values[id(p)] for name, p in self.module.named_parameters()}
