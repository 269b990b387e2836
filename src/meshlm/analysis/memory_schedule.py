"""The pipeline schedule's share of the memory model: the order of a rank's compute instructions
(what analysis/memory.py walks) and the stage-boundary tensors the pipeline engine holds at each,
from the schedule's own P2P batches; measured one for one in tests/test_memory_phases.py.
"""

from __future__ import annotations

import functools

from meshlm.analysis.memory_terms import boundary_bytes
from meshlm.config import Config


@functools.lru_cache(maxsize=256)
def _schedules(kind: str, pp: int, microbatches: int, virtual: int) -> list:
    """build_schedule, once per shape: the planner walks many layouts of one pipeline shape (read
    only here; it was 3/4 of a plan's time)."""
    from meshlm.parallel.pipeline.schedules import build_schedule

    return build_schedule(kind, pp, microbatches, virtual)


def compute_program(cfg: Config, pp_rank: int) -> list[tuple[bool, int]]:
    """This rank's (is_forward, chunk) compute instructions, in the order the engine runs them."""
    from meshlm.parallel.pipeline.runner import microbatch_plan

    p = cfg.parallel
    m = microbatch_plan(cfg)[0]
    if p.pp == 1:
        return [(fwd, 0) for _ in range(m) for fwd in (True, False)]
    from meshlm.parallel.pipeline.schedules import BACKWARD, FORWARD

    return [(ins.op == FORWARD, ins.chunk) for ins in _schedules(p.pp_schedule, p.pp, m, p.pp_virtual)[pp_rank]
            if ins.op in (FORWARD, BACKWARD)]


def boundary_held_bytes(cfg: Config, pp_rank: int, backend: str) -> list[tuple[int, int]]:
    """For each compute instruction of rank `pp_rank` (compute_program's order), the bytes of
    stage-boundary tensors the pipeline engine holds beside what the compute itself reads: during
    it, and after it once the next batch of sends and receives is posted (where owed weight
    gradients are flushed). The engine posts a receive's buffer with its batch, long before the
    compute that reads it, and keeps a batch of sent tensors until its sends are known to be done:
    on NCCL at the next post; on gloo, which never reports a send complete before it is waited
    (pytorch/pytorch#30723), once a message has arrived that their receiver sent after posting
    their receives (schedules.send_receipts), else at reduce_grads. A sent activation is the
    stage's output, counted in what the chunk saves until its backward."""
    from meshlm.parallel.pipeline.runner import microbatch_plan
    from meshlm.parallel.pipeline.schedules import (BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT,
                                                    p2p_batches, send_receipts)

    p = cfg.parallel
    if p.pp == 1:
        return [(0, 0)] * len(compute_program(cfg, pp_rank))
    schedules = _schedules(p.pp_schedule, p.pp, microbatch_plan(cfg)[0], p.pp_virtual)
    program, receipts = schedules[pp_rank], send_receipts(schedules, pp_rank)
    posted: set[tuple] = set()  # receive buffers posted, not yet read
    unsent: set[tuple] = set()  # input gradients made, not yet posted
    sending: list[list[tuple]] = []  # each batch of (op, chunk, mb) the engine's sends still hold
    received: dict[int, int] = {}  # peer -> how many of this rank's sends it has received (gloo)
    backwarded: set[tuple] = set()  # (chunk, mb) whose backward has run: the output only the send holds

    def held() -> int:
        outputs = sum(1 for batch in sending for op, *key in batch if op != SEND_ACT or tuple(key) in backwarded)
        return boundary_bytes(cfg) * (len(posted) + len(unsent) + outputs)

    def arrived(recv: tuple) -> None:  # the engine's _SendsInFlight.arrived
        if backend != "nccl" and recv in receipts.covers:  # gloo, with or without shared memory
            peer, count = receipts.covers[recv]
            received[peer] = max(received.get(peer, 0), count)
            sending[:] = [batch for batch in sending
                          if not all(k < received.get(q, 0) for q, k in map(receipts.order.get, batch))]

    out: list[list[int]] = []
    for item in p2p_batches(program):
        if isinstance(item, list):
            if backend == "nccl":
                sending.clear()  # done by now: pruned at this post
            sends = []
            for ins in item:
                key = (ins.chunk, ins.microbatch)
                if ins.op in (RECV_ACT, RECV_GRAD):
                    posted.add((ins.op, *key))
                else:  # the tensor passes from the engine's to_send to the send
                    if ins.op != SEND_ACT:
                        unsent.discard(key)
                    sends.append((ins.op, *key))
            if sends:
                sending.append(sends)
            if out:
                out[-1][1] = held()
        elif item.op in (FORWARD, BACKWARD):
            key = (item.chunk, item.microbatch)
            recv = (RECV_ACT if item.op == FORWARD else RECV_GRAD, *key)
            if recv in posted:  # read by this compute, waited for just before it
                posted.discard(recv)
                arrived(recv)
            during = held()
            if item.op == BACKWARD:
                backwarded.add(key)
                if item.chunk * p.pp + pp_rank > 0:  # the input's gradient, to send back
                    unsent.add(key)
            out.append([during, held()])
    return [(during, after) for during, after in out]


def micro_batches_in_flight(cfg: Config, pp_rank: int) -> int:
    """The most (micro-batch, chunk) activations rank `pp_rank` holds at once (its program's)."""
    live = peak = 0
    for forward, _ in compute_program(cfg, pp_rank):
        live += 1 if forward else -1
        peak = max(peak, live)
    return peak
