"""Compilation (train.compile): reduces each block's time by fusing its elementwise work (norms,
RoPE, SwiGLU) into fewer kernels; costs compile time at start-up and at each recompile.
The loss's chunk maths is compiled too (`compile_loss_kernels`, as torchtitan's compile.components
= ["model", "loss"]). Per block wherever the layout puts anything between blocks; on one process,
the whole forward (`compiles_whole_model`, below).

Each transformer block's forward is replaced on the instance by a `torch.compile`d one, as
recompute does, after TP/SP, CP and recompute and before the PP split and the DP engine (the order
of torchtitan: TP -> AC -> compile -> FSDP). So parameter names, checkpoints and the module hooks
the engines register (FSDP's gathers, DDP's and ZeRO's gradient hooks) stay outside the compiled
code: `Module.__call__` runs them eagerly around the compiled forward. Dynamo traces a block as a
function of its module (parameters are graph inputs, not constants), so all blocks share one set
of graphs instead of compiling n_layers of them. On one process with nothing between the blocks
(`compiles_whole_model`) the model's own forward is compiled instead: one graph, one call's host
overhead per micro-batch.

fullgraph=False: what dynamo cannot trace runs eagerly between compiled pieces (a graph break).
Inside a block those are meshlm's collectives (`Comm`'s ops are never traced, so the flight
recorder brackets the real op): TP/SP's all-reduces, all-gathers and reduce-scatters with the
autograd functions around them, ring attention's P2P exchanges, and a pipeline stage's linears
that defer their weight gradients. The compiled pieces are the computation between them. A module
called where a graph breaks is compiled as a function of its own, once per distinct weight shape
(a TP linear: wq, wk/wv, w1/w3), still not per block; dynamo's limit of 8 entries per function
leaves room for those and for evaluation's no_grad variants.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from meshlm.model.loss import (ChunkKernels, chunk_rows, exp_sum_and_target, softmax_minus_target,
                               softmax_minus_target_fused)
from meshlm.parallel.recompute import is_recomputed

try:
    from torch.utils._python_dispatch import any_torch_dispatch_mode_on_stack
except ImportError:  # an older torch (GPU machines may lag the pinned CPU one): any mode at all

    def any_torch_dispatch_mode_on_stack() -> bool:
        return torch._C._len_torch_dispatch_stack() > 0


# `train.compile_backend`, as torchtitan's `compile.backend`: inductor generates fused kernels
# (C++/OpenMP on a CPU, Triton on a GPU); aot_eager traces the same graphs, forward and backward
# through AOTAutograd, and runs them with eager kernels (no code generated: starts in a fraction of
# the time, the tests use it); eager only captures the graphs with dynamo (to look for breaks).
BACKENDS = ("inductor", "aot_eager", "eager")


def compiles_whole_model(cfg) -> bool:
    """Whether train.compile makes the whole forward one graph rather than one per block: on one
    process, where nothing runs between the blocks (no collective, no FSDP gather, no checkpoint,
    no stage boundary) and no reduction could overlap backward anyway. There each compiled call's
    host overhead (dynamo's guards, AOTAutograd's wrappers) is paid once, not per block and pass:
    a small model's step is host-bound on a GPU (RESULTS.md "gpu", 125m); a host-bound toy step
    on a CPU went 17.1 -> 14.7 ms (docs/3d-parallelism.md). Costs: the first compile traces every
    block, and hooks added to a block later are not seen (dynamo does not guard on them)."""
    p = cfg.parallel
    return p.dp * p.tp * p.pp * p.cp == 1 and p.zero != 3 and cfg.train.recompute == "none"


def apply_compile(model: nn.Module, backend: str, whole_model: bool = False) -> None:
    """Compile the forward of every block in `model.layers` (or, `whole_model`, the model's own
    forward, the blocks inlined: see compiles_whole_model). Under train.recompute=full the
    checkpoint stays outside, eager, and recomputes the compiled forward: compiled around it
    instead, a graph break inside the checkpoint (any collective under TP or CP) would leave dynamo
    nothing to compile in the whole block."""
    _check(backend)
    if whole_model:
        model.forward = _compiled(model.forward, backend)
        return
    for block in model.layers:
        name = "forward_without_recompute" if is_recomputed(block) else "forward"
        setattr(block, name, _compiled(getattr(block, name), backend))


def compile_loss_kernels(backend: str) -> ChunkKernels:
    """The loss's chunk maths compiled (model/loss.py): a chunk's forward becomes one fused
    reduction over the logits, its backward one kernel that reads them and writes their gradient
    in their own dtype, where the eager functions make and re-read fp32 chunks. The gradient is
    returned and copied into the logits' storage by the caller, never written into an input inside
    the compiled code: with the logits consumed, that input and the destination would be one
    storage, and torch 2.13's compile cache (AOTAutograd's "synthetic base" for aliased inputs) was
    seen to hand such a graph to a later call whose inputs do not alias: wrong values, no error.
    With no fp32 chunk to hold, inductor's chunks are larger (loss.FUSED_CHUNK_BYTES): fewer calls."""
    _check(backend)

    def grad_in_logits_dtype(chunk, local, lse, scale, mine, in_place):
        return softmax_minus_target_fused(chunk, local, lse, scale, mine)

    def rows(vocab: int, tokens: int) -> int:
        # Only inductor fuses the chunk maths; aot_eager and eager run it as written, with fp32
        # intermediates and [rows, V] masks (a 512 MiB chunk then held ~750 MiB at the 125m
        # shape). Where the eager kernels run instead (below, or dynamo disabled), their chunks.
        fused = (backend == "inductor" and not torch._dynamo.config.disable
                 and not any_torch_dispatch_mode_on_stack())
        return chunk_rows(vocab, tokens, fused=fused)

    # Where the compiled code cannot run (the memory tracker's steps), the eager kernel, not the
    # fused one run eagerly: that one allocates [rows, V] masks, and the step would measure them.
    return ChunkKernels(_compiled(exp_sum_and_target, backend),
                        _compiled(grad_in_logits_dtype, backend, eager=softmax_minus_target), rows)


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown compile backend {backend!r} (known: {', '.join(BACKENDS)})")


def _compiled(forward: Callable, backend: str, eager: Callable | None = None) -> Callable:
    """`forward` compiled, and run as `eager` (default: `forward` itself) where dynamo cannot run."""
    compiled = torch.compile(forward, backend=backend, fullgraph=False)
    eager = eager or forward

    def forward_compiled(*args, **kwargs):
        # Dynamo does not run under a TorchDispatchMode, and one call under it skips the code for
        # good. The CPU memory tracker is one (train/memtrack.py): its measured steps (the first
        # two and every train.memory_interval-th) run eagerly, so they measure eager memory.
        if any_torch_dispatch_mode_on_stack():
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    return forward_compiled
