"""Reduce-scatter on gloo as a ring of point-to-point exchanges (what `Comm.reduce_scatter` runs there).
Reduces: gloo's reduce-scatter cost, an all-reduce of the whole input plus a copy of the slice
(2(n-1)/n x S sent per rank), to the bandwidth-optimal (n-1)/n x S with no copy. Costs: n-1
dependent exchanges; only the first runs in the background before `wait()`, the rest inside it.

NCCL's reduce-scatter already is this ring (in a kernel), so CUDA runs keep the library op.

The ring, as in comm/ring.py: at step s rank r sends its partial sum of chunk r-s-1 to r+1 and
adds what arrives from r-1 (a partial sum of chunk r-s-2) to its own input's chunk. After n-1
steps chunk r on rank r holds the sum over all ranks; it lands in `output`. The partial sums live
in two scratch chunks taken in turn (the one just sent is free for the next receive); the last
step receives straight into `output` (at n = 2, the only step: no scratch at all), unless
`output` is this rank's own chunk of `input` (ZeRO's in-place reduce-scatter), whose value the
last addition still needs. Otherwise the input is only read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RingReduceScatter:
    """A started ring reduce-scatter (SUM) of `input` [n x output's numel] into `output`. Every rank
    of the group starts the same ones in the same order, and gloo matches the messages between two
    ranks in the order they were posted, so rings in flight at once (ZeRO's buckets) cannot mix.
    Their tag keeps them apart from other P2P traffic on the group (tag 0)."""

    TAG = 1

    def __init__(self, output: torch.Tensor, input: torch.Tensor, group, ranks: list[int], me: int):
        self.n, self.me = len(ranks), me
        self.output = output.view(-1)
        self.chunks = input.view(self.n, -1)
        self.next, self.prev = ranks[(me + 1) % self.n], ranks[(me - 1) % self.n]
        self.group = group
        self.in_place = _overlap(self.output, self.chunks)
        self.scratch = [torch.empty_like(self.output) for _ in range(2 if self.n > 2 else int(self.in_place))]
        self.step = 0
        self._post(self.chunks[(me - 1) % self.n])

    def _receive_buffer(self) -> torch.Tensor:
        return self.output if self.step == self.n - 2 and not self.in_place else self.scratch[self.step % 2]

    def _post(self, send: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, send, self.next, self.group, self.TAG),
               dist.P2POp(dist.irecv, self._receive_buffer(), self.prev, self.group, self.TAG)]
        self._works = dist.batch_isend_irecv(ops)

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
            self._post(received)

    @staticmethod
    def applies(output: torch.Tensor, input: torch.Tensor, op) -> bool:
        """Flat, contiguous, a sum: what the engines reduce (anything else keeps the library op)."""
        return op == dist.ReduceOp.SUM and input.is_contiguous() and output.is_contiguous() and output.numel() > 0


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share any byte of storage."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
