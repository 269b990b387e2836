"""AdamW with fp32 master weights, and the learning-rate schedule (warmup, then a decay).

Parameters are kept in fp32 (the master copy) and bf16 enters only through autocast, so the
optimizer always updates fp32 weights with fp32 state: 16 bytes per parameter with its gradient.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshlm.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only: decaying norm gains (1-D) pulls them toward zero,
    which only fights the normalisation."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False keeps the update per-tensor, so a sharded optimizer later can reproduce it
    # element for element; on this scale the fused paths buy nothing.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over `warmup_steps`, then decay to `min_lr_ratio * lr` at `steps`: `lr_decay`
    is its shape (cosine, linear, or sqrt: 1 - sqrt(progress)), over the last `decay_fraction` of
    the steps after warmup; before those the rate holds at `lr` (warmup-stable-decay when < 1:
    a stable phase any number of decays can branch from, each a resume with its own `steps`).

    `step` counts from 0 (the update that makes step `step + 1`): the first update uses
    lr/warmup rather than 0, so no step is wasted; the last warmup update is the first at the
    peak, and the last update of the run (step `steps - 1`) is the one at the floor.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, round(cfg.decay_fraction * (cfg.steps - cfg.warmup_steps)))
    decay_start = cfg.steps - decay_steps  # updates up to here hold the peak
    progress = min(1.0, max(0.0, (step + 1 - decay_start) / decay_steps))
    remaining = {"cosine": 0.5 * (1 + math.cos(math.pi * progress)), "linear": 1 - progress,
                 "sqrt": 1 - math.sqrt(progress)}[cfg.lr_decay]
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + (cfg.lr - min_lr) * remaining


def scale_lr(base_lr: float, base_batch: int, new_batch: int, rule: str = "linear") -> float:
    """Learning rate for a new global batch size: `linear` (Goyal et al. 2017, SGD) multiplies by
    the batch ratio, `sqrt` (common for Adam) by its square root. Both need warmup at large batch."""
    ratio = new_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise ValueError(f"unknown LR scaling rule {rule!r} (linear or sqrt)")
