"""What one pipeline rank sends for one micro-batch, collective by collective: the communication
volume the step-time model prices (analysis/steptime.py), stated from what meshlm's engines do
and checked against their flight recorders, op by op and byte for byte (tests/test_plan_messages.py).
Reduces: guessing; a model that prices fewer or smaller messages than the engines send ranks
layouts on the wrong costs. Costs: nothing (arithmetic).

Three dtypes meet in a step: `e`, the GEMMs' (bf16 under either bf16 mode); `p`, the weights'
and the residual stream's: fp32 under autocast (train.dtype=bfloat16 with DDP: the parameters are
the fp32 master copy, data_parallel.precision_for), bf16 with ZeRO 1-3's bf16 weights. Norm
outputs, the embedding's output, the stage boundary and their gradients are in `p`; a row-parallel
linear's output and its gradient in `e`.

Per transformer block, tensor parallel with sequence parallelism (parallel/tensor_layers.py):
  forward   2 all-gathers of the norm output [b, s, h] (p); 2 reduce-scatters of the row-parallel
            outputs (e)
  backward  2 reduce-scatters (the gathers' backward, p), 2 all-gathers (the reduce-scatters'
            backward, e), 2 all-gathers again (p: the column linears saved the shard, not the
            gathered input), 2 all-reduces of a norm weight's gradient [h] (p)
  full recompute, in backward: the forward's all-gathers, and one reduce-scatter: the block's
            recomputation stops at its last saved tensor (the down projection's input), before
            the MLP's reduce-scatter (torch.utils.checkpoint's early stop)
The first stage adds the vocabulary-parallel embedding (its output reduce-scattered, p; its
gradient all-gathered); the last the final norm's all-reduce, the head's region (a gather, its
re-gather and the reduce-scatter of its input gradient, p) and the vocabulary-parallel loss
(all-reduces of one and two fp32 values per token, parallel/vocab_parallel.py).

Context parallel (parallel/context.py), per block: the stacked K and V (e) travel cp - 1 hops
forward, again backward (and again in a full recompute's forward), and their fp32 gradients cp
hops. Pipeline: one boundary tensor [b, s/cp, h] / tp (p) per chunk that has a next (forward) or
a previous one (backward). Data parallel: the bytes each ZeRO stage reduces and gathers, per
micro-batch and per step (`data_parallel_bytes`). The metrics' scalars (loss, token count,
gradient norm: one reduction each a step) are not listed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Message:
    """`forward` + `backward` messages of `nbytes` each (the flight recorder's size: a gather's
    output, a reduce-scatter's input, a send's tensor), per micro-batch, on one rank."""

    op: str  # all_gather | reduce_scatter | all_reduce | send
    axis: str  # tp | cp | pp
    nbytes: int
    forward: int
    backward: int


def dtype_bytes(work, lay) -> tuple[int, int]:
    """(e, p): bytes per element of the GEMMs' outputs and of the weights and residual stream."""
    e = work.itemsize
    return e, (4 if lay.zero == 0 else e)


