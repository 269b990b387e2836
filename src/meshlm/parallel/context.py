"""Context parallelism: the sequence split across the cp ranks, attention done as a ring.
Reduces: activations (and attention FLOPs) per rank to 1/cp: every tensor of the block is per token.
Costs: every layer's K and V travel once around the cp ring forward, and again with their fp32
gradients backward (`ring_bytes`); each hop overlaps with attention to the block that just arrived.

Attention is the one operation of the block that mixes tokens: norms, projections, the MLP and
the loss all act on each token alone, so they run unchanged on a slice of the sequence. Each cp
rank therefore holds `seq_len / cp` tokens, and only the attention core (`CoreAttention`, q·kᵀ
then ·v, after the projections and RoPE) is replaced:

    ring step j: rank r holds the K/V block of rank r-j; attends its queries to it; passes it on
    merge:       out = Σ_j exp(lse_j - lse) · out_j with lse = log Σ_j exp(lse_j)  (online softmax)

Causal load balancing. With a plain split, rank cp-1 (the end of the sequence) attends to every
block and rank 0 to its own only. So the sequence is cut into 2·cp chunks and rank i holds
chunks i and 2cp-1-i ("head and tail"): with cp=2, rank 0 has chunks 0,3 and rank 1 has 1,2.
Which (query chunk, key chunk) pairs are visible then follows a fixed pattern, and every rank
does the same work at every step:

    step 0 (its own block):      ordinary causal attention over its two chunks, in order
    a block from an earlier rank: all its queries see the block's first chunk; the second is future
    a block from a later rank:    only its second (tail) chunk's queries see the block, all of it

RoPE rotates each token by its global position (`LoadBalancedRotary`), and the loss is summed
over each rank's tokens and divided by the global token count, as everywhere else. The cp ranks
hold the same weights and see different tokens, so gradients are reduced over dp x cp.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.comm import Comm
from meshlm.comm.traced import P2P

CP = "cp"


# --------------------------------------------------------------------------- the token layout


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two of the 2·cp sequence chunks that cp rank `rank` holds: head chunk and tail chunk."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions [seq_len / cp] of the tokens cp rank `rank` holds, in its local order."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks_of(rank, cp)])


def shard_sequence(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's head and tail chunk of `tensor` along `dim` (the sequence), concatenated."""
    pieces = tensor.chunk(2 * cp, dim=dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, cp)], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: the full tensor from every cp rank's shard (tests, reports)."""
    cp = len(shards)
    pieces: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        head, tail = shard.chunk(2, dim=dim)
        first, second = chunks_of(rank, cp)
        pieces[first], pieces[second] = head, tail
    return torch.cat(pieces, dim=dim)


class LoadBalancedRotary(nn.Module):
    """Wraps the model's `RotaryEmbedding`: asked for the tables of a (local) sequence of length
    L, it returns those of this rank's global positions in the full sequence of length L·cp.
    Installed under the same name (`rope`), so the model and pipeline stages call it unchanged."""

    def __init__(self, rope: nn.Module, cp: int, rank: int):
        super().__init__()
        self.inner, self.cp, self.rank = rope, cp, rank
        self._positions: dict[int, torch.Tensor] = {}

    def forward(self, seq_len: int, positions: torch.Tensor | None = None):
        if positions is None:
            positions = self._positions.get(seq_len)
            if positions is None:
                full = seq_len * self.cp
                if full > self.inner.max_seq_len:
                    raise ValueError(f"sequence length {full} exceeds max_seq_len={self.inner.max_seq_len}")
                positions = local_positions(full, self.cp, self.rank).to(self.inner.cos.device)
                self._positions[seq_len] = positions
        return self.inner(seq_len, positions)


# --------------------------------------------------------------------------- block attention


def _flash_kernel(q: torch.Tensor, fused: bool) -> str | None:
    """Which flash kernel runs a block: "cpu", "cuda" (FlashAttention-2 as PyTorch ships it: bf16 or
    fp16 on NVIDIA sm80+, head_dim a multiple of 8 up to 256, unless switched off with
    torch.backends.cuda.enable_flash_sdp(False)), or None for the portable math. Both kernels
    return the log-sum-exp the merge needs and take the merged one back in their backward, which
    public SDPA does not."""
    if not fused:
        return None
    if q.device.type == "cpu":
        return "cpu"
    if (q.device.type == "cuda" and torch.version.hip is None and torch.backends.cuda.flash_sdp_enabled()
            and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and torch.cuda.get_device_capability(q.device) >= (8, 0)):
        return "cuda"
    return None


