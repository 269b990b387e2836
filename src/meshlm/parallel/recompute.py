"""Activation checkpointing: reduces activation memory by storing only each block's input and
recomputing the rest in backward; costs one extra forward of what is recomputed (~33% for full).

`full` recomputes whole transformer blocks (the saved activations per layer fall from ~34·s·b·h
bytes in bf16 to the block's input, 2·s·b·h). `selective` (Korthikanti et al. 2022) recomputes only
the attention core, chosen in the paper because an eager core stores its [b, a, s, s] scores
(5·a·s²·b bytes) for little compute. meshlm's core is PyTorch's scaled_dot_product_attention, whose
flash kernels (CPU and CUDA) store no s x s matrix: selective drops only the core's log-sum-exp
(its output is the output projection's saved input anyway), measured in docs/memory.md. To save
memory use `full`; `selective` pays where a core does store scores (ring attention stores none
and is skipped).
"""

from __future__ import annotations

import types

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(self: nn.Module, *args, **kwargs):
    # use_reentrant=False: works with inputs that do not require grad and with kwargs, and is
    # the implementation PyTorch recommends.
    return checkpoint(self.forward_without_recompute, *args, use_reentrant=False, **kwargs)


def recompute_module(module: nn.Module) -> None:
    """Make `module` recompute its forward in backward. The forward is replaced on the instance,
    not wrapped in a new module, so parameter names (and checkpoints) do not change. It is a
    method of one shared function, not a functools.partial per module: torch.compile guards a
    partial by its identity and would compile every block again (train.compile, compile.py)."""
    module.forward_without_recompute = module.forward
    module.forward = types.MethodType(_checkpointed, module)


def is_recomputed(module: nn.Module) -> bool:
    """Whether `recompute_module` made `module` recompute (its own forward is then
    `module.forward_without_recompute`)."""
    return "forward_without_recompute" in vars(module)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """`mode` is none, full (every transformer block) or selective (every block's attention core)."""
    if mode == "none":
        return
    for block in model.layers:
        if mode == "full":
            recompute_module(block)
        elif mode == "selective":
            # A core that never stores the [S, S] scores (ring attention) has nothing to drop.
            if getattr(block.attention.core, "stores_scores", True):
                recompute_module(block.attention.core)
        else:
            raise ValueError(f"unknown recompute mode {mode!r}")
