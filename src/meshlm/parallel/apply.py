"""Where parallelism meets the model: the one place it is applied, in DESIGN.md's fixed order.
Reduces: nothing itself; it fixes the order every technique relies on and builds the model
sharded (on the meta device first), so a rank never holds more than its own part of it.
Costs: nothing at run time; at start-up, each rank's draw of its slices' random streams.

    Llama on meta -> TP/SP (slices) -> CP (ring attention, global RoPE positions)
      -> recompute (checkpoint wrappers) -> compile (each block's forward, train.compile; one
         process: the model's)
      -> PP split (this rank's stage) -> materialise
      -> DP engine: DDP / ZeRO-1/2 (materialised parameters) or FSDP (draws only its shard)

Every step is a module swap or a wrapper that keeps the single-process parameter names, which
is what checkpoints, the layout-independent init and the Hugging Face exporter address.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from meshlm.comm import Comm
from meshlm.config import Config
from meshlm.model import Llama
from meshlm.model.loss import token_loss_sum
from meshlm.parallel.compile import apply_compile, compile_loss_kernels, compiles_whole_model
from meshlm.parallel.context import ContextParallel, apply_context_parallel
from meshlm.parallel.data_parallel import DataParallel, build_data_parallel
from meshlm.parallel.recompute import apply_activation_checkpointing
from meshlm.parallel.sharded_init import ShardedInit, materialize_buffers
from meshlm.parallel.tensor import TensorParallel, apply_tensor_parallel
from meshlm.parallel.vocab_parallel import VocabParallelLoss


@dataclass
class LocalModel:
    """This rank's part of the model and the handles the trainer needs from each technique."""

    module: nn.Module  # a Llama, or a pipeline stage of one
    tp: TensorParallel | None  # None at tp=1
    cp: ContextParallel | None  # None at cp=1
    init: ShardedInit


def build_local_model(cfg: Config, comm: Comm) -> LocalModel:
    """Every transformation up to the DP engine, on the meta device, then this rank's parameters
    allocated and initialised (left to the FSDP engine under zero=3, which makes only its shard).
    The values equal the single-process `init_weights` for the same seed, whatever the layout."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    tp = apply_tensor_parallel(model, comm, cfg.parallel.sp)
    cp = apply_context_parallel(model, comm)
    apply_activation_checkpointing(model, cfg.train.recompute)
    if cfg.train.compile:  # lazily: dynamo traces each block at its first call, on the real parameters
        apply_compile(model, cfg.train.compile_backend, whole_model=compiles_whole_model(cfg))
    if cfg.parallel.pp > 1:
        from meshlm.parallel.pipeline import split_for_rank

        model = split_for_rank(model, cfg, comm.ctx)
    init = ShardedInit(cfg.model, cfg.run.seed, comm.ctx.coord("tp"))
    if cfg.parallel.zero == 3:
        materialize_buffers(model, comm.ctx.device)
    else:
        init.materialize(model, comm.ctx.device)
    return LocalModel(model, tp, cp, init)


LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> summed token loss


def build_loss(cfg: Config, tp: TensorParallel | None, comm: Comm) -> LossSum:
    """The trainer's `loss_sum(logits, targets)` for this rank's logits: vocabulary-parallel under
    TP, its chunk maths compiled under train.compile. It consumes the logits (their gradient is
    written over them): nothing reads them after the loss."""
    kernels = compile_loss_kernels(cfg.train.compile_backend) if cfg.train.compile else None
    if tp is not None:
        return VocabParallelLoss(tp.vocab, comm, kernels)
    return functools.partial(token_loss_sum, consume_logits=True, kernels=kernels)


def build_engine(local: LocalModel, cfg: Config, comm: Comm) -> DataParallel:
    """The data-parallel engine around `local.module` (parallel.zero picks which)."""
    if not any(True for _ in local.module.parameters()):
        # A pipeline stage given no layers (explicit split): nothing to reduce or update.
        from meshlm.parallel.pipeline.runner import ParameterlessStageDataParallel

        return ParameterlessStageDataParallel(local.module, comm)
    options = {}
    if cfg.parallel.zero == 3:
        device = comm.ctx.device
        options["values"] = lambda slot, lo, hi: local.init.local_values(slot.name, slot.param, lo, hi).to(device)
    return build_data_parallel(local.module, cfg, comm, **options)