def _block_forward(q, k, v, causal: bool, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q kᵀ/√d) v, logsumexp of each query's scores [B, H, Sq] in fp32) for one block.
    `causal` is only ever asked of a block against itself (Sq = Sk), where the CUDA kernel's
    bottom-right and the CPU kernel's top-left alignment of the mask agree."""
    kernel = _flash_kernel(q, fused)
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse
    if kernel == "cuda":  # kv heads expanded: not every torch's kernel takes fewer than the queries'
        result = torch.ops.aten._scaled_dot_product_flash_attention(q, _expand(k, q), _expand(v, q), 0.0, causal, False)
        return result[0], result[1]
    scores = _scores(q, k, causal)
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse[..., None]) @ _expand(v, q).float()).to(q.dtype), lse


def _block_backward(dout, q, k, v, out, lse, causal: bool, fused: bool):
    """dq, dk, dv of one block, given the *merged* output and log-sum-exp of these queries: with
    them, exp(scores - lse) is exactly this block's share of the full softmax, and
    rowsum(dout·out) the full softmax's correction term, so the blocks' gradients simply add."""
    kernel = _flash_kernel(q, fused)
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal)
    if kernel == "cuda":
        # No dropout: the RNG state the forward returned is never read; no varlen: no cumulative
        # sequence lengths. (Shapes and dtypes as the forward returns them.)
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, _expand(k, q), _expand(v, q), out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
            seed, offset)
        return dq, _fold(dk, k), _fold(dv, v)
    # Portable fallback (any device, any dtype): the flash backward written out, in fp32.
    probs = torch.exp(_scores(q, k, causal) - lse[..., None])
    dout32, v32 = dout.float(), _expand(v, q).float()
    dv = probs.transpose(-1, -2) @ dout32
    dprobs = dout32 @ v32.transpose(-1, -2)
    dscores = probs * (dprobs - (dout32 * out.float()).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5
    dq = dscores @ _expand(k, q).float()
    dk = dscores.transpose(-1, -2) @ q.float()
    return dq.to(q.dtype), _fold(dk, k).to(k.dtype), _fold(dv, v).to(v.dtype)


def _expand(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """GQA: repeat each kv head for the query heads it serves."""
    repeats = q.shape[1] // kv.shape[1]
    return kv if repeats == 1 else kv.repeat_interleave(repeats, dim=1)


def _fold(grad: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """GQA: sum the gradients of a kv head's repeats."""
    b, _, s, d = grad.shape
    return grad.view(b, kv.shape[1], -1, s, d).sum(2)


def _scores(q, k, causal: bool) -> torch.Tensor:
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.float() @ _expand(k, q).float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


# --------------------------------------------------------------------------- the ring


class Ring:
    """This rank's place on the cp ring: position, neighbours (global ranks), the traced exchange."""

    def __init__(self, comm: Comm, fused: bool | None = None):
        self.comm = comm
        # fused: the device's flash kernel where it has one (`_flash_kernel`); fused=False (tests)
        # or no kernel for the device and dtype: the portable math.
        self.fused = True if fused is None else fused
        ranks = comm.ctx.ranks(CP)
        self.size, self.me = len(ranks), ranks.index(comm.rank)
        self.next, self.prev = ranks[(self.me + 1) % self.size], ranks[(self.me - 1) % self.size]

    def pass_on(self, tensor: torch.Tensor):
        """Start sending `tensor` to the next rank and receiving the previous rank's; returns
        (handle, receive buffer). Both at once, or a ring of blocking sends would deadlock."""
        incoming = torch.empty_like(tensor)
        handle = self.comm.batch_isend_irecv([P2P("send", tensor, self.next), P2P("recv", incoming, self.prev)],
                                             axis=CP)
        return handle, incoming

    def visible(self, step: int, local_len: int) -> tuple[slice, slice, bool]:
        """(query rows, key columns, causal) of this rank's tokens that see the block held at
        `step` (the block of ring position me - step): the load-balancing pattern above."""
        half = local_len // 2
        source = (self.me - step) % self.size
        if step == 0:
            return slice(None), slice(None), True
        if source < self.me:
            return slice(None), slice(0, half), False
        return slice(half, None), slice(None), False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        seq = q.shape[2]
        kv = torch.stack((k, v))
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(ring.size):
            if step < ring.size - 1:
                handle, arriving = ring.pass_on(kv)  # overlaps with this block's attention
            rows, cols, causal = ring.visible(step, seq)
            block_out, block_lse = _block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal,
                                                 ring.fused)
            merged = torch.logaddexp(lse[:, :, rows], block_lse)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged)[..., None]
                               + block_out.float() * torch.exp(block_lse - merged)[..., None])
            lse[:, :, rows] = merged
            if step < ring.size - 1:
                handle.wait()
                kv = arriving
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        seq = q.shape[2]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        # The gradient of each K/V block travels with it and is summed along the way; after the
        # full circle (one more hop than the blocks themselves) it is back on its owner.
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        dkv_handle = None
        for step in range(ring.size):
            if step < ring.size - 1:
                kv_handle, kv_arriving = ring.pass_on(kv)
            rows, cols, causal = ring.visible(step, seq)
            block_dq, block_dk, block_dv = _block_backward(
                dout[:, :, rows].contiguous(), q[:, :, rows].contiguous(), kv[0][:, :, cols].contiguous(),
                kv[1][:, :, cols].contiguous(), out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), causal,
                ring.fused)
            dq[:, :, rows] += block_dq
            if dkv_handle is not None:
                dkv_handle.wait()
                dkv = dkv_arriving
            dkv[0][:, :, cols] += block_dk
            dkv[1][:, :, cols] += block_dv
            dkv_handle, dkv_arriving = ring.pass_on(dkv)
            if step < ring.size - 1:
                kv_handle.wait()
                kv = kv_arriving
        dkv_handle.wait()
        dk, dv = dkv_arriving
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class RingAttention(nn.Module):
    """Drop-in for `CoreAttention` on a load-balanced sequence shard (q, k, v [B, H, S/cp, d])."""

    # Stores only q, k, v, the output and the log-sum-exp, never the [S, S] scores, so selective
    # recompute (which exists to drop those) has nothing to gain here and would rerun the ring.
    stores_scores = False

    def __init__(self, comm: Comm, fused: bool | None = None):
        super().__init__()
        self.ring = Ring(comm, fused)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[2] % 2:
            raise ValueError(f"ring attention needs an even local sequence (head + tail chunk), got {q.shape[2]}")
        return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), self.ring)


