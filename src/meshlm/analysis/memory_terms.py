"""The memory model's terms (analysis/memory.py walks them through a rank's step): parameters per
rank and the activations a pipeline stage saves (each engine's model state and transient buffers
are analysis/memory_state.py; the pipeline schedule's terms, a rank's compute program and the
stage-boundary tensors, analysis/memory_schedule.py). Every term is a formula over the config; the
derivations are in docs/memory.md, the measurements in tests/test_memory*.py.
"""

from __future__ import annotations

from meshlm.config import Config
from meshlm.parallel.tensor import activation_bytes_per_layer


# --------------------------------------------------------------------------- parameter counts


def _padded(n: int, tp: int) -> int:
    return -(-n // tp) * tp


def layer_parameters(m, tp: int) -> int:
    """One block's parameters on one tp rank (kv heads split, or one whole head when replicated)."""
    d = m.head_dim
    kv_local = max(1, m.n_kv_heads // tp)  # replicated when tp is a multiple of n_kv_heads
    attention = m.dim * (m.n_heads // tp) * d * 2 + 2 * m.dim * kv_local * d
    return attention + 3 * m.dim * (m.ffn_dim // tp) + 2 * m.dim


def stage_layers(cfg: Config) -> list[list[int]]:
    """Layer indices of each pipeline rank (all its virtual stages)."""
    p = cfg.parallel
    ranges = stage_ranges(cfg)
    return [[i for s in range(rank, p.pp * p.pp_virtual, p.pp) for i in ranges[s]] for rank in range(p.pp)]


def rank_parameters(cfg: Config, pp_rank: int) -> dict[str, int]:
    """Parameters pipeline rank `pp_rank` holds on each tp rank: `layers`, `embedding`, `head`
    (with a tied copy on the last stage), `norm`."""
    m, p = cfg.model, cfg.parallel
    vocab = _padded(m.vocab_size, p.tp) // p.tp * m.dim
    first, last = pp_rank == 0, pp_rank == p.pp - 1
    tied_here = m.tie_embeddings and first
    return {"layers": len(stage_layers(cfg)[pp_rank]) * layer_parameters(m, p.tp),
            "embedding": vocab if first else 0,
            "head": vocab if last and not tied_here else 0,
            "norm": m.dim if last else 0}


# --------------------------------------------------------------------------- activations


def activation_itemsize(cfg: Config) -> int:
    return 2 if cfg.train.dtype == "bfloat16" else 4


def bf16_weights(cfg: Config) -> bool:
    """bf16 parameters with fp32 masters (ZeRO 1-3 in bf16), as parallel/data_parallel.py's
    `precision_for` decides; DDP in bf16 keeps fp32 weights under autocast (`autocast`)."""
    return cfg.train.dtype == "bfloat16" and cfg.parallel.zero > 0


def autocast(cfg: Config) -> bool:
    return cfg.train.dtype == "bfloat16" and cfg.parallel.zero == 0


def block_weight_copy_bytes(cfg: Config) -> int:
    """One block's bf16 copies of its matmul weights under autocast (the norms' stay fp32); 0
    otherwise. Held by autocast's cache through the forward; saved by each matmul (below), or
    (full recompute) rebuilt with the block in its backward."""
    return 2 * (layer_parameters(cfg.model, cfg.parallel.tp) - 2 * cfg.model.dim) if autocast(cfg) else 0


def block_saved_weight_copy_bytes(cfg: Config) -> int:
    """The bf16 weight copies a block saves for backward under autocast: every matmul's, but under
    SP the column linears (q, k, v, gate, up) save their fp32 weight and recast it in backward
    (tensor_layers.py `_ColumnLinearSavingShard`): only wo's and w2's."""
    m, p = cfg.model, cfg.parallel
    if not autocast(cfg) or not p.sp:
        return block_weight_copy_bytes(cfg)
    return 2 * m.dim * (m.n_heads // p.tp * m.head_dim + m.ffn_dim // p.tp)


def last_stage(cfg: Config) -> int:
    """The global index of the last pipeline stage (the one with the head and the loss)."""
    return cfg.parallel.pp * cfg.parallel.pp_virtual - 1


def rope_table_bytes(cfg: Config) -> int:
    """The RoPE cos/sin tables every rank keeps, fp32 [max_seq_len, head_dim] each."""
    return 2 * cfg.model.max_seq_len * cfg.model.head_dim * 4


def microbatch_tokens(cfg: Config) -> tuple[int, int]:
    """(micro-batch rows, sequence positions) one rank computes per micro-batch."""
    from meshlm.parallel.pipeline.runner import microbatch_plan

    p = cfg.parallel
    batch = microbatch_plan(cfg)[1] if p.pp > 1 else cfg.train.micro_batch_size
    return batch, cfg.train.seq_len // p.cp


def block_saved_bytes(cfg: Config) -> tuple[int, int]:
    """(bytes one block saves for backward under the config's recompute, bytes rebuilt during
    its backward): full recompute keeps only each block's input and rebuilds one block at a time."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    batch, seq = microbatch_tokens(cfg)
    item = activation_itemsize(cfg)
    outside = batch * seq // (p.tp if p.sp else 1)  # tokens of the norms (sequence-sharded under SP)
    lse = batch * seq * (m.n_heads // p.tp) * 4  # the attention's log-sum-exp, fp32 in any dtype
    whole = activation_bytes_per_layer(m, batch, seq, p.tp, p.sp, item) + lse * (4 - item) // 4
    if bf16_weights(cfg):
        # bf16 weights: each RMSNorm saves its input upcast to fp32 and its fp32 statistic, and
        # RoPE the bf16 cos/sin copies it makes for q and k (model/llama.py)
        whole += outside * 2 * (2 * m.dim + 2) + 4 * seq * m.head_dim * 2
    elif autocast(cfg):
        # autocast over fp32 weights (DDP): the norms' inputs, normalised values and statistics
        # stay fp32 (26h + 8 bytes a token, against the table's 2 x (6h + 2)), and each of the five
        # linears reading the residual stream (q, k, v, gate, up) saves its own bf16 copy of its
        # input; RoPE saves its bf16 tables
        # (under SP the column linears save their region's input shard, the norm's weighted fp32
        # output, in place of their own bf16 copies: 12h + 4 bytes over the table's)
        whole += outside * ((12 if p.sp else 14) * m.dim + 4) + 4 * seq * m.head_dim * 2
    if t.recompute == "full":  # the block's input: the residual stream, fp32 under autocast
        # (the rebuilt block saves its copies as a forward does: under SP wo's and w2's only)
        return outside * m.dim * (4 if autocast(cfg) else item), whole + block_saved_weight_copy_bytes(cfg)
    if t.recompute == "selective" and p.cp == 1:
        # only the attention core's log-sum-exp goes: its output is saved anyway, as the input of
        # the output projection (with a flash-style kernel there is no s x s matrix to drop)
        return whole - lse, 0
    return whole, 0  # (ring attention is not selectively recomputed: see parallel/context.py)


def vocab_local(cfg: Config) -> int:
    return _padded(cfg.model.vocab_size, cfg.parallel.tp) // cfg.parallel.tp


def loss_transient_bytes(cfg: Config, tokens: int, backward: bool) -> int:
    """The loss's short-lived fp32 [rows, vocab/tp] chunk (model/loss.py): forward shifts a chunk
    by its row maxima into a new fp32 buffer; backward upcasts a chunk of bf16 logits (fp32
    logits are overwritten where they lie)."""
    from meshlm.model.loss import chunk_rows

    vocab = vocab_local(cfg)
    chunk = min(tokens, chunk_rows(vocab, tokens)) * vocab * 4
    return chunk * (cfg.train.dtype == "bfloat16" if backward else 1)


def chunk_saved_bytes(cfg: Config, stage: int) -> int:
    """Bytes global pipeline stage `stage` saves per micro-batch in flight."""
    layers = len(stage_ranges(cfg)[stage])
    saved = layers * block_saved_bytes(cfg)[0]
    # the last stage's norm, head and loss; another stage's output, referenced until its gradient comes back
    saved += head_saved_bytes(cfg) if stage == last_stage(cfg) else boundary_bytes(cfg)
    if cfg.train.recompute != "full":  # a block recomputed in full saves no copies until its backward rebuilds it
        saved += layers * block_saved_weight_copy_bytes(cfg)
    return saved


def head_saved_bytes(cfg: Config) -> int:
    """What the last stage saves per micro-batch beyond its blocks: the final norm's input,
    normalised and weighted values (the head's input) and fp32 statistic; the loss keeps the
    logits, in their dtype, and per row its two fp32 sums (model/loss.py), the int64 target and a
    bool mask. All of it is freed before the top block's backward starts."""
    m, p = cfg.model, cfg.parallel
    batch, seq = microbatch_tokens(cfg)
    tokens, item = batch * seq, activation_itemsize(cfg)
    sharded = tokens // p.tp if p.sp else tokens
    saved = 3 * sharded * m.dim * item + sharded * 4 + tokens * vocab_local(cfg) * item + tokens * (8 + 8 + 1)
    if cfg.train.dtype == "bfloat16":  # the final norm's input in fp32 (and, autocast, its output)
        saved += sharded * m.dim * (4 if autocast(cfg) else 2)
        if autocast(cfg) and p.sp:  # the head's input: SP's saved shard, the weighted fp32 output, not a bf16 copy
            saved += sharded * m.dim * 2
    if autocast(cfg) and not p.sp:  # the head's bf16 weight copy (SP's column linear recasts it in backward)
        saved += 2 * vocab_local(cfg) * m.dim
    return saved


def stage_ranges(cfg: Config) -> list[range]:
    from meshlm.mesh import parse_pp_layers
    from meshlm.parallel.pipeline.stage import split_layers

    p = cfg.parallel
    counts = parse_pp_layers(p.pp_layers) if p.pp_layers else None
    return split_layers(cfg.model.n_layers, p.pp * p.pp_virtual, counts)


def boundary_bytes(cfg: Config) -> int:
    """One tensor crossing a pipeline stage boundary (an activation or its gradient): the residual
    stream of a micro-batch, in the weights' dtype (fp32 under autocast), sequence-sharded under SP
    (parallel/pipeline/runner.py)."""
    p = cfg.parallel
    batch, seq = microbatch_tokens(cfg)
    return batch * seq // (p.tp if p.sp else 1) * cfg.model.dim * (2 if bf16_weights(cfg) else 4)


def largest_block_weight(cfg: Config) -> int:
    """Elements of a block's largest weight on one tp rank."""
    m, tp = cfg.model, cfg.parallel.tp
    return max(m.dim * m.ffn_dim // tp, m.dim * m.n_heads * m.head_dim // tp)


def largest_deferred_weight(cfg: Config, stage: int) -> int:
    """Elements of the largest linear weight whose gradient pipeline stage `stage` defers: the
    flush makes one weight's gradient at a time."""
    return max(largest_block_weight(cfg), vocab_local(cfg) * cfg.model.dim if stage == last_stage(cfg) else 0)


def deferred_inputs_bytes(cfg: Config, stage: int, layers: int | None = None) -> int:
    """What the store of stage `stage` holds beside the output gradients once `layers` of its blocks
    (from the top; default all) have run their backward: each deferred linear's input (the QKV,
    output, gate/up and down projections' of those layers, and the head's), kept by the store
    whether the block saved it or rebuilt it under full recompute; under autocast each of the five
    linears reading the residual stream has its own bf16 copy."""
    m, p = cfg.model, cfg.parallel
    batch, seq = microbatch_tokens(cfg)
    per_layer = (5 if autocast(cfg) else 2) * m.dim + m.n_heads // p.tp * m.head_dim + m.ffn_dim // p.tp
    layers = len(stage_ranges(cfg)[stage]) if layers is None else layers
    inputs = layers * per_layer + (m.dim if stage == last_stage(cfg) else 0)
    return batch * seq * inputs * activation_itemsize(cfg)


def deferred_wgrad_bytes(cfg: Config, stage: int, layers: int | None = None) -> int:
    """Pipeline stages after the first defer their linears' weight gradients in each chunk's last
    backward (parallel/pipeline/deferred_wgrad.py): every linear's output gradient and input stay
    alive until the flush; the rest of a block (saved or rebuilt under full recompute) goes with
    its backward. `layers`: owed once that many of the stage's blocks (from the top) have run
    their backward; default all of them."""
    m, p = cfg.model, cfg.parallel
    if p.pp == 1 or stage == 0 or not p.pp_defer_wgrad or p.zero > 1 or p.tp > 1:  # (tp's linears never defer)
        return 0
    batch, seq = microbatch_tokens(cfg)
    tokens, item = batch * seq, activation_itemsize(cfg)
    layers = len(stage_ranges(cfg)[stage]) if layers is None else layers
    outputs = (m.n_heads // p.tp + 2 * max(1, m.n_kv_heads // p.tp)) * m.head_dim + 2 * m.dim + 2 * m.ffn_dim // p.tp
    out = layers * tokens * outputs * item + deferred_inputs_bytes(cfg, stage, layers)
    if stage == last_stage(cfg):
        out += tokens * vocab_local(cfg) * activation_itemsize(cfg)  # the logits' gradient, kept for the head's
    return out
