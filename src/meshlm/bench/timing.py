"""How the model benchmarks feed, time and weigh one training step of an engine.

Reduces: each bench (dp, tp, scaling, gpu) timing its two sides its own way; all of them time a
step here, so their numbers mean the same thing. Costs: one small collective after each timed
step (outside the timed span).

An engine is anything with `step(inputs, targets, tokens)` (forward, backward and the optimizer
on this rank's micro-batch, the summed token loss divided by the global token count `tokens`)
and `state()` (the tensors it keeps between steps: parameters, gradients, optimizer state).
A step's time is the slowest rank's (a step ends when its last rank does); the time a rank spent
blocked in meshlm's collectives comes from its flight recorder (`FlightRecorder.settle`: the host
blocked in synchronous ops and in waits on asynchronous ones, and on GPUs the streams stalled on
them), averaged over ranks. Groups of one rank (a
single process, no process group) need no special case: `Comm` skips them.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from meshlm.train.memtrack import measure_peak_bytes


def random_batch(step: int, rows: int, seq: int, vocab: int, device, shard: tuple[int, int] = (0, 1)):
    """(inputs, targets, global target tokens) of step `step`: `rows` random sequences of seq + 1
    tokens drawn from seed `step`, of which this rank takes shard `shard[0]` of `shard[1]`
    (data parallelism) or all of them (shard (0, 1): tensor parallelism, one process)."""
    index, count = shard
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    per = rows // count
    mine = tokens[index * per: (index + 1) * per].to(device)
    return mine[:, :-1], mine[:, 1:], float(rows * seq)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timed(NamedTuple):
    step_s: float  # the slowest rank's
    blocked_s: float  # the ranks' mean time waiting on meshlm's collectives (FlightRecorder.settle)
    peer_wait_s: float  # the part of it spent at shared-memory barriers: waiting for the last rank


def timed_step(engine, batch, comm, device) -> Timed:
    """One step of `engine` on `batch` (from `random_batch`), after a barrier."""
    comm.barrier()
    _sync(device)
    blocked0, waited0 = comm.recorder.settle(), comm.peer_wait_s()
    t0 = time.perf_counter()
    engine.step(*batch)
    _sync(device)
    mine = torch.tensor([time.perf_counter() - t0, comm.recorder.settle() - blocked0, comm.peer_wait_s() - waited0],
                        dtype=torch.float64, device=device)
    every = torch.empty(comm.ctx.world_size * 3, dtype=torch.float64, device=device)
    comm.all_gather(every, mine, "world")
    every = every.view(-1, 3)
    return Timed(every[:, 0].max().item(), every[:, 1].mean().item(), every[:, 2].mean().item())


def alternate(engines: dict, batch_of, comm, device, warmup: int, steps: int) -> dict[str, list[Timed]]:
    """`warmup` + `steps` rounds, each stepping every engine once on `batch_of(round)`, the order
    reversed every other round (a slow spell of the machine hits both sides of a pair alike);
    {name: [timed_step(...) of each timed round]}."""
    out = {k: [] for k in engines}
    for i in range(warmup + steps):
        for k in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
            timed = timed_step(engines[k], batch_of(i), comm, device)
            if i >= warmup:
                out[k].append(timed)
    return out


def measured_peak(engine, batch, comm, device, track_resizes: bool = False) -> int:
    """Peak bytes of one step of a warm `engine` (its optimizer state exists), the largest over
    ranks: CUDA's allocator on GPU, live tensor storages on CPU (memtrack.measure_peak_bytes;
    `track_resizes` for engines that free parameters by resizing storages, as ZeRO-3 does)."""
    peak = measure_peak_bytes(lambda: engine.step(*batch), engine.state(), device, track_resizes=track_resizes)
    biggest = torch.tensor([float(peak)], dtype=torch.float64, device=device)
    comm.all_reduce(biggest, "world", op=dist.ReduceOp.MAX)
    return int(biggest.item())


def exposed_share(step_s: float, compute_s: float) -> float:
    """The share of a step not explained by its compute-only twin (the same model and per-rank
    batch trained with no communication): (step - compute) / step, floored at 0. What a host
    cannot see inside a library's collectives, it can bound this way."""
    return max(0.0, (step_s - compute_s) / step_s)