# --------------------------------------------------------------------------- applying it


class ContextParallel:
    """What the trainer needs after `apply_context_parallel`: how to cut a batch for this rank."""

    def __init__(self, comm: Comm):
        self.size, self.rank = comm.ctx.size(CP), comm.ctx.coord(CP)

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens of a micro-batch [B, S] and their next-token targets (cut from the
        same full sequences, so every target stays with the token that predicts it)."""
        return shard_sequence(inputs, self.size, self.rank), shard_sequence(targets, self.size, self.rank)


def apply_context_parallel(model: nn.Module, comm: Comm) -> ContextParallel | None:
    """Swap every block's attention core for ring attention and the rotary tables for this rank's
    global positions, in place (parameter names do not change). None at cp=1."""
    if comm.ctx.size(CP) == 1:
        return None
    from meshlm.model.llama import CoreAttention

    for name, module in list(model.named_modules()):
        if name.endswith("attention.core") and isinstance(module, CoreAttention):
            model.get_submodule(name.rsplit(".", 1)[0]).core = RingAttention(comm)
    model.rope = LoadBalancedRotary(model.rope, comm.ctx.size(CP), comm.ctx.coord(CP))
    return ContextParallel(comm)


def ring_bytes(batch: int, local_seq: int, kv_heads: int, head_dim: int, element_bytes: int, cp: int) -> dict[str, int]:
    """Bytes one rank sends per layer and micro-batch (ring attention, one forward and backward).

    forward:  cp-1 hops of the K and V block:                  (cp-1) · 2·b·(s/cp)·h_kv·d · e
    backward: the blocks again, cp-1 hops, plus their fp32 gradients around the full circle:
              (cp-1) · 2·b·(s/cp)·h_kv·d · e  +  cp · 2·b·(s/cp)·h_kv·d · 4
    (h_kv: the kv heads this rank holds, i.e. n_kv_heads / tp; e: bytes per element of K and V.)
    Full recompute runs the forward twice, so its ring too.
    """
    block = 2 * batch * local_seq * kv_heads * head_dim
    forward = (cp - 1) * block * element_bytes
    return {"forward": forward, "backward": forward + cp * block * 4}
