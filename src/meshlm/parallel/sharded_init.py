"""Sharded construction: the model is built on the meta device, every parallel transformation
is applied there, and each rank then allocates and initialises only the elements it owns.
Reduces: peak memory while building to the rank's own shard (plus one chunk of random numbers),
so a model larger than one device can be constructed at all (llama3-70b under tp8-pp8).
Costs: time, not memory: each rank draws every tensor's random stream up to the end of its
slice, because its values must equal the single-process init, which draws each tensor in one go.

The order (parallel/apply.py): Llama on meta -> TP (slices of meta tensors are meta) -> CP ->
recompute -> PP split (this rank's layers only) -> `materialize` (zero 0-2) or FSDP (zero 3),
which asks `local_values` for the flat range of each parameter its shard covers and never
allocates the rest. A checkpoint or Hugging Face load then overwrites what was initialised,
through the same per-rank rectangles (train/checkpoint/), so nothing is ever whole on a rank.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.model.init import STREAM_CHUNK, InitStream, initial_rows
from meshlm.parallel.tensor_layers import tp_slice

TIED_EMBEDDING = "tok_embeddings.weight"


def init_name(name: str, param: nn.Parameter) -> str:
    """The single-process name whose init `param` takes: a pipeline's copy of the tied embedding
    (the last stage's head) is the embedding."""
    return TIED_EMBEDDING if getattr(param, "meshlm_pp_duplicate", False) else name


class ShardedInit:
    """The initial values of this rank's (tensor-parallel) slices, for a model config and seed."""

    def __init__(self, model_cfg, seed: int, tp_rank: int):
        self.cfg, self.seed, self.tp_rank = model_cfg, seed, tp_rank

    def local_values(self, name: str, param: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) of this rank's `param`, flattened, fp32 on the CPU, exactly as the
        single-process model's `init_weights` would give them (zero in a padded vocabulary)."""
        shape = tuple(param.shape)
        hi = param.numel() if hi is None else hi
        if len(shape) == 1:  # norm weights: ones (never sharded)
            return initial_rows(init_name(name, param), shape, self.seed, self.cfg, lo, hi)
        cols = shape[1]
        first, last = lo // cols, -(-hi // cols)  # local rows covering [lo, hi)
        block = self._local_rows(init_name(name, param), param, first, last)
        return block.reshape(-1)[lo - first * cols: hi - first * cols]

    def _local_rows(self, name: str, param: torch.Tensor, first: int, last: int) -> torch.Tensor:
        rows, cols = param.shape
        if not getattr(param, "meshlm_tp_sharded", False):
            return InitStream(name, (rows, cols), self.seed, self.cfg).read_rows(first, last)
        dim, full_size = param.meshlm_tp_dim, param.meshlm_tp_full_size
        offset = tp_slice(param, self.tp_rank)[0] * param.shape[dim]
        if dim == 1:  # row-parallel linear: this rank's columns of full rows, a block of rows at a time
            stream = InitStream(name, (rows, full_size), self.seed, self.cfg)
            out = torch.empty(last - first, cols)
            step = max(1, STREAM_CHUNK // full_size)
            for r in range(first, last, step):
                block = stream.read_rows(r, min(r + step, last))
                out[r - first: r - first + block.shape[0]] = block[:, offset: offset + cols]
            return out
        out = torch.zeros(last - first, cols)  # column-parallel / vocabulary: whole rows
        a, b = min(offset + first, full_size), min(offset + last, full_size)  # beyond full_size: padding
        if a < b:
            InitStream(name, (full_size, cols), self.seed, self.cfg).read_rows(a, b, out=out[: b - a])
        return out

    @torch.no_grad()
    def materialize(self, module: nn.Module, device: torch.device) -> None:
        """Allocate every meta parameter and buffer of `module` on `device` and initialise it;
        parameters keep their identity (ties and attributes survive). Buffers are re-derived by
        their module's `reset()` (the rotary tables)."""
        for name, param in module.named_parameters():
            if param.is_meta:
                value = self.local_values(name, param).view(param.shape)
                swap_in(param, value.to(device=device, dtype=param.dtype))
        materialize_buffers(module, device)


def swap_in(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give `param` the storage of `value` in place (a meta parameter cannot take a real tensor
    through `.data`); the Parameter object, so ties, gradient hooks and meshlm_* attributes, stay.

    `swap_tensors` exchanges the underlying tensors, and with them the autograd hooks already
    registered (sequence parallelism's all-reduce on the norms' gradients is registered on the
    meta parameter): they are registered again on the new tensor. Handles returned by the
    original registrations no longer remove them."""
    attrs = dict(param.__dict__)
    hooks = list((param._backward_hooks or {}).values())
    post_hooks = list((param._post_accumulate_grad_hooks or {}).values())
    torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
    param.__dict__.update(attrs)
    param._backward_hooks, param._post_accumulate_grad_hooks = None, None
    for hook in hooks:
        param.register_hook(hook)
    for hook in post_hooks:
        param.register_post_accumulate_grad_hook(hook)


def repoint(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make `param` hold `value`: through `.data` when it is real, by `swap_in` when it is meta."""
    if param.is_meta:
        swap_in(param, value)
    else:
        param.data = value


@torch.no_grad()
def materialize_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        meta = [n for n, b in sub.named_buffers(recurse=False) if b.is_meta]
        for n in meta:
            sub._buffers[n] = torch.empty_like(sub._buffers[n], device=device)
        if meta and hasattr(sub, "reset"):
            sub.reset()
