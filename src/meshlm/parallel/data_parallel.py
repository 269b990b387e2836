"""The seam between the trainer and the data-parallel family: one interface that DDP, ZeRO-1/2 and
ZeRO-3/FSDP implement, so the training loop is the same whichever is chosen.

The trainer only ever calls the methods of `DataParallel`:

    for i, (inputs, targets) in enumerate(micro_batches):
        with dp.no_sync() if i < last else nullcontext():   # reduce only after the last one
            loss(dp.module(inputs), targets).backward()
    dp.finish_backward()                                     # every reduction of the step done
    grad_norm = dp.clip_and_step(lr, max_norm)               # norm over all ranks, then AdamW
    dp.zero_grad()

`ReplicatedDataParallel` is the plainest member: every rank keeps full parameters, gradients and
optimizer state, and one flat all-reduce sums the gradients after the last micro-batch.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Protocol

import torch
from torch import nn

from meshlm.comm import Comm
from meshlm.config import Config
from meshlm.train.optim import build_optimizer


class DataParallel(Protocol):
    module: nn.Module  # call forward on this

    def no_sync(self) -> contextlib.AbstractContextManager: ...

    def finish_backward(self) -> None: ...

    def clip_and_step(self, lr: float, max_norm: float) -> float: ...

    def zero_grad(self) -> None: ...

    def state_tensors(self) -> Iterator[torch.Tensor]: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...


# Gradient reduction runs over dp x cp: context-parallel ranks hold the same weights and see
# different tokens, so their gradients are summed with the data-parallel ones.
GRAD_REDUCE_AXES = ("cp", "dp")


def counts_toward_norm(param: nn.Parameter, ctx) -> bool:
    """Whether this rank's copy of `param` adds to the global gradient norm, so that every
    distinct gradient element is counted exactly once across the model-parallel ranks.

    Conventions the model-parallel techniques follow (Megatron's, renamed):
    - `param.meshlm_tp_sharded = True`: each tp rank holds a different slice: all count.
      Parameters without it are replicated across tp (norm weights): only tp rank 0 counts.
    - `param.meshlm_pp_duplicate = True`: a copy of a parameter another pipeline stage owns
      (the tied embedding on the last stage): it does not count.
    """
    if getattr(param, "meshlm_pp_duplicate", False):
        return False
    return getattr(param, "meshlm_tp_sharded", False) or ctx.coord("tp") == 0


def global_grad_norm(local_squares: torch.Tensor, comm: Comm, dp_sharded: bool = False) -> torch.Tensor:
    """sqrt of the sum of squared gradient elements over all ranks, from this rank's share.

    `local_squares`: the fp32 sum of squares of the gradient elements this rank holds and
    `counts_toward_norm`. Summed over tp and pp (model-parallel shards are distinct elements),
    and over dp x cp only when the optimizer shards gradients across them (ZeRO-2/3); replicated
    gradients are already equal on every dp rank.
    """
    squares = local_squares.clone()
    for axis in ("tp", "pp", *((GRAD_REDUCE_AXES,) if dp_sharded else ())):
        comm.all_reduce(squares, axis)
    return squares.sqrt()


def local_grad_squares(params: Iterable[nn.Parameter], ctx) -> torch.Tensor:
    squares = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for p in params:
        if p.grad is not None and counts_toward_norm(p, ctx):
            squares += p.grad.detach().float().pow(2).sum()
    return squares


class ReplicatedDataParallel:
    """Replicated parameters, one flat all-reduce (SUM) of all gradients after the last micro-batch.

    Reduces: nothing per rank (16 bytes/param of model state, like one GPU). Costs: 2(N-1)/N x
    gradient bytes per step, all exposed after backward (no overlap); DDP overlaps it.
    """

    def __init__(self, model: nn.Module, cfg: Config, comm: Comm) -> None:
        self.module = model
        self.comm = comm
        self.optimizer = build_optimizer(model, cfg.train)
        self._sync = True

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def finish_backward(self) -> None:
        if self.comm.ctx.size(GRAD_REDUCE_AXES) == 1:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.all_reduce(flat, GRAD_REDUCE_AXES)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip_and_step(self, lr: float, max_norm: float) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = global_grad_norm(local_grad_squares(params, self.comm.ctx), self.comm)
        if max_norm > 0:
            # The same arithmetic as torch.nn.utils.clip_grad_norm_: scale by min(1, max/(norm+eps)).
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in params:
                p.grad.mul_(scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return norm.item()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_tensors(self) -> Iterator[torch.Tensor]:
        yield from self.module.parameters()
        for p in self.module.parameters():
            if p.grad is not None:
                yield p.grad
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()


def build_data_parallel(model: nn.Module, cfg: Config, comm: Comm) -> DataParallel:
    """The data-parallel implementation for `parallel.zero` (0 = DDP)."""
    return ReplicatedDataParallel(model, cfg, comm)
