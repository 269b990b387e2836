"""The per-rank memory model: bytes of parameters, gradients, optimizer state, fp32 masters,
activations and transient buffers for any config and layout, without starting a rank.
Reduces: guessing why a run does not fit; each term is a formula over the config (no fitting).
Costs: nothing at run time; its accuracy is what `tests/test_memory.py` measures against the
trainer's per-rank `mem_peak_bytes` (CPU: live tensor bytes; GPU: the CUDA allocator's peak).

Where a step's peak sits. The trainer's step is forward and backward of each micro-batch, then the
optimizer. Its highest point is the start of the last micro-batch's backward, on the rank that
computes the loss: every layer's saved activations are still held, the loss's backward
materialises [b, s, vocab/tp] buffers (the saved log-softmax, its gradient, the logits' gradient),
and the model state is all there. The other candidate is the optimizer step (state plus AdamW's
per-tensor temporaries); the model takes the larger of the two.

The model state per engine (N = this rank's parameters, d = dp x cp, p = 2 in bf16 else 4):

    DDP (zero 0)  params 4N, grads 4N (bf16 autocast: + 2N of bf16 weight copies held for backward)
    ZeRO-1        params pN, grads pN (full buffer), masters 4N/d in bf16, AdamW 8N/d
    ZeRO-2        params pN, grads pN/d + one bucket of staging, masters 4N/d in bf16, AdamW 8N/d
    ZeRO-3/FSDP   fp32 shard 4N/d, grad shard 4N/d, AdamW 8N/d, plus gathered units (param dtype):
                  the root (embeddings, head) from forward to backward and two blocks at a time
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshlm.config import Config
from meshlm.parallel.tensor import activation_bytes_per_layer

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
    other_bytes: int  # loss buffers, gathered FSDP units, bucket staging, bf16 weight copies
    peak_bytes: int

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
    kv_local = max(1, m.n_kv_heads // tp)
    attention = m.dim * (m.n_heads // tp) * d * 2 + 2 * m.dim * kv_local * d
    return attention + 3 * m.dim * (m.ffn_dim // tp) + 2 * m.dim


def stage_layers(cfg: Config) -> list[list[int]]:
    """Layer indices of each pipeline rank (all its virtual stages)."""
    from meshlm.mesh import parse_pp_layers
    from meshlm.parallel.pipeline.stage import split_layers

    p = cfg.parallel
    counts = parse_pp_layers(p.pp_layers) if p.pp_layers else None
    ranges = split_layers(cfg.model.n_layers, p.pp * p.pp_virtual, counts)
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


def micro_batches_in_flight(cfg: Config, pp_rank: int) -> int:
    """The most micro-batches (times chunks) whose activations rank `pp_rank` holds at once, read
    from the schedule's own instruction list (the one the engine runs)."""
    p = cfg.parallel
    if p.pp == 1:
        return 1
    from meshlm.parallel.pipeline.runner import microbatch_plan
    from meshlm.parallel.pipeline.schedules import build_schedule, peak_in_flight

    m, _ = microbatch_plan(cfg)
    return peak_in_flight(build_schedule(p.pp_schedule, p.pp, m, p.pp_virtual)[pp_rank])


def activation_bytes(cfg: Config, pp_rank: int) -> tuple[int, int]:
    """(saved activations held at the peak, transient bytes of the loss's backward) on one rank."""
    from meshlm.parallel.pipeline.runner import microbatch_plan

    m, t, p = cfg.model, cfg.train, cfg.parallel
    batch = microbatch_plan(cfg)[1] if p.pp > 1 else t.micro_batch_size
    seq = t.seq_len // p.cp
    item = 2 if t.dtype == "bfloat16" else 4
    layers = len(stage_layers(cfg)[pp_rank]) // max(1, p.pp_virtual)  # per chunk
    tokens = batch * seq
    sharded_tokens = tokens // p.tp if p.sp else tokens
    if t.recompute == "full":  # only each block's input is kept; one block is rebuilt at a time
        per_chunk = layers * sharded_tokens * m.dim * item
        rebuilt = activation_bytes_per_layer(m, batch, seq, p.tp, p.sp, item)
    else:
        per_chunk = layers * activation_bytes_per_layer(m, batch, seq, p.tp, p.sp, item)
        rebuilt = 0
        if t.recompute == "selective" and p.cp == 1:  # the core's output and log-sum-exp are dropped
            per_chunk -= layers * tokens * ((m.n_heads // p.tp) * m.head_dim + m.n_heads // p.tp) * item
    in_flight = micro_batches_in_flight(cfg, pp_rank)
    saved = in_flight * per_chunk + rebuilt
    last = pp_rank == p.pp - 1
    first = pp_rank == 0
    # Outside the blocks: the embedding's output on the first stage; the final norm's input,
    # normalised value and the head's input on the last (h each per token), and the loss.
    if first:
        saved += in_flight * sharded_tokens * m.dim * item
    if last:
        saved += in_flight * 4 * sharded_tokens * m.dim * 4
    vocab = _padded(m.vocab_size, p.tp) // p.tp
    loss = 3 * tokens * vocab * 4 if last else 0  # saved log-softmax, its gradient, the logits' gradient
    return saved, loss


# --------------------------------------------------------------------------- the model state


def predict(cfg: Config) -> MemoryReport:
    """Every distinct rank role's predicted bytes for `cfg` (resolved, any layout)."""
    from meshlm.parallel.ddp import DEFAULT_BUCKET_BYTES

    t, p = cfg.train, cfg.parallel
    d = p.dp * p.cp
    bf16 = t.dtype == "bfloat16"
    item = 2 if bf16 and p.zero > 0 else 4
    roles = []
    for pp_rank in range(p.pp):
        counts = rank_parameters(cfg, pp_rank)
        n = sum(counts.values())
        master = 4 * n / d if bf16 and p.zero > 0 else 0
        optimizer = 8 * n if p.zero == 0 else 8 * n / d
        other = 0
        if p.zero == 0:
            params, grads = 4 * n, 4 * n
            if bf16:
                other += 2 * n  # autocast's bf16 copies of the weights, saved for backward
        elif p.zero == 1:
            params, grads = item * n, item * n
        elif p.zero == 2:
            params, grads = item * n, item * n / d
            other += min(DEFAULT_BUCKET_BYTES, item * n)
        else:
            params, grads = 4 * n / d, 4 * n / d
            unit = layer_parameters(cfg.model, p.tp)
            root = counts["embedding"] + counts["head"] + counts["norm"]
            other += item * (root + 2 * unit)
        activations, loss = activation_bytes(cfg, pp_rank)
        other += loss
        peak = params + grads + optimizer + master + activations + other
        roles.append(RankMemory(f"pp{pp_rank}" if p.pp > 1 else "every rank", p.dp * p.cp * p.tp,
                                *(int(x) for x in (params, grads, optimizer, master, activations, other, peak))))
    return MemoryReport(max(r.peak_bytes for r in roles), roles)
