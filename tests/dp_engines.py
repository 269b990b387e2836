"""What the data-parallel engine tests share (test_ddp.py, test_ddp_bf16.py): the training
config, buckets small enough that the debug model spans ~10 of them, and `train_engine`, a few
steps of torch's DDP or meshlm's DDP / ZeRO-1/2 that returns the first step's gradients and the
final weights."""

import torch
import torch.distributed as dist
from torch import nn

from meshlm.config import TrainConfig
from meshlm.model.loss import token_loss_sum
from meshlm.parallel.ddp import DDP
from meshlm.parallel.zero import ZeroDataParallel
from meshlm.train.optim import build_optimizer

from helpers import comm_here, debug_model, local_batch

torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # import dynamo once, before forking ranks

TRAIN = TrainConfig(lr=1e-3, weight_decay=0.1)
SMALL_BUCKETS = 64 * 1024  # the debug model (~0.6 MB fp32) then spans ~10 buckets


def train_engine(engine_kind, steps, **options):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = debug_model()
    if engine_kind == "torch":
        engine = nn.parallel.DistributedDataParallel(model)
        optimizer = build_optimizer(model, TRAIN)
    else:
        comm = comm_here()
        engine = (DDP(model, comm, TRAIN, **options) if engine_kind == "ddp"
                  else ZeroDataParallel(model, comm, TRAIN, stage=int(engine_kind[-1]), **options))
    grads = None
    for step in range(steps):
        inputs, targets, tokens = local_batch(step, rank, n)
        module = engine if engine_kind == "torch" else engine.module
        loss = token_loss_sum(module(inputs), targets) / tokens
        if engine_kind == "torch":
            (loss * n).backward()  # torch DDP averages over ranks; meshlm sums a globally normalised loss
            if grads is None:
                grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        else:
            loss.backward()
            engine.finish_backward()
            if grads is None:
                grads = engine.full_grads()
            engine.clip_and_step(TRAIN.lr, 1.0)
            engine.zero_grad()
    params = engine.full_state_dict() if engine_kind != "torch" else model.state_dict()
    return grads, {k: v.detach().clone() for k, v in params.items()}
