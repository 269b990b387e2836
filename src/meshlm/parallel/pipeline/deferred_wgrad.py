"""Deferred weight gradients: a stage sends its input gradient before it computes its weight gradients.

Reduces: the time the previous stage waits for its gradient. A linear layer's backward is two
matmuls of equal size, one for the input's gradient (dgrad, on the critical path: the previous
stage needs it) and one for the weight's (wgrad, needed only by the optimizer step). Deferring
the wgrads of a backward until its dgrad has been sent takes about half of that backward off the
path of whoever waits on it, at least in the pipeline's drain, where the first stage's last
backward waits on the second's. This is the B/W split of zero-bubble pipelining (Qi et al.
2023); DeepSeek's DualPipe keeps the same kind of store.
Costs: each deferred layer's (compute-dtype) input and output gradient live from its backward until
the flush (one micro-batch's worth), one more autograd call per weight and flush (it accumulates
the weight gradients through autograd so data-parallel hooks fire as usual), and about 0.1 ms of Python per
layer and pass on a CPU for the custom autograd function, which is why layers defer only when armed.

Scope: plain bias-free `nn.Linear` layers (all of Llama's linears and its head). Embeddings and
norm weights keep their usual backward (their weight gradients are cheap); tensor-parallel layers
keep their own autograd functions. The owner must call `flush()` after every backward that ran
through a deferred layer, before the optimizer reads the gradients.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    """The weight gradients owed by deferred layers since the last flush: (weight, input, grad_out).

    Layers defer only what was forwarded while the store was `armed`: a custom autograd function
    costs some Python per layer and pass (about 0.1 ms on a CPU), worth paying only where someone
    waits on the gradient (the owner arms the store for those forwards; see `armed_for`)."""

    def __init__(self) -> None:
        self._pending: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []
        self.armed = False

    @contextlib.contextmanager
    def armed_for(self, arm: bool = True):
        """Forwards inside the block (when `arm`) build graphs whose weight gradients are deferred."""
        previous, self.armed = self.armed, arm
        try:
            yield
        finally:
            self.armed = previous

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, weight: nn.Parameter, inputs: torch.Tensor, grad_output: torch.Tensor) -> None:
        self._pending.append((weight, inputs, grad_output))

    def flush(self) -> None:
        """Compute every owed weight gradient and accumulate it through autograd, one weight at a
        time: an identity view of the weight gets the gradient, so its AccumulateGrad node runs and
        the weight's post-accumulate-grad hooks (DDP buckets, ZeRO-1) fire exactly as in a plain
        backward. One at a time, and each input and output gradient dropped once used, so a flush
        holds one weight's gradient beside what is still owed (all of them at once doubled the
        stage's gradient memory at the flush: docs/memory.md, "Measured phase by phase")."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        uses: dict[int, list[int]] = {}  # a weight used more than once in the backward: summed first
        for i, (weight, _, _) in enumerate(pending):
            uses.setdefault(id(weight), []).append(i)
        with torch.enable_grad():
            for indices in uses.values():
                weight, grad = pending[indices[0]][0], None
                for i in indices:
                    _, inputs, grad_output = pending[i]
                    pending[i] = None
                    # [N, out]^T @ [N, in] over all leading (batch, sequence) positions: dL/dW for y = x W^T.
                    part = (grad_output.reshape(-1, grad_output.shape[-1]).t()
                            @ inputs.reshape(-1, inputs.shape[-1])).to(weight.dtype)
                    del inputs, grad_output
                    grad = part if grad is None else grad + part
                torch.autograd.backward([weight.view_as(weight)], [grad])


class _DeferredWeightGradLinear(torch.autograd.Function):
    """y = x W^T whose backward returns dL/dx at once and leaves dL/dW to the store.

    The weight enters detached (so autograd keeps no edge to it and never expects its gradient from
    this node); the layer rides along (a module, not a tensor, so not an autograd input) and tells
    the store whose gradient it owes. Under autocast both
    operands are cast here, as autocast would cast them for F.linear, and the cast copies are saved,
    so dgrad and wgrad run in the compute dtype exactly as autocast's own backward would."""

    @staticmethod
    def forward(ctx, inputs: torch.Tensor, weight: torch.Tensor, layer: "DeferredWeightGradLinear"):
        device_type = inputs.device.type
        if torch.is_autocast_enabled(device_type):  # F.linear leaves operands already in this dtype alone
            dtype = torch.get_autocast_dtype(device_type)
            inputs_dtype, inputs, weight = inputs.dtype, inputs.to(dtype), weight.to(dtype)
        else:
            inputs_dtype = inputs.dtype
        ctx.save_for_backward(inputs, weight)
        ctx.layer, ctx.inputs_dtype = layer, inputs_dtype
        return F.linear(inputs, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        inputs, weight = ctx.saved_tensors
        ctx.layer.weight_grad_store.add(ctx.layer.weight, inputs, grad_output)
        grad_inputs = grad_output.matmul(weight)
        if grad_inputs.dtype != ctx.inputs_dtype:
            grad_inputs = grad_inputs.to(ctx.inputs_dtype)
        return grad_inputs, None, None


class DeferredWeightGradLinear(nn.Linear):
    """An nn.Linear (same parameters, same state-dict names) whose weight gradient waits for the
    store's flush. Made by `defer_weight_grads`, which switches the class of existing layers."""

    weight_grad_store: WeightGradStore

    # Never traced by a compiled block (train.compile): its backward writes to the store, which
    # dynamo cannot put in a graph, and a traced `armed` would recompile the layer per weight shape.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # An input without gradient would leave the function outside the graph (its only autograd
        # input is x), and the weight's gradient would be lost: such layers take the plain path.
        if not (self.weight_grad_store.armed and torch.is_grad_enabled() and self.weight.requires_grad
                and x.requires_grad):
            return F.linear(x, self.weight)
        return _DeferredWeightGradLinear.apply(x, self.weight.detach(), self)


def defer_weight_grads(module: nn.Module, store: WeightGradStore) -> int:
    """Make every plain bias-free nn.Linear inside `module` defer its weight gradient to `store`;
    returns how many layers were switched. Subclasses (tensor-parallel layers) are left alone."""
    switched = 0
    for layer in module.modules():
        if type(layer) is nn.Linear and layer.bias is None:
            layer.__class__ = DeferredWeightGradLinear
            layer.weight_grad_store = store
            switched += 1
    return switched
