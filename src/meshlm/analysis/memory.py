"""The per-rank memory model: bytes of parameters, gradients, optimizer state, fp32 masters,
activations and transient buffers for any config and layout, without starting a rank.
Reduces: guessing why a run does not fit; each term is a formula over the config (nothing fitted).
Costs: nothing at run time; its accuracy is what `tests/test_memory.py` measures against the
trainer's per-rank `mem_peak_bytes` (CPU: live tensor bytes; GPU: the CUDA allocator's peak), and
`tests/test_memory_phases.py` window by window inside the step. The terms are in memory_terms.py and memory_state.py.

How the peak is found. A rank's step is its program: the forwards and backwards of its
micro-batches in the order the engine runs them (for a pipeline, the schedule's own instruction
list; without one, forward/backward pairs), then the gradient reduction and the optimizer step.
`predict` walks that program keeping the live bytes: each forward adds the activations its chunk
saves, each backward frees them. At every point where memory can peak it records the whole
breakdown: while a forward's last block computes and when it ends; at the loss and its backward
(the last stage: the fp32 chunks the loss upcasts); at the first gradients of a backward (the
head's weight gradient, a freshly allocated gradient buffer, ZeRO-2's staging bucket, FSDP's
gathered units) and at its last block; at the embedding's gradient, a pipeline's deferred
weight-gradient flush, the gradient reduction, inside the optimizer step. The largest point is
the peak, reported with its breakdown and its name (`phase`); `rank_points` gives them all.
See docs/memory.md for each term's derivation.

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

from meshlm.analysis.memory_schedule import boundary_held_bytes, compute_program
from meshlm.analysis.memory_schedule import micro_batches_in_flight  # noqa: F401 (API)
from meshlm.analysis.memory_state import engine_state
from meshlm.analysis.memory_terms import (activation_itemsize, autocast, bf16_weights, block_saved_bytes,
                                          block_saved_weight_copy_bytes, block_weight_copy_bytes, boundary_bytes,
                                          chunk_saved_bytes, deferred_wgrad_bytes,
                                          head_saved_bytes, largest_block_weight, largest_deferred_weight,
                                          last_stage, layer_parameters,
                                          loss_transient_bytes, microbatch_tokens, rank_parameters,
                                          rope_table_bytes, stage_ranges, vocab_local)
from meshlm.analysis.memory_terms import stage_layers  # noqa: F401 (API)
from meshlm.config import Config

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


# --------------------------------------------------------------------------- the walk


def rank_points(cfg: Config, pp_rank: int, backend: str = "nccl") -> list[tuple[int, RankMemory]]:
    """Every point of pipeline rank `pp_rank`'s step where memory can peak, in the order the step
    reaches them, each with its whole breakdown (`phase` names it) and the index of the compute
    instruction it lies in (`compute_program`; the reduction and optimizer step after it count
    on). The peak is the largest; tests/test_memory_phases.py measures every one."""
    m, p = cfg.model, cfg.parallel
    counts = rank_parameters(cfg, pp_rank)
    s = engine_state(cfg, counts, backend, pp_rank)
    batch, seq = microbatch_tokens(cfg)
    tokens = batch * seq
    last = last_stage(cfg)
    fixed = rope_table_bytes(cfg)
    block_saved, rebuilt = block_saved_bytes(cfg)
    # a linear's all-gathered input (SP): under autocast the norm's fp32 output, gathered in fp32
    sp_gathered = tokens * m.dim * (4 if autocast(cfg) else activation_itemsize(cfg)) if p.sp else 0
    vocab = tokens * vocab_local(cfg) * activation_itemsize(cfg)  # the loss's saved [tokens, vocab/tp]
    head = head_saved_bytes(cfg)  # the last stage's saved beyond its blocks (the logits among them)
    points: list[tuple[int, RankMemory]] = []
    at = 0  # the instruction being walked

    boundary = 0  # stage-boundary tensors the pipeline engine holds beside the compute (boundary_held_bytes)

    def point(phase: str, activations: float, grads: bool, other: float, grad_share: float | None = None) -> None:
        share = made if grad_share is None else grad_share
        if fsdp:  # the shards made so far (or the share given)
            share, grads = shard_share() if grad_share is None else grad_share, True
        parts = (s.params, s.grads * share if grads else 0, s.optimizer, s.master, activations,
                 fixed + other + boundary)
        points.append((at, RankMemory(f"pp{pp_rank}" if p.pp > 1 else "every rank", p.dp * p.cp * p.tp,
                                      *(int(x) for x in parts), int(sum(parts)), phase)))

    program = compute_program(cfg, pp_rank)
    stages = [c * p.pp + pp_rank for c in range(p.pp_virtual)]
    layers = {stage: len(stage_ranges(cfg)[stage]) for stage in stages}
    saved = {stage: chunk_saved_bytes(cfg, stage) for stage in stages}
    blocks = {stage: layers[stage] * block_saved for stage in stages}  # the blocks' part of saved
    n = sum(counts.values())
    # FSDP makes a unit's gradient shard when the unit's reduction is waited for: at the next
    # unit's launch, or at the backward's end. A backward reduces its own chunk's units (those its
    # module call ran), in backward order (the ReadyTracker's): the chunk's blocks from the top,
    # then the root (embedding, final norm, head) where the chunk uses it, whose gradients wait
    # for their turn even where the head's come first (the last stage); units whose shard
    # exists: ("root",) and (stage, block index)
    fsdp = s.reduces_in_backward
    # An interleaved rank's chunk without the root (neither the first nor the last stage) gathers
    # none of it: what an earlier forward of the root's chunk kept (its final norm and head) is
    # there until the next backward's end, nothing else of it; and its backward has no head's
    # gradient waiting
    root_held = False
    unit_size = layer_parameters(m, p.tp)
    shards: set[tuple] = set()

    def shard_share(*extra: tuple) -> float:
        keys = shards | set(extra)
        return sum(counts["embedding"] + counts["head"] + counts["norm"] if key == ("root",) else unit_size
                   for key in keys) / n

    def chunk_share(stage: int) -> float:  # of this rank's parameters
        chunk = layers[stage] * layer_parameters(m, p.tp) + (counts["embedding"] if stage == 0 else 0)
        return (chunk + (counts["head"] + counts["norm"] if stage == last else 0)) / n

    # At one rank (DDP) autograd makes the gradients one by one: they exist for the chunks that have
    # run a backward, and by a chunk's first one's first block, all of its but that block's and the
    # embedding's. Elsewhere the engine's gradient storage is whole.
    made, made_chunks = (0.0 if s.grads_one_by_one else 1.0), set()
    last_backward = {chunk: i for i, (forward, chunk) in enumerate(program) if not forward}
    last_forward = {chunk: i for i, (forward, chunk) in enumerate(program) if forward}
    last_index = max(last_backward.values())  # the rank's syncing backward
    held = boundary_held_bytes(cfg, pp_rank, backend)
    live, grads = 0, False
    for i, (forward, chunk) in enumerate(program):
        at, stage = i, chunk * p.pp + pp_rank
        boundary = held[i][0]
        uses_root = stage in (0, last)
        root_off = 0 if uses_root else s.root_gathered - (s.root_kept if root_held else 0)
        if forward:
            # while the chunk's last block computes: its gathered unit (FSDP), and what the block
            # holds unsaved: under full recompute (no graph kept) the MLP's live tensors (residual,
            # normalised input, gate, up and silu(gate)); else, at its last add, the down
            # projection's output beside the block's output being made and, with bf16 weights
            # (whose norms save an fp32 upcast instead), the block's input and mid-block residual
            if cfg.train.recompute == "full":
                # the larger of the MLP's and the attention's: its normalised input, q, k and v,
                # and RoPE's three q-sized temporaries (q·cos, the rotated half, its product by sin)
                q_width, kv_width = m.n_heads // p.tp * m.head_dim, max(1, m.n_kv_heads // p.tp) * m.head_dim
                unsaved = tokens * max(2 * m.dim + 3 * m.ffn_dim // p.tp,
                                       m.dim + 4 * q_width + 2 * kv_width) * activation_itemsize(cfg)
            else:
                unsaved = tokens * m.dim * activation_itemsize(cfg) + boundary_bytes(cfg) * (1 + 2 * bf16_weights(cfg))
            # autocast caches its bf16 weight copies until its region (the forward) exits: under
            # full recompute, where no graph keeps them, those of every block of the chunk; under
            # SP those the column linears do not save (and, once it has run, the head's)
            kept = 0 if cfg.train.recompute == "full" else block_saved_weight_copy_bytes(cfg)
            cached = layers[stage] * (block_weight_copy_bytes(cfg) - kept)
            if last_forward[chunk] == i and deferred_wgrad_bytes(cfg, stage):
                # the forward of a micro-batch whose backward defers: its linears cast a detached
                # weight themselves (deferred_wgrad.py), which autocast does not cache; what they
                # save is in `saved`, and under full recompute they are transient: one linear's
                # weight copy and its input's bf16 copy at a time
                cached = 0
                if autocast(cfg) and cfg.train.recompute == "full":
                    cached = 2 * largest_block_weight(cfg) + 2 * tokens * m.dim
            head_cached = 2 * vocab_local(cfg) * m.dim if autocast(cfg) and p.sp and stage == last else 0
            # FSDP gathers the root where the call first enters a module holding it: the first
            # stage's forward starts with it (the embedding); a later last stage's blocks run
            # before its final norm does, without it unless an earlier forward kept it
            late_root = fsdp and stage == last and stage > 0
            if s.root_gather and uses_root and not late_root:
                point("forward", live, grads, s.root_gather)
            point("forward", live + blocks[stage], grads, s.gathered_forward - root_off + unsaved + sp_gathered
                  + cached - (s.root_gathered if late_root and not root_held else 0))
            if late_root and not root_held:
                point("forward", live + blocks[stage], grads, s.root_gather + sp_gathered)
            live += saved[stage]
            root_held = root_held or (fsdp and uses_root)
            # the last stage's head computes on its all-gathered input (SP)
            point("forward", live, grads, s.gathered_after_forward - root_off + (sp_gathered if stage == last else 0)
                  + cached + head_cached)
            if stage == last:
                point("loss", live, grads, s.gathered_loss + loss_transient_bytes(cfg, tokens, backward=False))
            continue
        incoming = tokens * m.dim * 4  # the gradient arriving at the stage's (or the head's) output
        # a deferring backward (its chunk's last) keeps each linear's output gradient for the flush
        defers = last_backward[chunk] == i
        deferred = deferred_wgrad_bytes(cfg, stage) if defers else 0
        if stage == last:
            # a deferring head makes no weight gradient here (the flush does); it keeps its input
            # and the logits' gradient instead
            head_wgrad = 0 if deferred else s.weight_grad
            owed_head = deferred_wgrad_bytes(cfg, stage, layers=0) if deferred else 0
            # the loss's backward writes the logits' gradient over what it saved, chunk by chunk
            point("loss backward", live, grads, s.gathered_loss + loss_transient_bytes(cfg, tokens, backward=True))
            # the head's backward: its weight and input gradients beside the logits' gradient; the
            # engine's gradient storage (or ZeRO-2's staging) is made only when the head's weight
            # gradient is handed over, after this
            # (under autocast the weight's gradient is made in bf16; its fp32 cast, for the fp32
            # weight, comes once the logits' gradient is gone)
            made_wgrad = head_wgrad * activation_itemsize(cfg) // s.param_item if autocast(cfg) else head_wgrad
            if autocast(cfg) and p.sp:  # SP's column linear casts it to fp32 inside its backward, beside it
                made_wgrad += head_wgrad
            # (FSDP: the root's output gradient has prefetched the top block)
            prefetched = s.prefetched if layers[stage] else 0
            point("head backward", live, grads, s.gathered_loss + prefetched + made_wgrad + incoming + sp_gathered)
            live -= vocab
            if m.vocab_size % p.tp and head_wgrad:
                # a tp rank with padding rows computes on its real rows, a slice of its weight:
                # slice's backward copies their gradient into a new padded one, beside it
                point("head backward", live, grads, s.gathered_loss + prefetched + 2 * head_wgrad + incoming)
            # its weight gradient handed to the engine, the logits' gradient gone: DDP and ZeRO-1
            # make the step's gradient buffer here, ZeRO-2 stages the head's bucket and reduces it
            point("head backward", live, grads or s.grads_early,
                  s.gathered_loss + prefetched + head_wgrad + incoming + s.in_flight + owed_head)
            # then the final norm's backward: of what the last stage saves beyond its blocks only
            # the norm's fp32 input (the upcast, or the fp32 residual itself) and statistic are
            # left, beside its fp32 temporaries at the statistic's backward (the normalising
            # product's input gradient, kept to the last add, the mean's expanded gradient, x, 2x
            # and their product: five of [tokens, h]; the head's input gradient is consumed)
            norm_tokens = tokens // p.tp if p.sp else tokens
            point("head backward", live - (head - vocab) + norm_tokens * (4 * m.dim + 4), grads or s.grads_early,
                  s.gathered_loss + prefetched + s.in_flight + owed_head + 5 * norm_tokens * m.dim * 4)
            live -= head - vocab  # the rest goes with the final norm's backward
        # inside a block's backward: the MLP's gate and up gradients beside the incoming one, or a
        # norm's backward, whose three fp32 temporaries (the input squared, its scaled gradient and
        # their product; fp32 in any dtype) outweigh them where the MLP is narrow and in bf16
        norm_tokens = tokens // p.tp if p.sp else tokens
        norm_temporaries = 3 * norm_tokens * m.dim * 4
        # ... or, earlier, w2's weight gradient as its linear makes it (under autocast in bf16 and
        # cast for the fp32 weight, whose bf16 copy is gone by then), before it is accumulated:
        # the gate and up gradients do not exist yet (a deferring backward makes none)
        weight_grad = 0 if deferred else s.param_item * m.dim * (m.ffn_dim // p.tp)
        transient = incoming + sp_gathered + max(tokens * 2 * m.ffn_dim // p.tp * activation_itemsize(cfg),
                                                 norm_temporaries, weight_grad)
        if fsdp and not uses_root:  # (see root_held)
            root_off = (0 if root_held else s.root_kept) + s.weight_grad
        during = s.gathered_backward - root_off + s.staging + s.in_flight + s.tied_waiting + rebuilt + transient
        shard_inside = bool(s.shard_after) and not grads  # ZeRO-2's shard made inside the top block
        if s.shard_after == 0 and not grads:
            # ZeRO-2's shard made before the top block, at the final norm's (or the stage's first
            # bucket's) gradient: the head's bucket, reduced, is added into it; after it the bucket
            # in flight is the next one
            point("block backward", live, True, s.gathered_backward + s.in_flight + s.tied_waiting + incoming
                  + sp_gathered)
            during += s.shard_in_flight - s.in_flight
        # the top block: it owes the head's (its own output gradients are the transients above);
        # FSDP has prefetched the block below it, if the chunk has one
        point("block backward", live, grads or s.grads_early or s.shard_after == 0,
              during + (deferred_wgrad_bytes(cfg, stage, layers=0) if defers else 0)
              + (s.prefetched if layers[stage] > 1 else 0))
        if shard_inside:
            # ZeRO-2's shard made inside the top block's backward (at one data-parallel rank the
            # whole gradient): the MLP's saved tensors whose backward precedes those weight
            # gradients are gone by then: w2's input (the product) once w2's is made; up and
            # silu(gate), saved by the product's backward, which w3's (up's) needs; gate, saved by
            # silu's backward, which w1's needs (the gradients they leave are the transients)
            mlp = tokens * m.ffn_dim // p.tp * activation_itemsize(cfg)
            # (the first bucket's reduction waited for: the ring's scratch, on gloo, gone)
            point("block backward", live + during - mlp * min(4, 2 * s.shard_after - 1) - s.in_flight_scratch, True, 0)
        elif s.grads_after_top_block and not grads:
            point("block backward", live - block_saved, True, during)
        # its first block: one block's activations left, the other blocks' gradients made
        rest = live - saved[stage] + (head if stage == last else 0)
        above = deferred_wgrad_bytes(cfg, stage, layers=layers[stage] - 1) if defers else 0
        new_chunk = s.grads_one_by_one and chunk not in made_chunks  # its gradients appear in this backward
        first_share = made
        if new_chunk:
            first_share += chunk_share(stage) - (counts["embedding"] * (stage == 0) + layer_parameters(m, p.tp)) / n
        if fsdp:  # the blocks above the first have launched; the last of them not yet waited for
            first_share = shard_share(*((stage, j) for j in range(2, layers[stage])))
        # (a chunk of one block whose shard is made inside it: the point above has it)
        point("block backward", rest + block_saved, not (shard_inside and layers[stage] == 1), during + above,
              first_share)
        if new_chunk and not deferred:
            # the MLP's backward precedes the attention's: its weights' .grads are made while the
            # attention's saved or rebuilt tensors live; the MLP's own (gate, up, silu(gate),
            # product and, rebuilt, its bf16 weight copies: w2's only under SP) are gone. Its last
            # moments: the last weight's gradient made in bf16 and cast to the fp32 .grad
            # (autocast), then the ffn norm's backward (its fp32 temporaries), beside the incoming gradient
            weight = m.dim * (m.ffn_dim // p.tp)
            mlp = 4 * tokens * (m.ffn_dim // p.tp) * activation_itemsize(cfg)
            gone = mlp + (2 * weight * (1 if p.sp else 3) if autocast(cfg) else 0) if rebuilt else 0
            point("block backward", rest + block_saved - (0 if rebuilt else mlp), True,
                  during - transient + incoming + sp_gathered + max(norm_temporaries, 2 * weight * autocast(cfg))
                  + above - gone, first_share + 3 * weight / n)
        if fsdp:  # the top block completes (its unit launched, none waited for yet); the rest still hold activations
            # (the block below it prefetched, if the chunk has one)
            point("gradient reduction", live - block_saved, True,
                  s.reduction - root_off - (0 if layers[stage] > 1 else s.prefetched))
        grads = True
        if new_chunk:
            made_chunks.add(chunk)
            made += chunk_share(stage)
        live -= saved[stage] - (head if stage == last else 0)
        if fsdp:
            if stage == last and stage > 0:
                # the root (head, final norm), complete since the head's backward, launches at once:
                # the last block's shard made, the root's fp32 staging beside its gathered
                # parameters and the head's gradient
                point("gradient reduction", live, True, s.root_launch,
                      shard_share(*((stage, j) for j in range(layers[stage]))))
        if deferred:  # the flush (after the next sends and receives): what is owed, one weight's gradient at a time
            boundary = held[i][1]
            # (under autocast each is made in bf16, then cast to the fp32 weight's dtype)
            item = s.param_item + (activation_itemsize(cfg) if autocast(cfg) else 0)
            point("weight gradients", live, True, deferred + item * largest_deferred_weight(cfg, stage))
            boundary = held[i][0]
        if stage == 0:  # the embedding's dense weight gradient, beside what other micro-batches keep
            # at one rank the first backward's embedding gradient becomes its .grad (not yet in `made`
            # above: made counts the whole chunk as its backward ends)
            adopted = made - counts["embedding"] / n if new_chunk else None
            if fsdp:  # the root's launch waits for the last block's reduction: its shard made
                adopted = shard_share(*((stage, j) for j in range(layers[stage])))
            point("embedding backward", live, True, s.gathered_loss + s.embedding_grad, adopted)
        if s.finishes_in_backward and not s.reduces_in_backward:
            point("gradient reduction", live, True, s.reduction)
        if s.widened and i == last_index:
            # ZeRO-1 in bf16: the syncing backward (or its flush) launches the last bucket, whose
            # fp32 copy lives from there to finish_backward (ddp.py `_launch`)
            # (in a flush: after the next sends and receives are posted, from the hook of the
            # bucket's last weight gradient, alive meanwhile: the store holds the bottom block's
            # attention projections last, the q projection the largest of them)
            flushing = s.param_item * m.dim * (m.n_heads // p.tp) * m.head_dim if deferred else 0
            boundary = held[i][1] if deferred else boundary
            point("weight gradients" if deferred else "gradient reduction", live, True, s.widened + flushing)
            boundary = held[i][0]
        if fsdp:  # the backward's end launches the chunk's units not launched yet and waits for them:
            # the chunk's shards exist (not the other chunks' of an interleaved rank: their units
            # are reduced by their own backwards). The root's, reduced last, is made beside its
            # fp32 staging (the first time)
            if uses_root and ("root",) not in shards:
                point("gradient reduction", live, True, s.root_staging,
                      shard_share(("root",), *((stage, j) for j in range(layers[stage]))))
            shards |= {(stage, j) for j in range(layers[stage])} | ({("root",)} if uses_root else set())
            root_held = False  # the backward's end frees every unit
    # what finish_backward reduces (zero 0/1); zero 2/3 have waited for theirs inside each backward
    at, boundary = len(program), 0  # reduce_grads has waited for every send
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
