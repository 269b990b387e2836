"""The memory model's model-state terms: one rank's parameters, gradients, optimizer state and
fp32 masters under each engine (DDP, ZeRO-1/2/3), and the engine's transient buffers (gradient
buckets, reduction staging, FSDP's gathered units, AdamW's step temporaries). analysis/memory.py
walks them through a rank's step; the derivations are in docs/memory.md, the measurements in
tests/test_memory*.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshlm.analysis.memory_terms import (bf16_weights, largest_block_weight, layer_parameters, rank_parameters,
                                          stage_layers, vocab_local)
from meshlm.config import Config


@dataclass
class EngineState:
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
    grads_one_by_one: bool = False  # DDP at one rank: autograd's own .grad tensors, parameter by parameter
    grads_after_top_block: bool = False  # ZeRO-2: the shard is made when the head's bucket is reduced,
                                         # after the top block unless `shard_after` says where
    shard_after: int | None = None  # ZeRO-2: the top block's parameters with gradients when the shard
                                    # is made (0: before that block); None: after the top block
    in_flight_scratch: float = 0  # ZeRO-2 on gloo: the ring's scratch within `in_flight`, gone once it is waited
    shard_in_flight: float = 0  # ZeRO-2: the bucket in flight once the first bucket's reduction is done
    prefetched: float = 0  # FSDP: the next unit of backward, gathered while one computes
    root_gather: float = 0  # FSDP: a forward's gather of the root unit (with its bf16 source)
    root_staging: float = 0  # FSDP: the root's fp32 staging, alive while its reduction is waited for
    root_launch: float = 0  # FSDP, a pipeline's last stage: the root's reduction made after the last block's
    root_gathered: float = 0  # FSDP: the whole root unsharded (in `gathered_*`); an interleaved rank's chunk
    root_kept: float = 0  # ... without the root gathers none of it, or what an earlier forward kept
    tied_waiting: float = 0  # a tied table (one stage): the head's gradient, held by autograd until the
                             # embedding's arrives, through every block's backward
    widened: float = 0  # ZeRO-1 in bf16: the last bucket's fp32 copy, made when the syncing backward
                        # launches it (inside that backward), alive to finish_backward


BLOCK_TENSORS = 9  # a block's parameter tensors (block_parameters)


def block_parameters(cfg: Config) -> list[tuple[bool, int]]:
    """A block's parameters on one tp rank in registration order, (decays, elements): attention
    norm, wq, wk, wv, wo, ffn norm, w1, w2, w3 (matrices decay, the norms' gains not)."""
    m, p = cfg.model, cfg.parallel
    hd, kv = m.head_dim, max(1, m.n_kv_heads // p.tp)
    q, f = m.dim * (m.n_heads // p.tp) * hd, m.dim * (m.ffn_dim // p.tp)
    return [(False, m.dim), (True, q), (True, m.dim * kv * hd), (True, m.dim * kv * hd), (True, q),
            (False, m.dim), (True, f), (True, f), (True, f)]  # BLOCK_TENSORS of them


def parameter_layout(cfg: Config, pp_rank: int) -> list[tuple[bool, int]]:
    """(decays, elements) of each parameter pipeline rank `pp_rank` holds on one tp rank, in the
    engines' layout order (reverse registration: the head, the final norm, the blocks from the
    top, each from w3 to the attention norm; the embedding last)."""
    counts = rank_parameters(cfg, pp_rank)
    head = [(True, counts["head"])] if counts["head"] else []
    norm = [(False, counts["norm"])] if counts["norm"] else []
    layers = len(stage_layers(cfg)[pp_rank])
    return head + norm + block_parameters(cfg)[::-1] * layers \
        + ([(True, counts["embedding"])] if counts["embedding"] else [])


def parameter_sizes(cfg: Config, pp_rank: int) -> list[int]:
    """Elements of each of `parameter_layout`'s parameters."""
    return [n for _, n in parameter_layout(cfg, pp_rank)]


def bucket_ends(sizes: list[int], cap: int) -> list[int]:
    """parallel/flat_buffer.py's FlatLayout: the index (in `sizes`) of each bucket's last
    parameter. A bucket closes once it holds `cap` elements or more (so it can reach cap + a
    parameter - 1), and a parameter of `cap` or more has its own."""
    out, current = [], 0
    for i, n in enumerate(sizes):
        if current and (current >= cap or n >= cap):
            out.append(i - 1)
            current = 0
        current += n
    return out + [len(sizes) - 1]


def bucket_sizes(sizes: list[int], cap: int, align: int) -> list[int]:
    """Elements of each FlatLayout bucket (`bucket_ends`), padded to a multiple of `align`."""
    out, lo = [], 0
    for end in bucket_ends(sizes, cap):
        out.append(-(-sum(sizes[lo:end + 1]) // align) * align)
        lo = end + 1
    return out


def held_denominator_elements(units: list[list[tuple[bool, int]]], d: int) -> int:
    """Elements of AdamW's temporaries at their most, over the ranks of a sharded engine whose
    optimizer steps each rank's segments one at a time (SegmentAdamW on CPU: torch's per-tensor
    path). `units`: each flat unit's parameters in order, (decays, elements); each unit is padded
    to a multiple of `d` and rank r updates the r-th slice of each. The optimizer takes the
    decaying segments, then the others; per segment it makes sqrt(v) and the denominator from it,
    and the previous segment's denominator lives until the new one replaces it: a + 2b for a
    segment of b elements after one of a (three ffn weights in a row: 3 of them)."""
    worst = 0
    for rank in range(d):
        segments = []
        for unit in units:
            padded = -(-sum(n for _, n in unit) // d) * d
            lo, hi, start = rank * padded // d, (rank + 1) * padded // d, 0
            for decays, n in unit:
                if min(hi, start + n) > max(lo, start):
                    segments.append((decays, min(hi, start + n) - max(lo, start)))
                start += n
        order = [n for decays, n in segments if decays] + [n for decays, n in segments if not decays]
        worst = max([worst] + [a + 2 * b for a, b in zip([0] + order, order)])
    return worst


@functools.lru_cache(maxsize=1024)
def _bucket_step_elements(layout: tuple[tuple[bool, int], ...], cap: int, d: int) -> int:
    """held_denominator_elements over ZeRO-1/2's buckets (FlatLayout's cut of `layout` at `cap`),
    once per shape: the planner evaluates many layouts of one (it cost a plan a third more)."""
    lo, units = 0, []
    for end in bucket_ends([n for _, n in layout], cap):
        units.append(list(layout[lo:end + 1]))
        lo = end + 1
    return held_denominator_elements(units, d)


def fsdp_units(cfg: Config, counts: dict[str, int]) -> list[list[tuple[bool, int]]]:
    """FullyShardedDataParallel's units on a rank, (decays, elements) per parameter in order: the
    root (the norm and head, the embedding last: fsdp.py's tail; a tied table where it is
    registered, first), then each block (attention norm, wq, wk, wv, wo, ffn norm, w1, w2, w3)."""
    m, p = cfg.model, cfg.parallel
    block = block_parameters(cfg)
    norm = [(False, counts["norm"])] if counts["norm"] else []
    if m.tie_embeddings and counts["embedding"] and not counts["head"]:
        root = [(True, counts["embedding"])] + norm
    else:
        root = norm + ([(True, counts["head"])] if counts["head"] else []) \
            + ([(True, counts["embedding"])] if counts["embedding"] else [])
    layers = counts["layers"] // layer_parameters(m, p.tp) if counts["layers"] else 0
    return ([root] if root else []) + [block] * layers


def engine_state(cfg: Config, counts: dict[str, int], backend: str, pp_rank: int = 0) -> EngineState:
    from meshlm.parallel.ddp import DEFAULT_BUCKET_BYTES
    from meshlm.parallel.zero import stage2_bucket_bytes

    m, p = cfg.model, cfg.parallel
    n = sum(counts.values())
    d = p.dp * p.cp
    bf16 = bf16_weights(cfg)
    item = 2 if bf16 else 4
    # gloo across hosts: the reduce-scatter is meshlm's P2P ring (comm/gloo_rings.py); the engines
    # reduce in place (into their own chunk), so it receives into fp32 scratch: one chunk of 1/d of
    # the input at d = 2, two beyond. NCCL's and shared memory's need none. Bytes per element:
    copies = 4 * min(2, d - 1) / d if backend == "gloo" and d > 1 else 0

    # AdamW's two temporaries are the size of the segment it updates: under DDP a whole tensor;
    # under ZeRO and FSDP the part of one inside this rank's slice of its bucket (unit), a smaller
    # tensor whole (held_denominator_elements)
    vocab_table = vocab_local(cfg) * m.dim if counts["embedding"] or counts["head"] else 0
    block_largest = largest_block_weight(cfg) if counts["layers"] else 0
    head = counts["head"] or (counts["embedding"] if m.tie_embeddings and p.pp == 1 else 0)
    embedding_grad = counts["embedding"]
    if m.tie_embeddings and p.pp == 1 and p.zero in (0, 1, 2):
        # one parameter used twice: autograd holds the head's gradient until the embedding's
        # arrives, then adds the two out of place (three tables at that moment, at any number of
        # ranks; measured, tests/test_memory_phases.py)
        embedding_grad *= 3
    tied = counts["embedding"] if m.tie_embeddings and p.pp == 1 and p.zero in (0, 1, 2) else 0
    if p.zero == 0:  # at one rank autograd's own .grad tensors, made parameter by parameter (ddp.py)
        # torch's per-tensor AdamW makes two temporaries per tensor (sqrt, then the division), and
        # the previous tensor's denominator lives until the next replaces it: a block's three
        # ffn-sized weights are updated in a row (w1, w2, w3), a vocabulary table alone
        ffn_largest = m.ffn_dim // p.tp >= m.n_heads // p.tp * m.head_dim
        in_a_row = 3 if ffn_largest else 2
        return EngineState(4 * n, 4 * n, 8 * n, 0, weight_grad=4 * head, embedding_grad=4 * embedding_grad,
                           step=4 * max(2 * vocab_table, in_a_row * block_largest), grads_early=d > 1,
                           tied_waiting=4 * tied,
                           grads_one_by_one=d == 1)
    master = 4 * n / d if bf16 else 0
    fp32_grads = 4 * n / d if bf16 else 0  # SegmentAdamW casts each bf16 gradient slice to fp32
    if p.zero in (1, 2):
        bucket = min(DEFAULT_BUCKET_BYTES // item, n)
        if p.zero == 2:
            bucket = min(stage2_bucket_bytes(item * n) // item, n)
        # AdamW steps this rank's slice of each bucket segment by segment, the previous
        # segment's denominator alive beside the next one's two temporaries (as FSDP's units)
        cap = max(1, (stage2_bucket_bytes(item * n) if p.zero == 2 else DEFAULT_BUCKET_BYTES) // item)
        shard_step = fp32_grads + 4 * _bucket_step_elements(tuple(parameter_layout(cfg, pp_rank)), cap, d)
        # A bucket never splits a parameter: the first one reduced holds at least the (untied) head,
        # the last one the embedding (a tied table is registered there), however small the nominal
        # size (for `1b`, 262M elements each).
        first, last = max(bucket, counts["head"]), max(bucket, counts["embedding"])
        if p.zero == 1:
            wide = 4 * last if bf16 else 0  # the last bucket's fp32 copy for the reduction
            return EngineState(item * n, item * n, 8 * n / d, master, weight_grad=item * head, param_item=item,
                               embedding_grad=item * embedding_grad, reduction=wide + copies * last, step=shard_step,
                               widened=wide, tied_waiting=item * tied)
        # Stage 2's smaller buckets (parallel/zero.py): the one being filled, and the one being
        # reduced with the ring's scratch; the gradient shard exists from the first reduction on.
        # Each backward ends by reducing its last bucket and waiting for it. The bucket being
        # filled in the blocks' backward is as the layout cuts it (FlatLayout closes a bucket once
        # it reaches the cap, so it can hold the cap plus a parameter less one element: a block
        # and a half of a small model), not the nominal cap.
        sizes, cap = parameter_sizes(cfg, pp_rank), max(1, stage2_bucket_bytes(item * n) // item)
        buckets = bucket_sizes(sizes, cap, d)
        after_first = (4 + copies) * (buckets[1] if len(buckets) > 1 else 0)  # in flight once the first is reduced
        # The shard is made when the first bucket's reduction completes, waited for as the second
        # is launched (zero.py `_launch`), i.e. once the second bucket's last parameter has its
        # gradient: counted in the top block's parameters (layout order: w2, w3, w1, ...) whose
        # gradients exist by then; 0: before the top block (the final norm's); None: after it.
        shard_after = None
        ends, outside = bucket_ends(sizes, cap), bool(counts["head"]) + bool(counts["norm"])
        if len(ends) > 1 and ends[1] - outside + 1 <= BLOCK_TENSORS and counts["layers"]:
            shard_after = max(0, ends[1] - outside + 1)
        if counts["embedding"] and len(buckets) > 1:
            buckets = buckets[:-1]  # the embedding's (last) bucket: the embedding backward's point
        filled = max(buckets[1:] or buckets)  # (the first is the head's, staged at its backward)
        return EngineState(item * n, item * n / d, 8 * n / d, master, staging=4 * filled,
                           in_flight=(4 + copies) * first, in_flight_scratch=copies * first, weight_grad=item * head,
                           tied_waiting=item * tied,
                           # the embedding's gradient is copied into its bucket's staging, made beside it
                           embedding_grad=max(item * embedding_grad, item * counts["embedding"] + 4 * last),
                           reduction=(4 + copies) * last, step=shard_step,
                           grads_early=False,
                           grads_after_top_block=True, shard_after=shard_after, shard_in_flight=after_first,
                           finishes_in_backward=True)
    unit = layer_parameters(m, p.tp)
    # the embedding's table is freed after forward (fsdp.py) unless it is the head too: tied on one
    # stage (a pipeline's first stage holds the table alone, the last its own copy)
    tied_here = m.tie_embeddings and p.pp == 1
    embedding = counts["embedding"] if not tied_here else 0
    root = counts["embedding"] + counts["head"] + counts["norm"]
    # The embedding's gradient completes the root unit: the root's fp32 staging is made beside it
    # and the head's gradient, waiting since the head's backward.
    root_done = 4 * root + item * counts["head"] if embedding_grad and not tied_here else 0
    return EngineState(4 * n / d, 4 * n / d, 8 * n / d, 0,
                       gathered_forward=item * (root + unit), gathered_after_forward=item * root,
                       gathered_loss=item * (root - embedding),
                       # the head's gradient waits in the root unit until the embedding's arrives, last
                       gathered_backward=item * (root - embedding + unit) + item * head,
                       # the next unit of backward, gathered while one computes (fsdp.py `prefetch`)
                       prefetched=item * unit,
                       # a forward gathers the root first; in bf16 from the fp32 shard's bf16 copy, alive
                       # through the all-gather (fsdp.py `_gather`; at d = 1 the whole root)
                       root_gather=item * root + (item * root / d if bf16 else 0),
                       root_staging=4 * root,
                       root_gathered=item * root, root_kept=item * (root - embedding),
                       root_launch=item * (root + counts["head"]) + 4 * root,
                       weight_grad=item * head, embedding_grad=item * embedding_grad + root_done,
                       # a unit completes: its gradients flattened into fp32 staging while both gathered
                       # units stay (the ring's scratch comes after the gradients are dropped)
                       reduction=item * (root - embedding + 2 * unit + head) + 4 * unit + max(item, copies) * unit,
                       step=4 * held_denominator_elements(fsdp_units(cfg, counts), d),
                       grads_early=False, reduces_in_backward=True, finishes_in_backward=True)
