"""The seam between the trainer and the data-parallel family: one interface that DDP, ZeRO-1/2 and
ZeRO-3/FSDP implement, so the training loop is the same whichever is chosen.

The trainer only ever calls the methods of `DataParallel`:

    for i, (inputs, targets) in enumerate(micro_batches):
        with dp.no_sync() if i < last else nullcontext():   # reduce only after the last one
            loss(dp.module(inputs), targets).backward()
    dp.finish_backward()                                     # every reduction of the step done
    grad_norm = dp.clip_and_step(lr, max_norm)               # norm over all ranks, then AdamW
    dp.zero_grad()

Members: `ddp.DDP` (zero=0), `zero.ZeroDataParallel` (zero=1, 2), `fsdp.FullyShardedDataParallel`
(zero=3). Besides this interface they offer `full_grads()` (the reduced gradients, full, by name;
collective) and `model_state_bytes()` (what this rank holds, by kind) for tests and reports.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch
from torch import nn

from meshlm.comm import Comm
from meshlm.config import Config
from meshlm.parallel.grad_norm import GRAD_REDUCE_AXES


class DataParallel(Protocol):
    module: nn.Module  # call forward on this

    def no_sync(self) -> contextlib.AbstractContextManager: ...

    def finish_backward(self) -> None: ...

    def clip_and_step(self, lr: float, max_norm: float) -> float: ...

    def zero_grad(self) -> None: ...

    def refresh_from_masters(self) -> None: ...  # after a checkpoint load wrote the fp32 masters

    def state_tensors(self) -> Iterator[torch.Tensor]: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...


def precision_for(cfg: Config):
    """The mixed-precision policy for a run. bf16 with ZeRO 1-3: bf16 parameters and gradients,
    fp32 master weights (sharded) and fp32 reduction. bf16 with DDP: the parameters stay fp32
    (they are the master copy) and the trainer's autocast computes in bf16; for DDP the two cost
    the same 16 bytes/parameter, and the model's own parameters remain the fp32 weights."""
    from meshlm.parallel.mixed_precision import BF16, FP32

    return BF16 if cfg.train.dtype == "bfloat16" and cfg.parallel.zero > 0 else FP32


def build_data_parallel(model: nn.Module, cfg: Config, comm: Comm, **options) -> DataParallel:
    """The data-parallel engine for `parallel.zero`: 0 = DDP, 1/2 = ZeRO-1/2, 3 = ZeRO-3/FSDP.
    `options` go to the engine (e.g. bucket_bytes, reshard_after_forward)."""
    precision = precision_for(cfg)
    zero = cfg.parallel.zero
    if zero == 0:
        from meshlm.parallel.ddp import DDP

        return DDP(model, comm, cfg.train, axes=GRAD_REDUCE_AXES, precision=precision, **options)
    if zero in (1, 2):
        from meshlm.parallel.zero import ZeroDataParallel

        return ZeroDataParallel(model, comm, cfg.train, stage=zero, axes=GRAD_REDUCE_AXES, precision=precision,
                                **options)
    if zero == 3:
        from meshlm.model.llama import TransformerBlock
        from meshlm.parallel.fsdp import FullyShardedDataParallel, by_class

        options.setdefault("policy", by_class(TransformerBlock))
        return FullyShardedDataParallel(model, comm, cfg.train, axes=GRAD_REDUCE_AXES, precision=precision,
                                        **options)
    raise ValueError(f"parallel.zero must be 0, 1, 2 or 3, got {zero}")
