"""Activations forward, gradients backward: the pipeline's point-to-point messages, through Comm.

Reduces: hangs and silent corruption; P2P moves raw bytes into a buffer the receiver allocated,
so a receiver expecting another shape or dtype than the sender sends would hang (more bytes than
arrive) or read garbage. Every pair of neighbouring stages therefore swaps its expected spec once
per new shape, before any activation moves, and both sides raise the same clear error.
Costs: one tiny exchange per new micro-batch shape (so once per run for training, once for eval).

Peers are pipeline ranks (0..pp-1) of this rank's own pipeline (same tp, cp, dp coordinates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from meshlm.comm import Comm
from meshlm.comm.traced import P2P, Handle
from meshlm.group_timeout import group_timeout

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 6


class P2PMismatch(RuntimeError):
    """Two neighbouring stages disagree on the shape or dtype of the tensors between them."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def encode(self, device: torch.device) -> torch.Tensor:
        if len(self.shape) > _MAX_DIMS or self.dtype not in _DTYPES:
            raise ValueError(f"cannot send tensors of shape {self.shape} and dtype {self.dtype} between stages")
        dims = list(self.shape) + [0] * (_MAX_DIMS - len(self.shape))
        return torch.tensor([len(self.shape), _DTYPES.index(self.dtype), *dims], dtype=torch.int64, device=device)

    @staticmethod
    def decode(t: torch.Tensor) -> "TensorSpec":
        values = t.tolist()
        return TensorSpec(tuple(values[2: 2 + values[0]]), _DTYPES[values[1]])

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


class PipelineP2P:
    """This rank's links to its pipeline neighbours (both, wrapping: the interleaved schedule sends
    from the last stage back to the first)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        ctx = comm.ctx
        self.ctx = ctx
        self.pp_rank = ctx.coord("pp")
        pp = ctx.size("pp")
        self.neighbours = sorted({(self.pp_rank + 1) % pp, (self.pp_rank - 1) % pp} - {self.pp_rank})
        self._agreed: set[TensorSpec] = set()
        # On gloo every pair of ranks shares one connection, guarded by one lock that gloo's I/O
        # thread holds while it moves a message. A receive posted while a message moves the other
        # way on that connection waits for it: about 2 ms per receive on the first stage of the
        # interleaved schedule here (the torch profiler's c10d::recv_). Messages from the higher
        # to the lower rank therefore get a connection of their own: a second world group.
        # (Collective: every rank builds its PipelineP2P at the same point.) NCCL has no such lock.
        self._downward = dist.new_group(list(range(ctx.world_size)), timeout=group_timeout()) \
            if ctx.backend == "gloo" and pp > 1 and dist.is_initialized() else None

    def global_rank(self, pp_rank: int) -> int:
        return self.ctx.layout.rank_of({**self.ctx.coords, "pp": pp_rank})

    def agree(self, spec: TensorSpec) -> None:
        """Swap `spec` with both neighbours; raise P2PMismatch (on both sides) if they differ."""
        if spec in self._agreed or not self.neighbours:
            return
        device = self.ctx.device
        mine = spec.encode(device)
        theirs = {peer: torch.empty_like(mine) for peer in self.neighbours}
        ops = [P2P("send", mine, self.global_rank(p)) for p in self.neighbours]
        ops += [P2P("recv", theirs[p], self.global_rank(p)) for p in self.neighbours]
        self.comm.batch_isend_irecv(ops, "pp").wait()
        for peer, t in theirs.items():
            other = TensorSpec.decode(t.cpu())
            if other != spec:
                raise P2PMismatch(f"pipeline rank {self.pp_rank} expects activations of {spec} but pipeline rank "
                                  f"{peer} expects {other}: were the stages built from the same config?")
        self._agreed.add(spec)

    def empty(self, spec: TensorSpec) -> torch.Tensor:
        return torch.empty(spec.shape, dtype=spec.dtype, device=self.ctx.device)

    def post(self, ops: Sequence[tuple[str, torch.Tensor, int]]) -> Handle:
        """Start sends and receives [(kind, tensor, pipeline peer), ...] as one batch; no waiting.
        With a downward connection, one batch per direction (still posted in order)."""
        p2p = [P2P(kind, t, self.global_rank(peer)) for kind, t, peer in ops]
        if self._downward is None:
            return self.comm.batch_isend_irecv(p2p, "pp")
        me = self.ctx.rank
        is_down = [o.peer < me if o.kind == "send" else o.peer > me for o in p2p]
        down = [o for o, d in zip(p2p, is_down) if d]
        up = [o for o, d in zip(p2p, is_down) if not d]
        handles = [self.comm.batch_isend_irecv(up, "pp")] if up else []
        if down:
            handles.append(self.comm.batch_isend_irecv(down, "pp", group=self._downward))
        return handles[0] if len(handles) == 1 else Handle.merge(handles)
