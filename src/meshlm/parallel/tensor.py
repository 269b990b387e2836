"""Tensor (+ sequence) parallelism applied to meshlm's Llama from a name-to-style table.
Reduces: per-rank weights, gradients, optimizer state by 1/tp and activations by the formulas below.
Costs: 4 collectives of a [B, S, h] activation per layer and micro-batch on the critical path (see
`comm_per_microbatch`), so tp stays inside a node, on the fastest links.

The model code knows nothing of this: `apply_tensor_parallel` swaps modules in place (parameter
names do not change) according to `TP_PLAN`, the one place where the split of a transformer
block is written down (docs/tensor-parallel.md explains each line):

    attention: wq, wk, wv column-parallel (heads split; kv heads too under GQA), wo row-parallel
    MLP:       w1 (gate), w3 (up) column-parallel, w2 (down) row-parallel
    regions:   attention and feed_forward enter the parallel region once, for all their columns
    norms:     replicated; under SP they run on sequence shards and their gradients are partial
    tok_embeddings / output: vocabulary-parallel (tied weights stay one sharded Parameter)

GQA: kv heads are split across tp ranks when n_kv_heads is divisible by tp; when tp is a multiple
of n_kv_heads instead, each kv head is replicated on tp / n_kv_heads ranks (Megatron's way) and
the replicas' gradients are summed. Any other pair is refused (config validation names the key).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from meshlm.comm import Comm
from meshlm.comm.cost import bus_factor
from meshlm.parallel.tensor_layers import TP, ColumnParallelLinear, ParallelRegion, RowParallelLinear, shard_rows
from meshlm.parallel.vocab_parallel import (VocabParallelEmbedding, VocabParallelHead, VocabParallelLoss, VocabShard,
                                            gather_logits)

# Module name (`*` = a layer index) -> how it is parallelised. Order matters: a region is
# installed before its column linears, and the embedding before the head that may share its weight.
TP_PLAN: dict[str, str] = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "replicated_norm",
    "layers.*.attention": "region",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "replicated_norm",
    "layers.*.feed_forward": "region",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "norm": "replicated_norm",
    "output": "vocab_head",
}


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name) is not None


def check_divisible(cfg, tp: int) -> None:
    """Whole heads, whole (or replicated) kv heads and equal MLP slices per rank (the vocabulary
    is padded)."""
    for key in ("n_heads", "ffn_dim"):
        if getattr(cfg, key) % tp:
            raise ValueError(f"tensor parallelism: model.{key}={getattr(cfg, key)} is not divisible by tp={tp}")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        raise ValueError(f"tensor parallelism: model.n_kv_heads={cfg.n_kv_heads} neither divides nor is divisible "
                         f"by tp={tp}")


class TensorParallel:
    """What the trainer needs from a tensor-parallel model after `apply_tensor_parallel`."""

    def __init__(self, model: nn.Module, comm: Comm, sequence_parallel: bool, shard: VocabShard):
        self.model = model
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.vocab = shard
        self.loss_sum = VocabParallelLoss(shard, comm)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        return gather_logits(local, self.vocab, self.comm)

    @torch.no_grad()
    def full_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Replace every tp shard in `state` by the full tensor (vocabulary unpadded). Collective
        over tp; every rank gets the full tensors. Tied weights are gathered once."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        gathered: dict[int, torch.Tensor] = {}
        out = {}
        for name, value in state.items():
            p = params.get(name)
            if p is None or not getattr(p, "meshlm_tp_sharded", False):
                out[name] = value
                continue
            if id(p) not in gathered:
                gathered[id(p)] = self._gather(value, p.meshlm_tp_dim, p.meshlm_tp_full_size,
                                               p.meshlm_tp_replicas)
            out[name] = gathered[id(p)]
        return out

    def _gather(self, shard: torch.Tensor, dim: int, full_size: int, replicas: int = 1) -> torch.Tensor:
        shard = shard.detach().contiguous()
        n = self.comm.ctx.size(TP)
        out = torch.empty((n * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        self.comm.all_gather(out, shard, TP)
        slices = out.view(n, *shard.shape).unbind(0)[::replicas]  # one of each replicated slice
        return torch.cat(slices, dim=dim).narrow(dim, 0, full_size).clone()


def sum_partial_gradients(param: nn.Parameter, comm: Comm) -> None:
    """SP: a replicated weight applied to sequence shards (the norms) gets, on each rank, the
    gradient of its own tokens only; all-reduce it over tp as it is computed.

    A hook on the gradient *before* it is accumulated into `.grad`, so it is correct with
    micro-batch accumulation and whatever the data-parallel engine does with `.grad` afterwards
    (DDP's overlapped buckets, ZeRO's reduce-scatter). Price: one small all-reduce ([dim]) per
    norm and micro-batch; Megatron batches them into one at the end of backward instead."""

    def reduce(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, TP)
        return grad

    param.register_hook(reduce)


def apply_tensor_parallel(model: nn.Module, comm: Comm, sequence_parallel: bool = False) -> TensorParallel | None:
    """Shard `model` (a full, initialised Llama) in place for this rank's tp coordinate.

    Each rank keeps the slices of the single-process weights it owns, so the sharded model starts
    exactly where the single-process one does. Returns None when tp == 1 (nothing to do).
    """
    tp = comm.ctx.size(TP)
    if tp == 1:
        return None
    check_divisible(model.cfg, tp)
    modules = dict(model.named_modules())
    regions: dict[str, ParallelRegion] = {}
    replaced: dict[int, nn.Parameter] = {}  # id(old Parameter) -> its shard, to keep ties tied
    embedding = None
    for pattern, style in TP_PLAN.items():
        for name in [n for n in modules if _matches(pattern, n)]:
            module = modules[name]
            parent_name, _, attr = name.rpartition(".")
            parent = modules[parent_name] if parent_name else model
            if style == "region":
                regions[name] = ParallelRegion(comm, sequence_parallel)
                regions[name].install(module)
                continue
            if style == "replicated_norm":
                if sequence_parallel:
                    sum_partial_gradients(module.weight, comm)
                continue
            if style == "colwise" and attr in ("wk", "wv") and model.cfg.n_kv_heads % tp:
                new = ColumnParallelLinear.replicated_heads(module, comm, model.cfg.n_kv_heads,
                                                            region=regions[parent_name])
            elif style == "colwise":
                new = ColumnParallelLinear.from_linear(module, comm, region=regions[parent_name])
            elif style == "rowwise":
                new = RowParallelLinear.from_linear(module, comm, sequence_parallel=sequence_parallel)
            elif style == "vocab_embedding":
                new = embedding = VocabParallelEmbedding(module, comm, sequence_parallel=sequence_parallel)
            elif style == "vocab_head":
                weight = replaced.get(id(module.weight))  # tied: the embedding's shard
                if weight is None:
                    weight = nn.Parameter(shard_rows(module.weight.detach(), tp, comm.ctx.group_rank(TP), 0))
                new = VocabParallelHead(weight, embedding.shard, comm, sequence_parallel=sequence_parallel)
            else:
                raise ValueError(f"TP_PLAN: unknown style {style!r} for {pattern!r}")
            replaced[id(module.weight)] = new.weight
            setattr(parent, attr, new)
    return TensorParallel(model, comm, sequence_parallel, embedding.shard)


# --------------------------------------------------------------------------- cost formulas


def comm_per_microbatch(cfg, batch: int, seq: int, tp: int, sequence_parallel: bool,
                        itemsize: int = 4) -> dict[str, dict[str, float]]:
    """Collectives on the tp axis for one micro-batch's forward + backward (no recompute).

    Per op: `count`, `bytes` (the sum of message sizes S, nccl-tests convention) and `sent`
    (bytes each rank sends in a ring: bus_factor * S). With A = batch * seq * dim * itemsize:
    - TP, per layer: 4 all-reduces of A (forward after wo and w2; backward at the attention and MLP
      entries). Embedding: 1 forward; head: 1 backward.
    - SP, per layer: 2 all-gathers + 2 reduce-scatters forward (entries, rows), 2 reduce-scatters
      + 2 all-gathers backward, the same bytes sent as TP's 4 all-reduces; plus 2 all-gathers of
      A backward that re-gather the saved shards (the price of not storing the gathered input).
      Embedding: reduce-scatter forward, all-gather backward; head: all-gather forward,
      all-gather (re-gather) + reduce-scatter backward.
    - Loss (both): all-reduce MAX of [batch*seq] fp32, all-reduce SUM of [2, batch*seq] fp32.
    - SP only: one all-reduce of [dim] per norm (2L + 1) for the partial norm-weight gradients.
    """
    act = batch * seq * cfg.dim * itemsize
    layers = cfg.n_layers
    if sequence_parallel:
        ops = {"all_gather": [act] * (6 * layers + 3), "reduce_scatter": [act] * (4 * layers + 2), "all_reduce": []}
    else:
        ops = {"all_reduce": [act] * (4 * layers + 2)}
    ops["all_reduce"] += [batch * seq * 4, 2 * batch * seq * 4]
    if sequence_parallel:
        ops["all_reduce"] += [cfg.dim * itemsize] * (2 * layers + 1)
    return {op: {"count": len(sizes), "bytes": sum(sizes), "sent": sum(sizes) * bus_factor(op, tp)}
            for op, sizes in ops.items() if sizes}


def layer_comm_sent(cfg, batch: int, seq: int, tp: int, sequence_parallel: bool, itemsize: int = 4,
                    include_regather: bool = True) -> float:
    """Bytes one rank sends for one layer's forward + backward in activation collectives. TP == SP
    without the re-gathers. SP's all-reduces of the norm gradients (2 x dim per layer) are left out."""
    act = batch * seq * cfg.dim * itemsize
    if not sequence_parallel:
        return 4 * act * bus_factor("all_reduce", tp)
    per = (4 + 4 + (2 if include_regather else 0)) * act
    return per * bus_factor("all_gather", tp)


