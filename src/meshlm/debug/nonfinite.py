"""A non-finite loss or gradient, caught before it reaches the weights (`train.on_nonfinite`).

Reduces: a run that silently trains on NaN weights, or dies later far from the cause, to a report
naming the step, the rank whose loss went bad and the first parameter whose gradient is not finite.
Costs: nothing per step beyond the gradient norm every step already computes (its value is read
before the optimizer step, which every engine skips when it is not finite); locating the culprit
is one object gather over the world, only on a bad step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """train.on_nonfinite=stop: the step's update was not applied and the run ends. `ranks`: the
    ranks whose own loss was not finite (or that hold the first bad gradient)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def culprits(views: list[dict]) -> list[int]:
    bad_loss = [v["rank"] for v in views if not v["loss_finite"]]
    return bad_loss or [v["rank"] for v in views if v["first_param"]][:1]


def first_nonfinite_gradient(engine, model: torch.nn.Module) -> str | None:
    """The first parameter, in model order, whose gradient (this rank's shard of it) is not finite."""
    bad = set()
    for segment in getattr(getattr(engine, "optim", None), "segments", ()):  # reduction order, not model order
        grad = segment.grad
        if grad is not None and grad.numel() and not bool(torch.isfinite(grad).all()):
            bad.add(id(segment.param))
    return next((name for name, p in model.named_parameters() if id(p) in bad), None)


def locate(engine, model, local_loss: torch.Tensor, rank: int, world_size: int) -> list[dict]:
    """Every rank's view (collective over the world): is its own loss finite, and its first
    non-finite gradient. all_gather_object bypasses the traced Comm: it moves a few pickled
    strings on a failure path, and its ops are not part of any step's pattern."""
    mine = {"rank": rank, "loss_finite": math.isfinite(float(local_loss)),
            "first_param": first_nonfinite_gradient(engine, model)}
    if world_size == 1:
        return [mine]
    views: list[dict | None] = [None] * world_size
    dist.all_gather_object(views, mine)
    return views


def describe(step: int, grad_norm: float, views: list[dict]) -> str:
    bad_loss = [v["rank"] for v in views if not v["loss_finite"]]
    params = [(v["rank"], v["first_param"]) for v in views if v["first_param"]]
    where = (f"the loss of rank{'s' if len(bad_loss) > 1 else ''} {', '.join(map(str, bad_loss))} is not finite"
             if bad_loss else "every rank's loss is finite")
    first = f"; first non-finite gradient: {params[0][1]} (rank {params[0][0]})" if params else ""
    return f"non-finite gradient norm ({grad_norm}) at step {step}: {where}{first}"