def boundary_bytes(work, lay) -> int:
    """One micro-batch's activations (or their gradient) between pipeline stages: under SP each
    tp rank sends its sequence shard (pipeline/engine.py's sequence_shards)."""
    return lay.micro_batch_size * (work.seq // lay.cp) * work.model.dim * dtype_bytes(work, lay)[1] // lay.tp


def ring_block_bytes(work, lay) -> int:
    """Elements of one stacked K and V block of the CP ring, on one tp rank."""
    m = work.model
    kv_local = max(1, m.n_kv_heads // lay.tp) * m.head_dim
    return 2 * lay.micro_batch_size * (work.seq // lay.cp) * kv_local


def layer_matmul_params(m) -> int:
    """Weights of one block's matmuls (wq wk wv wo w1 w2 w3), all tp ranks together."""
    kv = m.n_kv_heads * m.head_dim
    return 2 * m.dim * m.dim + 2 * m.dim * kv + 3 * m.dim * m.ffn_dim


def block_params(work, lay) -> float:
    """Parameters of one block on one tp rank (its norms are whole on every tp rank)."""
    return layer_matmul_params(work.model) / lay.tp + 2 * work.model.dim


def rank_params(work, lay, r: int) -> float:
    """Parameters pipeline rank r holds on one tp rank (embedding on the first, head on the last)."""
    m = work.model
    n = m.n_layers // lay.pp * block_params(work, lay)
    table = m.vocab_size * m.dim / lay.tp
    if r == 0:
        n += table
    if r == lay.pp - 1:  # the final norm, and a head unless it is the embedding on this same rank
        n += m.dim + (0 if m.tie_embeddings and lay.pp == 1 else table)
    return n


def data_parallel_bytes(work, lay, stage: int) -> dict[str, dict[str, float]]:
    """Bytes by collective over dp x cp (the ranks that hold the same weights) on pipeline rank
    `stage`, however many buckets carry them: per micro-batch ("forward", "backward") and once a
    step ("step"). Gradients are reduced in fp32, weights gathered in their dtype p. ZeRO-3
    gathers each unit before its forward and the blocks again before their backward: the root unit
    (embeddings, final norm, head) stays gathered from forward to backward (parallel/fsdp.py); a
    first pipeline stage's, its embedding alone, is cut off after each forward and never gathered
    for a backward. (Interleaved chunks gather more: not modelled.)"""
    sizes: dict[str, dict[str, float]] = {"forward": {}, "backward": {}, "step": {}}
    if lay.dp * lay.cp == 1:
        return sizes
    p = dtype_bytes(work, lay)[1]
    params = rank_params(work, lay, stage)
    grads, weights = 4 * params, p * params
    if lay.zero == 0:
        sizes["step"]["all_reduce"] = grads
    elif lay.zero == 1:
        sizes["step"].update(reduce_scatter=grads, all_gather=weights)
    elif lay.zero == 2:
        sizes["backward"]["reduce_scatter"] = grads
        sizes["step"]["all_gather"] = weights
    else:
        sizes["forward"]["all_gather"] = weights
        sizes["backward"].update(all_gather=p * work.model.n_layers // lay.pp * block_params(work, lay),
                                 reduce_scatter=grads)
    return sizes


def stage_messages(work, lay, stage: int) -> list[Message]:
    """Pipeline rank `stage`'s messages per micro-batch (all its chunks together)."""
    m = work.model
    e, p = dtype_bytes(work, lay)
    layers = m.n_layers // lay.pp
    tokens = lay.micro_batch_size * (work.seq // lay.cp)
    full = lay.recompute == "full"
    first, last = stage == 0, stage == lay.pp - 1
    out: list[Message] = []
    if lay.tp > 1:
        act_p, act_e = tokens * m.dim * p, tokens * m.dim * e
        out += [Message("all_gather", "tp", act_p, 2 * layers + last, (4 if full else 2) * layers + last + first),
                Message("reduce_scatter", "tp", act_e, 2 * layers, layers if full else 0),
                Message("reduce_scatter", "tp", act_p, first, 2 * layers + last),
                Message("all_gather", "tp", act_e, 0, 2 * layers),
                Message("all_reduce", "tp", m.dim * p, 0, 2 * layers + last)]
        if last:
            out += [Message("all_reduce", "tp", tokens * 4, 1, 0), Message("all_reduce", "tp", 2 * tokens * 4, 1, 0)]
    if lay.cp > 1:
        block = ring_block_bytes(work, lay)
        out += [Message("send", "cp", block * e, (lay.cp - 1) * layers, (lay.cp - 1) * layers * (2 if full else 1)),
                Message("send", "cp", block * 4, 0, lay.cp * layers)]
    if lay.pp > 1:
        v = lay.pp_virtual
        out.append(Message("send", "pp", boundary_bytes(work, lay), v - last, v - first))
    return _merged(out)


def _merged(messages: list[Message]) -> list[Message]:
    """One entry per (op, axis, size), without empty ones: where e == p two rows are one kind."""
    kinds: dict[tuple, list[int]] = {}
    for msg in messages:
        counts = kinds.setdefault((msg.op, msg.axis, msg.nbytes), [0, 0])
        counts[0] += msg.forward
        counts[1] += msg.backward
    return [Message(*key, f, b) for key, (f, b) in kinds.items() if f or b]