def activation_bytes_per_layer(cfg, batch: int, seq: int, tp: int, sequence_parallel: bool,
                               itemsize: int = 4) -> int:
    """Bytes one rank saves for backward in one meshlm Llama block (derived in docs/tensor-parallel.md).

    Outside the regions (replicated under TP, sequence-sharded under SP), per token:
      2 norm inputs + 2 normalised values + 2 GEMM inputs (QKV, gate/up) = 6h, and 2 rms statistics.
    Inside (split by heads / ffn columns), per token: rotated q (h), k and v (2 h k/a), the attention
    output (h), the attention log-sum-exp (a; flash attention keeps no s x s matrix), and the
    SwiGLU's gate, up, silu(gate) and product (4 ffn).
    """
    b, s, h, a, k, f = batch, seq, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim
    d = h // a
    outside = 6 * h + 2
    kv_local = max(1, k // tp)  # one whole kv head per rank when tp is a multiple of n_kv_heads
    inside = b * s * ((a // tp) * d * 2 + 2 * kv_local * d + (a // tp) + 4 * (f // tp))
    outside_elements = b * (s // tp if sequence_parallel else s) * outside
    return (outside_elements + inside) * itemsize


def korthikanti_bytes_per_layer(seq: int, batch: int, dim: int, heads: int, tp: int, sequence_parallel: bool) -> float:
    """The paper's formula for a GPT block in fp16 with dropout: sbh(10 + 24/t + 5as/(ht)) without
    SP, sbh(34/t + 5as/(ht)) with it. For comparison in the docs; meshlm's block differs."""
    attention = 5 * heads * seq / (dim * tp)
    return seq * batch * dim * ((34 / tp) if sequence_parallel else (10 + 24 / tp)) + seq * batch * dim * attention
