"""Reduce-scatter and all-gather on gloo as point-to-point exchanges (what `Comm` runs there).
Reduces: gloo's own costs: its reduce-scatter is an all-reduce of the whole input plus copies
(2(n-1)/n x S per rank), its all-gather goes through a temporary; 32 MiB on 2 ranks: 52 and 43 ms
against 18 and 13 ms here. Costs: the reduce-scatter is a ring of n-1 dependent exchanges driven
from Python: only the first runs in the background before `wait()`, the rest inside it.

NCCL's collectives already are these rings (in kernels), so CUDA runs keep the library ops. Beyond
two ranks a small message pays n-1 P2P latencies from Python where gloo pays its own from C++;
not measured here (more ranks than cores), and the rings are used at every size all the same: one
path, whose memory the model and the CPU tracker both see (gloo's internal copies are invisible).

The rings, as in comm/ring.py, with `chunks` the n equal slices:
  reduce-scatter, step s: rank r sends its partial sum of chunk r-s-1 to r+1 and adds what arrives
  from r-1 (a partial sum of chunk r-s-2) to its own input's chunk; after n-1 steps chunk r on
  rank r holds the sum over all ranks, in `output`. Partial sums live in two scratch chunks taken
  in turn (the one just sent is free for the next receive); the last step receives straight into
  `output` (at n = 2, the only step: no scratch), unless `output` is this rank's own chunk of
  `input` (ZeRO's in-place form), whose value the last addition still needs. The input is only read.
  all-gather: not a ring but every rank sending its chunk to every other at once, received straight
  into its place in `output`: the same (n-1)/n x S per rank as a ring, no scratch, and no step
  depends on another, so all of it runs in the background (a ring's step s would forward what
  step s-1 received). On a switch or a loopback every pair has its own path; NCCL keeps rings
  for the links of a real bus.

Every rank of a group starts the same rings in the same order, and gloo matches the messages
between two ranks, per tag, in the order they were posted: rings in flight at once (ZeRO's
buckets, FSDP's prefetch) cannot mix. Their tags keep them apart from other P2P traffic (tag 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

def ring_applies(*tensors: torch.Tensor) -> bool:
    """Contiguous, non-empty tensors (anything else keeps gloo's op)."""
    return all(t.is_contiguous() and t.numel() > 0 for t in tensors)


class RingReduceScatter:
    """A started ring reduce-scatter (SUM) of `input` [n x output's numel] into `output`."""

    TAG = 1

    def __init__(self, output: torch.Tensor, input: torch.Tensor, group, ranks: list[int], me: int):
        self.n, self.me, self.group = len(ranks), me, group
        self.next, self.prev = ranks[(me + 1) % self.n], ranks[(me - 1) % self.n]
        self.step = 0
        self.output = output.view(-1)
        self.chunks = input.view(self.n, -1)
        self.in_place = _overlap(self.output, self.chunks)
        self.scratch = [torch.empty_like(self.output) for _ in range(2 if self.n > 2 else int(self.in_place))]
        self._exchange(self.chunks[(me - 1) % self.n], self._receive_buffer())

    def _exchange(self, send: torch.Tensor, receive: torch.Tensor) -> None:
        self._works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group, self.TAG),
                                              dist.P2POp(dist.irecv, receive, self.prev, self.group, self.TAG)])

    def _receive_buffer(self) -> torch.Tensor:
        return self.output if self.step == self.n - 2 and not self.in_place else self.scratch[self.step % 2]

    def wait(self) -> None:
        while self._works is not None:
            for work in self._works:
                work.wait()
            received = self._receive_buffer()
            if self.step == self.n - 2 and self.in_place:  # output is this rank's own input chunk
                self.output.add_(received)
            else:  # now a partial sum of one more rank
                received.add_(self.chunks[(self.me - self.step - 2) % self.n])
            if self.step == self.n - 2:  # that was this rank's own chunk, complete
                self._works = None
                return
            self.step += 1
            self._exchange(received, self._receive_buffer())


class DirectAllGather:
    """A started all-gather of every rank's `input` into `output` [n x input's numel]: this rank's
    chunk sent to each other rank, theirs received into place, all posted at once."""

    TAG = 2

    def __init__(self, output: torch.Tensor, input: torch.Tensor, group, ranks: list[int], me: int):
        chunks = output.view(len(ranks), -1)
        if chunks[me].data_ptr() != input.data_ptr():
            chunks[me].copy_(input.view(-1))
        ops = []
        for i, peer in enumerate(ranks):
            if i != me:
                ops += [dist.P2POp(dist.isend, chunks[me], peer, group, self.TAG),
                        dist.P2POp(dist.irecv, chunks[i], peer, group, self.TAG)]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share any byte of storage."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
