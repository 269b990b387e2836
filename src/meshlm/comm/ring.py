"""Ring reduce-scatter, ring all-gather and ring all-reduce, built from send/recv.

Reduces: the bytes each rank sends for an all-reduce to 2(n-1)/n * S, nearly independent of n
(a naive gather-to-one-rank-and-broadcast makes that rank move (n-1) * S each way).
Costs: 2(n-1) sequential steps, each paying the latency alpha: small messages get slower with n.

These exist to teach and to validate the cost model (`meshlm.comm.cost`): the tests check they
equal the library collectives and count the bytes they send against the formulas. Training
uses the library collectives through `meshlm.comm.Comm`, which are the same algorithm, tuned,
except gloo's reduce-scatter (an all-reduce in disguise) and all-gather (through a temporary),
which Comm replaces by the asynchronous P2P exchanges of `comm/gloo_rings.py`.

The picture, n = 4 ranks, tensor cut into chunks c0..c3 (ring: 0 -> 1 -> 2 -> 3 -> 0):

  reduce-scatter, step s: rank r sends its partial sum of chunk r-s-1 to r+1 and adds the
  partial sum of chunk r-s-2 that arrives from r-1. After n-1 steps chunk r on rank r holds
  the sum over all ranks: each rank owns one fully reduced chunk.
  all-gather, step s: rank r forwards chunk r-s (the one it completed or received last) to r+1
  and stores chunk r-s-1 from r-1. After n-1 steps every rank has every chunk.

Each step moves one chunk (S/n bytes) per rank, all ranks at once, so every link is busy every
step: 2(n-1) steps x S/n bytes = 2(n-1)/n * S per rank, the bandwidth-optimal amount.
"""

from __future__ import annotations

import torch

from meshlm.comm.cost import ring_chunks
from meshlm.comm.traced import P2P, Comm
from meshlm.mesh import AxesLike, axes_label, normalize_axes


def _ring(comm: Comm, axis: AxesLike):
    """(label, n, my position, next rank, previous rank) of this rank's ring along `axis`."""
    key = normalize_axes(axis)
    ranks = comm.ctx.ranks(key)
    n, me = len(ranks), ranks.index(comm.rank)
    return axes_label(key), n, me, ranks[(me + 1) % n], ranks[(me - 1) % n]


def _exchange(comm: Comm, send: torch.Tensor, to: int, recv: torch.Tensor, frm: int, label: str) -> None:
    # Send and receive at the same time: if every rank sent first and received second with
    # blocking calls, each would wait for its neighbour to receive -- a cycle, a deadlock.
    comm.batch_isend_irecv([P2P("send", send, to), P2P("recv", recv, frm)], axis=label).wait()


def _reduce_scatter_chunks(comm: Comm, chunks: list[torch.Tensor], axis: AxesLike) -> None:
    label, n, me, nxt, prv = _ring(comm, axis)
    for s in range(n - 1):
        send_i, recv_i = (me - s - 1) % n, (me - s - 2) % n
        incoming = torch.empty_like(chunks[recv_i])
        _exchange(comm, chunks[send_i], nxt, incoming, prv, label)
        chunks[recv_i] += incoming


def _all_gather_chunks(comm: Comm, chunks: list[torch.Tensor], axis: AxesLike) -> None:
    label, n, me, nxt, prv = _ring(comm, axis)
    for s in range(n - 1):
        send_i, recv_i = (me - s) % n, (me - s - 1) % n
        _exchange(comm, chunks[send_i], nxt, chunks[recv_i], prv, label)


def ring_reduce_scatter(comm: Comm, tensor: torch.Tensor, axis: AxesLike) -> torch.Tensor:
    """Sum `tensor` over the group and return this rank's chunk of the flattened sum: chunk i of
    `tensor_split(n)` for group rank i (the library's reduce_scatter, when n divides the size)."""
    _, n, me, _, _ = _ring(comm, axis)
    chunks = list(tensor.detach().reshape(-1).clone().tensor_split(n))
    _reduce_scatter_chunks(comm, chunks, axis)
    return chunks[me]


def ring_all_gather(comm: Comm, chunk: torch.Tensor, axis: AxesLike, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenate every group rank's flattened `chunk` in rank order. `sizes` lists each rank's
    element count when they differ (every rank must pass the same list)."""
    _, n, me, _, _ = _ring(comm, axis)
    sizes = sizes or [chunk.numel()] * n
    if sizes[me] != chunk.numel():
        raise ValueError(f"sizes[{me}] = {sizes[me]} but this rank's chunk has {chunk.numel()} elements")
    out = torch.empty(sum(sizes), dtype=chunk.dtype, device=chunk.device)
    chunks = list(out.split(sizes))
    chunks[me].copy_(chunk.reshape(-1))
    _all_gather_chunks(comm, chunks, axis)
    return out


def ring_all_reduce(comm: Comm, tensor: torch.Tensor, axis: AxesLike) -> torch.Tensor:
    """Sum `tensor` over the group, in place: ring reduce-scatter, then ring all-gather of the
    reduced chunks, on one buffer. Returns `tensor`."""
    _, n, _, _, _ = _ring(comm, axis)
    contiguous = tensor.is_contiguous()
    flat = tensor.view(-1) if contiguous else tensor.reshape(-1).clone()
    chunks = list(flat.tensor_split(n))
    assert [c.numel() for c in chunks] == ring_chunks(flat.numel(), n)  # the cost model's chunking
    _reduce_scatter_chunks(comm, chunks, axis)
    _all_gather_chunks(comm, chunks, axis)
    if not contiguous:  # the ring summed a copy
        tensor.copy_(flat.view_as(tensor))
    return tensor
