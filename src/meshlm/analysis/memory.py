"""The per-rank memory model: bytes of parameters, gradients, optimizer state, fp32 masters,
activations and transient buffers for any config and layout, without starting a rank.
Reduces: guessing why a run does not fit; each term is a formula over the config (nothing fitted).
Costs: nothing at run time; its accuracy is what `tests/test_memory.py` measures against the
trainer's per-rank `mem_peak_bytes` (CPU: live tensor bytes; GPU: the CUDA allocator's peak).

How the peak is found. A rank's step is its program: the forwards and backwards of its
micro-batches in the order the engine runs them (for a pipeline, the schedule's own instruction
list; without one, forward/backward pairs), then the gradient reduction and the optimizer step.
`predict` walks that program keeping the live bytes: each forward adds the activations its chunk
saves, each backward frees them. At every point where memory can peak it records the whole
breakdown: after a forward; at the loss and its backward (the last stage: the fp32 chunks the
loss upcasts); at the first gradients of a backward (the head's weight
gradient, a freshly allocated gradient buffer, ZeRO-2's staging bucket, FSDP's gathered units);
at the gradient reduction; inside the optimizer step. The largest point is the peak, reported
with its breakdown and its name (`phase`). See docs/memory.md for each term's derivation.

The model state per engine (N = this rank's parameters, d = dp x cp, p = 2 in bf16 else 4):

    DDP (zero 0)  params 4N, grads 4N once backward starts, AdamW 8N; bf16 is autocast: the bf16
                  weight copies are saved activations (2 bytes per matmul weight and forward)
    ZeRO-1        params pN, grads pN (full buffer), masters 4N/d in bf16, AdamW 8N/d
    ZeRO-2        params pN, grads pN/d, one bucket of fp32 staging in backward, masters, AdamW 8N/d
    ZeRO-3/FSDP   fp32 shard 4N/d, grad shard 4N/d, AdamW 8N/d, plus the gathered units (p bytes):
                  the root (embeddings, norm, head) from forward to backward, the block being
                  computed, and in backward the next one prefetched

Where the backend matters: on gloo across hosts the reduce-scatter is meshlm's P2P ring, which
receives into fp32 scratch chunks (gloo's own copied the whole input); NCCL's needs none, and
neither does "shm", gloo with every rank on one host, where the collectives go through a shared
memory window that is library memory like NCCL's buffers (comm/shared_memory.py).
`predict(cfg, backend=...)` takes it; the trainer passes its own (`runtime_backend`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshlm.config import Config
from meshlm.parallel.tensor import activation_bytes_per_layer

BACKENDS = ("nccl", "gloo", "shm")


def runtime_backend(device_type: str, world_size: int) -> str:
    """The backend a run on `device_type` with `world_size` ranks has, for `predict`."""
    from meshlm.comm.shared_memory import on_one_host

    if device_type == "cuda":
        return "nccl"
    return "shm" if on_one_host(world_size) else "gloo"

RANK_FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes", "activations_bytes",
               "other_bytes", "peak_bytes")


@dataclass
class RankMemory:
    """One distinct rank role (ranks differing only in dp, cp or tp coordinate are alike)."""

    role: str
    ranks: int  # how many ranks have this role
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    master_bytes: int
    activations_bytes: int
    other_bytes: int  # transients at the peak: loss buffers, gathered FSDP units, staging, tables
    peak_bytes: int
    phase: str = ""  # where in the step the peak is

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class MemoryReport:
    peak_bytes: int
    ranks: list[RankMemory]

    def as_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "ranks": [r.as_dict() for r in self.ranks]}


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
    ranges = _stage_ranges(cfg)
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


def _itemsize(cfg: Config) -> int:
    return 2 if cfg.train.dtype == "bfloat16" else 4


def _tokens(cfg: Config) -> tuple[int, int]:
    """(micro-batch rows, sequence positions) one rank computes per micro-batch."""
    from meshlm.parallel.pipeline.runner import microbatch_plan

    p = cfg.parallel
    batch = microbatch_plan(cfg)[1] if p.pp > 1 else cfg.train.micro_batch_size
    return batch, cfg.train.seq_len // p.cp


def _block_saved(cfg: Config) -> tuple[int, int]:
    """(bytes one block saves for backward under the config's recompute, bytes rebuilt during
    its backward): full recompute keeps only each block's input and rebuilds one block at a time."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    batch, seq = _tokens(cfg)
    item = _itemsize(cfg)
    outside = batch * seq // (p.tp if p.sp else 1)  # tokens of the norms (sequence-sharded under SP)
    whole = activation_bytes_per_layer(m, batch, seq, p.tp, p.sp, item)
    if t.dtype == "bfloat16" and p.zero > 0:
        # bf16 weights: each RMSNorm saves its input upcast to fp32 and its fp32 statistic, and
        # RoPE the bf16 cos/sin copies it makes for q and k (model/llama.py)
        whole += outside * 2 * (2 * m.dim + 2) + 4 * seq * m.head_dim * 2
    if t.recompute == "full":
        return outside * m.dim * item, whole
    if t.recompute == "selective" and p.cp == 1:
        # only the attention core's log-sum-exp goes: its output is saved anyway, as the input of
        # the output projection (with a flash-style kernel there is no s x s matrix to drop)
        return whole - batch * seq * (m.n_heads // p.tp) * item, 0
    return whole, 0  # (ring attention is not selectively recomputed: see parallel/context.py)


def _vocab_local(cfg: Config) -> int:
    return _padded(cfg.model.vocab_size, cfg.parallel.tp) // cfg.parallel.tp


def _loss_transient_bytes(cfg: Config, tokens: int, backward: bool) -> int:
    """The loss's short-lived fp32 [rows, vocab/tp] chunk (model/loss.py): forward shifts a chunk
    by its row maxima into a new fp32 buffer; backward upcasts a chunk of bf16 logits (fp32
    logits are overwritten where they lie)."""
    from meshlm.model.loss import chunk_rows

    vocab = _vocab_local(cfg)
    chunk = min(tokens, chunk_rows(vocab)) * vocab * 4
    return chunk * (cfg.train.dtype == "bfloat16" if backward else 1)


def _chunk_saved(cfg: Config, stage: int) -> int:
    """Bytes global pipeline stage `stage` saves per micro-batch in flight."""
    m, p = cfg.model, cfg.parallel
    batch, seq = _tokens(cfg)
    tokens, item = batch * seq, _itemsize(cfg)
    sharded = tokens // p.tp if p.sp else tokens
    layers = len(_stage_ranges(cfg)[stage])
    saved = layers * _block_saved(cfg)[0]
    if stage == p.pp * p.pp_virtual - 1:
        # the final norm's input, normalised and weighted values (the head's input); the loss
        # keeps the logits, in their dtype
        saved += 3 * sharded * m.dim * item + tokens * _vocab_local(cfg) * _itemsize(cfg)
    else:  # the stage's output stays referenced until its gradient comes back
        saved += sharded * m.dim * item
    if cfg.train.dtype == "bfloat16" and p.zero == 0:  # autocast's bf16 weight copies, saved by each matmul
        matmul = layers * (layer_parameters(m, p.tp) - 2 * m.dim)
        if stage == p.pp * p.pp_virtual - 1:
            matmul += _vocab_local(cfg) * m.dim
        saved += 2 * matmul
    return saved


def _stage_ranges(cfg: Config) -> list[range]:
    from meshlm.mesh import parse_pp_layers
    from meshlm.parallel.pipeline.stage import split_layers

    p = cfg.parallel
    counts = parse_pp_layers(p.pp_layers) if p.pp_layers else None
    return split_layers(cfg.model.n_layers, p.pp * p.pp_virtual, counts)


def _program(cfg: Config, pp_rank: int) -> list[tuple[bool, int]]:
    """This rank's (is_forward, chunk) compute instructions, in the order the engine runs them."""
    from meshlm.parallel.pipeline.runner import microbatch_plan

    p = cfg.parallel
    m = microbatch_plan(cfg)[0]
    if p.pp == 1:
        return [(fwd, 0) for _ in range(m) for fwd in (True, False)]
    from meshlm.parallel.pipeline.schedules import BACKWARD, FORWARD, build_schedule

    return [(ins.op == FORWARD, ins.chunk) for ins in build_schedule(p.pp_schedule, p.pp, m, p.pp_virtual)[pp_rank]
            if ins.op in (FORWARD, BACKWARD)]


def micro_batches_in_flight(cfg: Config, pp_rank: int) -> int:
    """The most (micro-batch, chunk) activations rank `pp_rank` holds at once (its program's)."""
    live = peak = 0
    for forward, _ in _program(cfg, pp_rank):
        live += 1 if forward else -1
        peak = max(peak, live)
    return peak


# --------------------------------------------------------------------------- the model state


@dataclass
class _State:
    """One rank's model state and the engine's transient buffers, in bytes."""

    params: float
    grads: float  # once the step's first backward has produced gradients
    optimizer: float
    master: float
    gathered_forward: float = 0  # FSDP: unsharded units held during a forward (the root and a block)
    gathered_after_forward: float = 0  # ... when it ends (the root)
    gathered_loss: float = 0  # ... at the loss's backward
    gathered_backward: float = 0  # ... during a block's backward (with the prefetched one)
    staging: float = 0  # ZeRO-2: the bucket being filled, alive through backward
    in_flight: float = 0  # ZeRO-2: the bucket being reduced, with gloo's ring scratch (from the blocks' backward on)
    weight_grad: float = 0  # the head's (or a block's) weight gradient as autograd makes it
    embedding_grad: float = 0  # the embedding's dense weight gradient, as autograd makes it
    reduction: float = 0  # at the end of backward: the last bucket's reduce buffers
    step: float = 0  # inside the optimizer step: fp32 gradient copies, AdamW temporaries
    reduces_in_backward: bool = False  # FSDP: each unit's reduction starts inside backward
    finishes_in_backward: bool = False  # zero 2/3: each backward waits for its own reductions
    param_item: int = 4  # bytes per parameter element
    grads_early: bool = True  # the gradient storage exists from a backward's first gradient (zero 0/1)
                              # rather than from its first reduction (zero 2/3: the shard)


def _block_largest(cfg: Config) -> int:
    """Elements of a block's largest weight on one tp rank."""
    m, tp = cfg.model, cfg.parallel.tp
    return max(m.dim * m.ffn_dim // tp, m.dim * m.n_heads * m.head_dim // tp)


def _state(cfg: Config, counts: dict[str, int], backend: str) -> _State:
    from meshlm.parallel.ddp import DEFAULT_BUCKET_BYTES
    from meshlm.parallel.zero import stage2_bucket_bytes

    m, t, p = cfg.model, cfg.train, cfg.parallel
    n = sum(counts.values())
    d = p.dp * p.cp
    bf16 = t.dtype == "bfloat16" and p.zero > 0  # bf16 parameters with fp32 masters (DDP: autocast)
    item = 2 if bf16 else 4
    # gloo across hosts: the reduce-scatter is meshlm's P2P ring (comm/gloo_rings.py); the engines
    # reduce in place (into their own chunk), so it receives into fp32 scratch: one chunk of 1/d of
    # the input at d = 2, two beyond. NCCL's and shared memory's need none. Bytes per element:
    copies = 4 * min(2, d - 1) / d if backend == "gloo" and d > 1 else 0

    # AdamW's two temporaries are the size of the largest segment it updates: a whole tensor, or
    # the part of one inside this rank's slice of its bucket (unit) when the tensor fills more than
    # a slice; a smaller tensor may lie whole in one rank's slice.
    vocab_table = _vocab_local(cfg) * m.dim if counts["embedding"] or counts["head"] else 0
    block_largest = _block_largest(cfg) if counts["layers"] else 0
    largest = max(vocab_table, block_largest)
    head = counts["head"] or (counts["embedding"] if m.tie_embeddings and p.pp == 1 else 0)
    embedding_grad = counts["embedding"]
    if p.zero == 0:  # at one rank autograd's own .grad tensors, made parameter by parameter (ddp.py)
        return _State(4 * n, 4 * n, 8 * n, 0, weight_grad=4 * head, embedding_grad=4 * embedding_grad,
                      step=2 * 4 * largest, grads_early=d > 1)
    master = 4 * n / d if bf16 else 0
    fp32_grads = 4 * n / d if bf16 else 0  # SegmentAdamW casts each bf16 gradient slice to fp32
    if p.zero in (1, 2):
        bucket = min(DEFAULT_BUCKET_BYTES // item, n)
        if p.zero == 2:
            bucket = min(stage2_bucket_bytes(item * n) // item, n)
        shard_step = fp32_grads + 2 * 4 * min(largest, max(bucket, largest) / d)
        # A bucket never splits a parameter: the first one reduced holds at least the head, the last
        # one the embedding, however small the nominal size (for `1b`, 262M elements each).
        first, last = max(bucket, head), max(bucket, counts["embedding"])
        if p.zero == 1:
            wide = 4 * last if bf16 else 0  # the last bucket's fp32 copy for the reduction
            return _State(item * n, item * n, 8 * n / d, master, weight_grad=item * head, param_item=item,
                          embedding_grad=item * embedding_grad, reduction=wide + copies * last, step=shard_step)
        # Stage 2's smaller buckets (parallel/zero.py): the one being filled, and the one being
        # reduced with the ring's scratch; the gradient shard exists from the first reduction on.
        # Each backward ends by reducing its last bucket and waiting for it.
        return _State(item * n, item * n / d, 8 * n / d, master, staging=4 * bucket,
                      in_flight=(4 + copies) * first, weight_grad=item * head, embedding_grad=item * embedding_grad,
                      reduction=(4 + copies) * last, step=shard_step, grads_early=False, finishes_in_backward=True)
    unit = layer_parameters(m, p.tp)
    embedding = counts["embedding"] if not m.tie_embeddings else 0  # freed after forward (fsdp.py)
    root = counts["embedding"] + counts["head"] + counts["norm"]
    largest = max(min(vocab_table, root / d), min(block_largest, unit / d))  # each unit sharded alone
    return _State(4 * n / d, 4 * n / d, 8 * n / d, 0,
                  gathered_forward=item * (root + unit), gathered_after_forward=item * root,
                  gathered_loss=item * (root - embedding),
                  # the head's gradient waits in the root unit until the embedding's arrives, last
                  gathered_backward=item * (root - embedding + 2 * unit) + item * head,
                  weight_grad=item * head, embedding_grad=item * embedding_grad,
                  # a unit completes: its gradients flattened into fp32 staging while both gathered
                  # units stay (the ring's scratch comes after the gradients are dropped)
                  reduction=item * (root - embedding + 2 * unit + head) + 4 * unit + max(item, copies) * unit,
                  step=2 * 4 * largest, grads_early=False, reduces_in_backward=True, finishes_in_backward=True)


def _deferred_weights(cfg: Config, stage: int) -> int:
    """Elements of the linear weights whose gradients pipeline stage `stage` defers."""
    m, p = cfg.model, cfg.parallel
    weights = len(_stage_ranges(cfg)[stage]) * (layer_parameters(m, p.tp) - 2 * m.dim)
    return weights + (_vocab_local(cfg) * m.dim if stage == p.pp * p.pp_virtual - 1 else 0)


def _deferred_wgrad_bytes(cfg: Config, stage: int) -> int:
    """Pipeline stages after the first defer their linears' weight gradients in each chunk's last
    backward (parallel/pipeline/deferred_wgrad.py): every linear's output gradient (and, under full
    recompute, every rebuilt block) stays alive until the flush."""
    m, p = cfg.model, cfg.parallel
    if p.pp == 1 or stage == 0 or not p.pp_defer_wgrad or p.zero > 1:
        return 0
    batch, seq = _tokens(cfg)
    tokens, item = batch * seq, _itemsize(cfg)
    layers = len(_stage_ranges(cfg)[stage])
    outputs = (m.n_heads // p.tp + 2 * max(1, m.n_kv_heads // p.tp)) * m.head_dim + 2 * m.dim + 2 * m.ffn_dim // p.tp
    out = layers * tokens * outputs * item
    if cfg.train.recompute == "full":
        out += max(0, layers - 1) * _block_saved(cfg)[1]
    if stage == p.pp * p.pp_virtual - 1:
        out += tokens * _vocab_local(cfg) * _itemsize(cfg)  # the logits' gradient, kept for the head's
    return out


# --------------------------------------------------------------------------- the walk


def rank_points(cfg: Config, pp_rank: int, backend: str = "nccl") -> list[tuple[int, RankMemory]]:
    """Every point of pipeline rank `pp_rank`'s step where memory can peak, in the order the step
    reaches them, each with its whole breakdown (`phase` names it) and the index of the compute
    instruction it lies in (`_program`; the reduction and optimizer step after it count on). The
    peak is the largest; tests/test_memory_phases.py measures every one."""
    m, p = cfg.model, cfg.parallel
    counts = rank_parameters(cfg, pp_rank)
    s = _state(cfg, counts, backend)
    batch, seq = _tokens(cfg)
    tokens = batch * seq
    last_stage = p.pp * p.pp_virtual - 1
    fixed = 2 * m.max_seq_len * m.head_dim * 4  # the RoPE cos/sin tables
    block_saved, rebuilt = _block_saved(cfg)
    sp_gathered = tokens * m.dim * _itemsize(cfg) if p.sp else 0  # a linear's all-gathered input (SP)
    vocab = tokens * _vocab_local(cfg) * _itemsize(cfg)  # the loss's saved [tokens, vocab/tp]
    points: list[tuple[int, RankMemory]] = []
    at = 0  # the instruction being walked

    def point(phase: str, activations: float, grads: bool, other: float, grad_share: float = 1.0) -> None:
        parts = (s.params, s.grads * grad_share if grads else 0, s.optimizer, s.master, activations, fixed + other)
        points.append((at, RankMemory(f"pp{pp_rank}" if p.pp > 1 else "every rank", p.dp * p.cp * p.tp,
                                      *(int(x) for x in parts), int(sum(parts)), phase)))

    program = _program(cfg, pp_rank)
    saved = {c * p.pp + pp_rank: _chunk_saved(cfg, c * p.pp + pp_rank) for c in range(p.pp_virtual)}
    last_backward = {chunk: i for i, (forward, chunk) in enumerate(program) if not forward}
    live, grads = 0, False
    for i, (forward, chunk) in enumerate(program):
        at, stage = i, chunk * p.pp + pp_rank
        if forward:
            # while the chunk's last block computes: its gathered unit (FSDP), and under full
            # recompute (no graph kept) the MLP's live tensors: residual, normalised input, gate,
            # up and silu(gate)
            blocks = len(_stage_ranges(cfg)[stage]) * block_saved
            unsaved = tokens * (2 * m.dim + 3 * m.ffn_dim // p.tp) * _itemsize(cfg) if cfg.train.recompute == "full" else 0
            point("forward", live + blocks, grads, s.gathered_forward + unsaved + sp_gathered)
            live += saved[stage]
            # the last stage's head computes on its all-gathered input (SP)
            point("forward", live, grads, s.gathered_after_forward + (sp_gathered if stage == last_stage else 0))
            if stage == last_stage:
                point("loss", live, grads, s.gathered_loss + _loss_transient_bytes(cfg, tokens, backward=False))
            continue
        incoming = tokens * m.dim * 4  # the gradient arriving at the stage's (or the head's) output
        if stage == last_stage:
            # the loss's backward writes the logits' gradient over what it saved, chunk by chunk
            point("loss backward", live, grads, s.gathered_loss + _loss_transient_bytes(cfg, tokens, backward=True))
            # the head's backward: its weight and input gradients beside the logits' gradient; the
            # engine's gradient storage (or ZeRO-2's staging) is made only when the head's weight
            # gradient is handed over, after this
            point("head backward", live, grads, s.gathered_loss + s.weight_grad + incoming + sp_gathered)
            live -= vocab
            # its weight gradient handed to the engine, the logits' gradient gone: DDP and ZeRO-1
            # make the step's gradient buffer here, ZeRO-2 stages the head's bucket and reduces it
            point("head backward", live, grads or s.grads_early, s.gathered_loss + s.weight_grad + incoming + s.in_flight)
        deferred = _deferred_wgrad_bytes(cfg, stage) if last_backward[chunk] == i else 0
        # inside a block's backward: the MLP's gate and up gradients beside the incoming one
        transient = incoming + tokens * 2 * m.ffn_dim // p.tp * _itemsize(cfg) + sp_gathered
        point("block backward", live, grads or s.grads_early,
              s.gathered_backward + s.staging + s.in_flight + rebuilt + transient + deferred)
        during = s.gathered_backward + s.staging + s.in_flight + rebuilt + transient + deferred
        if not grads and p.zero == 2:  # the shard, made when the head's bucket is reduced: after the top block
            point("block backward", live - block_saved, True, during)
        # its first block: one block's activations left, and (where autograd makes the gradients
        # one by one, at one rank) those of every parameter but the block's and the embedding's
        rest = live - saved[stage] + (vocab if stage == last_stage else 0)
        n = sum(counts.values())
        point("block backward", rest + block_saved, True, during,
              1 if grads or s.grads_early or p.zero > 0 else (n - counts["embedding"] - layer_parameters(m, p.tp)) / n)
        if s.reduces_in_backward:  # the chunk's last block is done; the rest still hold activations
            point("gradient reduction", live - block_saved, grads, s.reduction)
        grads = True
        live -= saved[stage] - (vocab if stage == last_stage else 0)
        if deferred:  # the flush computes every deferred linear's weight gradient at once
            point("weight gradients", live, True, deferred + s.param_item * _deferred_weights(cfg, stage))
        if stage == 0:  # the embedding's dense weight gradient, beside what other micro-batches keep
            point("embedding backward", live, True, s.gathered_loss + s.embedding_grad)
        if s.finishes_in_backward and not s.reduces_in_backward:
            point("gradient reduction", live, True, s.reduction)
    # what finish_backward reduces (zero 0/1); zero 2/3 have waited for theirs inside each backward
    at = len(program)
    point("gradient reduction", 0, True, 0 if s.finishes_in_backward else s.reduction)
    at += 1
    point("optimizer step", 0, True, s.step)
    return points


def predict(cfg: Config, backend: str = "nccl") -> MemoryReport:
    """Every distinct rank role's predicted peak and its breakdown, for `cfg` (resolved, any layout).
    backend: the collectives' library ("nccl" on GPUs; on CPU "shm" with every rank on one host,
    else "gloo")."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    roles = [max((r for _, r in rank_points(cfg, pp_rank, backend)), key=lambda r: r.peak_bytes)
             for pp_rank in range(cfg.parallel.pp)]
    return MemoryReport(max(r.peak_bytes for r in roles), roles)
