"""The language-modelling loss: summed next-token cross-entropy over the target tokens.

Summed, not averaged: the trainer divides by the global target-token count, so every layout
(data, context, pipeline parallel, any micro-batch split) computes the gradient of the same mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a target that is not a token to predict (padding, masked prompt)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over target tokens (fp32), ignoring positions marked IGNORE_INDEX."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
