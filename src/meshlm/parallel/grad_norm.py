"""The gradient conventions every data-parallel engine shares: which ranks a gradient is reduced
over (dp x cp), which rank's copy of a parameter counts toward the global norm, and that norm.
Reduces: double counting; every distinct gradient element enters the clipping norm exactly once.
Costs: one scalar all-reduce per model-parallel axis per step (tp, pp, and dp x cp when sharded).
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.comm import Comm
from meshlm.parallel.tensor_layers import tp_slice

# Gradient reduction runs over dp x cp: context-parallel ranks hold the same weights and see
# different tokens, so their gradients are summed with the data-parallel ones.
GRAD_REDUCE_AXES = ("cp", "dp")


def counts_toward_norm(param: nn.Parameter, ctx) -> bool:
    """Whether this rank's copy of `param` adds to the global gradient norm, so that every
    distinct gradient element is counted exactly once across the model-parallel ranks.

    Conventions the model-parallel techniques follow (Megatron's, renamed):
    - `param.meshlm_tp_sharded = True`: each tp rank holds a different slice: all count (of kv
      heads replicated over `meshlm_tp_replicas` ranks, the first replica).
      Parameters without it are replicated across tp (norm weights): only tp rank 0 counts.
    - `param.meshlm_pp_duplicate = True`: a copy of a parameter another pipeline stage owns
      (the tied embedding on the last stage): it does not count.
    """
    if getattr(param, "meshlm_pp_duplicate", False):
        return False
    if getattr(param, "meshlm_tp_sharded", False):  # replicated kv heads: their first replica
        return tp_slice(param, ctx.coord("tp"))[1]
    return ctx.coord("tp") == 0


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
