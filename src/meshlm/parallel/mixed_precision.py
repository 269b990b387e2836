"""Mixed precision and the sharded AdamW shared by the data-parallel engines.

Reduces: parameter and gradient bytes (2 instead of 4 per element in bf16) and the bytes on the
wire of the parameter all-gathers; the optimizer itself never sees bf16.
Costs: an fp32 master copy of the parameters (4 bytes per element, sharded under ZeRO) and a
cast after every optimizer step; gradients are upcast and reduced in fp32 by default, so a sum
over many ranks does not lose the small contributions.

`MixedPrecision(param_dtype, reduce_dtype)` is the policy: the dtype parameters and gradients
live in on every rank (and compute runs in), and the dtype gradients are summed in.
`SegmentAdamW` runs torch's own AdamW (foreach=False: the per-tensor path, element for element
the same arithmetic as the single-process optimizer) on fp32 master *segments*: 1-D views of a
flat master buffer, each the overlap of a shard with one parameter. A shard crosses parameter
boundaries, and weight decay differs per parameter (matrices only), hence segments.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from meshlm.config import TrainConfig
from meshlm.parallel.flat_buffer import Segment


@dataclass(frozen=True)
class MixedPrecision:
    """param_dtype: parameters, gradients and compute; reduce_dtype: the gradient reduction."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    @property
    def enabled(self) -> bool:
        return self.param_dtype != torch.float32


FP32 = MixedPrecision()
BF16 = MixedPrecision(torch.bfloat16, torch.float32)


def decays(param: torch.Tensor) -> bool:
    """meshlm's weight-decay rule (train/optim.py): matrices decay, 1-D gains and biases do not."""
    return param.ndim >= 2


class MasterSegment:
    """One piece of the optimizer's work: fp32 `master` (1-D) updated from `grad` (1-D, any dtype).
    `grad_of()` returns the gradient view: gradient buffers are allocated lazily in backward and
    freed by zero_grad, so the segment asks for its view when it needs it."""

    __slots__ = ("segment", "master", "grad_of")

    def __init__(self, segment: Segment, master: torch.Tensor, grad_of: Callable[[], torch.Tensor]):
        self.segment, self.master, self.grad_of = segment, master, grad_of

    @property
    def grad(self) -> torch.Tensor:
        return self.grad_of()

    @property
    def param(self) -> torch.nn.Parameter:
        return self.segment.slot.param


def adamw_implementation(on_cuda: bool) -> dict:
    """torch AdamW's implementation flags. CUDA: the fused kernel, a few launches for all the
    segments (34.7 ms per step for the 1b preset's 146 tensors one by one, 13.3 ms fused, on an
    H100) and no temporaries. CPU: one segment at a time (torch's per-tensor path, the single
    process reference's), since foreach's temporaries would add the whole shard to the step's peak."""
    return {"foreach": False, "fused": True} if on_cuda else {"foreach": False, "fused": None}


class SegmentAdamW:
    """torch.optim.AdamW over master segments. `step` assigns each segment its (clipped, fp32)
    gradient, steps, and drops the gradient references again."""

    def __init__(self, segments: Sequence[MasterSegment], cfg: TrainConfig) -> None:
        self.segments = list(segments)
        decay = [s.master for s in self.segments if decays(s.param)]
        no_decay = [s.master for s in self.segments if not decays(s.param)]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # A rank whose shard holds only padding has nothing to optimise; AdamW refuses empty lists.
        groups = [g for g in groups if g["params"]] or [{"params": [torch.zeros(0)], "weight_decay": 0.0}]
        on_cuda = all(g["params"][0].is_cuda for g in groups)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                           **adamw_implementation(on_cuda))

    def local_grad_squares(self, ctx, device: torch.device) -> torch.Tensor:
        from meshlm.parallel.grad_norm import counts_toward_norm

        grads = [s.grad.float() for s in self.segments if counts_toward_norm(s.param, ctx) and s.grad.numel()]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        # One multi-tensor kernel for every segment's norm (clip_grad_norm_ does the same), not
        # three launches per segment: on a GPU the per-segment loop was launch-bound.
        return torch.stack(torch._foreach_norm(grads)).square().sum()

    def clip_and_step(self, lr: float, norm: torch.Tensor, max_norm: float) -> bool:
        """AdamW with the gradients clipped by the global `norm`; nothing when the norm is not
        finite, so a NaN never reaches the weights (train.on_nonfinite, debug/nonfinite.py).
        Returns whether the update was applied."""
        if not math.isfinite(norm.item()):
            return False
        self.step(lr, clip_scale(norm, max_norm))
        return True

    @torch.no_grad()
    def step(self, lr: float, scale: torch.Tensor | None) -> None:
        """AdamW on every segment; `scale` (a 0-d tensor) multiplies the gradients first (clipping)."""
        grads = upcast_runs([s.grad for s in self.segments], [s.master.dtype for s in self.segments])
        for s, g in zip(self.segments, grads):
            s.master.grad = g
        fused = bool(self.optimizer.defaults.get("fused"))
        if scale is not None and fused:
            # The fused kernel divides each gradient by `grad_scale` as it reads it (GradScaler's
            # unscaling): the clip costs no pass over the gradients of its own (3.7 ms a step for
            # the 1b preset's 4.9 GB of fp32 gradients on an H100). g / (1 / s) is within a
            # rounding of g * s; every rank and the one-process reference take this same path.
            self.optimizer.grad_scale = scale.float().reciprocal()  # the kernel takes fp32 only
        elif scale is not None:  # in place, one multi-tensor op: clip_grad_norm_'s arithmetic; grads are zeroed next
            torch._foreach_mul_(grads, scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        try:
            self.optimizer.step()
        finally:
            self.optimizer.grad_scale = None
        for s in self.segments:
            s.master.grad = None

    def state_tensors(self) -> Iterator[torch.Tensor]:
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def upcast_runs(grads: list[torch.Tensor], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Each gradient in its master's dtype, cast with one kernel per run of segments that lie back
    to back in one buffer (a bucket's shard) instead of one per segment: a few launches per step
    rather than one per parameter on a GPU, and the same fp32 bytes. Same-dtype ones pass as is."""
    out: list[torch.Tensor | None] = [g if g.dtype == d else None for g, d in zip(grads, dtypes)]
    run: list[int] = []

    def flush() -> None:
        if run:
            first, last = grads[run[0]], grads[run[-1]]
            n = last.storage_offset() + last.numel() - first.storage_offset()
            wide = first.as_strided((n,), (1,)).to(dtypes[run[0]])
            for i in run:
                at = grads[i].storage_offset() - first.storage_offset()
                out[i] = wide[at: at + grads[i].numel()]
            run.clear()

    for i, (g, d) in enumerate(zip(grads, dtypes)):
        if out[i] is not None:
            continue
        prev = grads[run[-1]] if run else None
        if prev is None or not (g.is_contiguous() and prev.untyped_storage().data_ptr() == g.untyped_storage().data_ptr()
                                and prev.storage_offset() + prev.numel() == g.storage_offset() and dtypes[run[-1]] == d):
            flush()
        if g.is_contiguous():
            run.append(i)
        else:
            out[i] = g.to(d)
    flush()
    return out


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """clip_grad_norm_'s factor min(1, max_norm / (norm + 1e-6)); None when clipping is off."""
    if max_norm <= 0:
        return None
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total
