"""Pipeline schedules as data: a pure function from (kind, pp, micro-batches, virtual stages) to
each pipeline rank's list of instructions, which one small engine executes and the simulator draws.

Reduces: the idle time ("bubble") of a naive pipeline, where only one stage works at a time, to
(p-1)/(m+p-1) of the step with m micro-batches (GPipe, 1F1B) or (p-1)/(v*m+p-1) with v model
chunks per rank (interleaved 1F1B); 1F1B also caps the micro-batches whose activations a rank
holds at p instead of m.
Costs: nothing at run time (it is a list); the price of a schedule is paid in the engine: P2P
messages per micro-batch and chunk, and activation memory for every micro-batch in flight.

Vocabulary. The model is cut into S = pp * v consecutive *virtual stages*; virtual stage j lives on
pipeline rank j % pp as its chunk j // pp (Megatron's interleaving: rank 0 holds stages 0, pp,
2pp, ...). A micro-batch's activation flows 0 -> 1 -> ... -> S-1, its gradient back again.

The compute order of each rank is the published one:
- GPipe: all forwards, then all backwards (Huang et al. 2019; torch's ScheduleGPipe order).
- 1F1B: pp-rank-1 warm-up forwards, then one forward and one backward alternately, then the
  remaining backwards (PipeDream-Flush, Narayanan et al. 2021).
- interleaved: 1F1B over v chunks, forwards chunk-major in rounds of pp micro-batches, warm-up
  (v-1)*round + 2*(pp-1-rank) (Megatron-LM; the same order as torch's ScheduleInterleaved1F1B,
  including its relaxation to m % max(1, m // pp) == 0).

Where the messages go (deadlock freedom by construction). The compute orders are played out on a
tick clock (forward 1 tick, backward 2), every op as early as its inputs allow. A message made at
tick T is exchanged at tick T on *both* sides: the sender right after the op that made it, the
receiver after whatever it finished by T. Consecutive P2P instructions form one batch (one
`batch_isend_irecv`), so every rank posts its batches in increasing T and, within a batch, in a
fixed message order. Hence (1) per pair of ranks the k-th send meets the k-th receive (P2P
matches in order, and act/grad tensors have the same shape, so a mix-up would be silent), and
(2) nothing can wait in a cycle: the earliest unfinished exchange has all its partners posted.
The simulator checks both, with sends that complete only when received (NCCL's worst case).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")

FORWARD, BACKWARD = "forward", "backward"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "send_act", "recv_act", "send_grad", "recv_grad"
REDUCE_GRADS, OPTIMIZER_STEP = "reduce_grads", "optimizer_step"
COMPUTE_OPS = (FORWARD, BACKWARD)
P2P_OPS = (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)

# Tick costs used to place the messages (the usual assumption: a backward costs two forwards).
_PLACEMENT_COST = {FORWARD: 1, BACKWARD: 2}
_SHORT = {FORWARD: "F", BACKWARD: "B", SEND_ACT: "send_act", RECV_ACT: "recv_act",
          SEND_GRAD: "send_grad", RECV_GRAD: "recv_grad"}


class ScheduleError(ValueError):
    """Settings no schedule can run (the config layer turns this into a ConfigError)."""


@dataclass(frozen=True)
class Instruction:
    """One step of one rank's program.

    op: forward / backward of (microbatch, chunk); send_act / recv_act / send_grad / recv_grad of
    (microbatch, chunk) with pipeline rank `peer` (chunk is always *this* rank's chunk: the one
    that produced a send, or the one that will consume a receive); reduce_grads; optimizer_step.
    """

    op: str
    microbatch: int = -1
    chunk: int = 0
    peer: int = -1

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @property
    def is_p2p(self) -> bool:
        return self.op in P2P_OPS

    def __str__(self) -> str:
        if self.op in (REDUCE_GRADS, OPTIMIZER_STEP):
            return self.op
        text = f"{_SHORT[self.op]}{'' if self.is_compute else ' '}{self.microbatch}.{self.chunk}"
        if self.is_p2p:
            text += f" {'->' if self.op.startswith('send') else '<-'}{self.peer}"
        return text


@dataclass(frozen=True)
class PipelineShape:
    """pp ranks x v chunks = S virtual stages, and m micro-batches per step."""

    pp: int
    microbatches: int
    virtual: int = 1

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + rank

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) of virtual stage `stage`."""
        return stage % self.pp, stage // self.pp

    def message(self, rank: int, ins: Instruction) -> tuple[str, int, int]:
        """The message a P2P instruction moves: (kind, microbatch, producing virtual stage). The
        send and the receive of one message give the same key on their two ranks."""
        here = self.stage(rank, ins.chunk)
        if ins.op == SEND_ACT:
            return ("act", ins.microbatch, here)
        if ins.op == RECV_ACT:
            return ("act", ins.microbatch, here - 1)
        if ins.op == SEND_GRAD:
            return ("grad", ins.microbatch, here)
        if ins.op == RECV_GRAD:
            return ("grad", ins.microbatch, here + 1)
        raise ValueError(f"{ins} is not a P2P instruction")


# --------------------------------------------------------------------------- validation


def check_pipeline_config(p, t) -> None:
    """ConfigError naming the key if the config's pipeline cannot run: the micro-batch count m
    (parallel.pp_microbatches, else global_batch_size / (dp * micro_batch_size)) and whether the
    schedule runs with it; virtual stages without a pipeline. (A micro-batch count is left unused
    at pp=1: a config may keep it while pp is toggled.)"""
    from meshlm.errors import ConfigError

    if p.pp == 1:
        if p.pp_virtual != 1:
            raise ConfigError(f"parallel.pp_virtual: {p.pp_virtual} virtual stages need a pipeline "
                              f"(parallel.pp > 1); at pp=1 it would be ignored")
        return
    local = t.global_batch_size // p.dp
    if p.pp_microbatches and local % p.pp_microbatches:
        raise ConfigError(f"parallel.pp_microbatches: {p.pp_microbatches} does not divide the batch of one "
                          f"pipeline, global_batch_size/dp = {local}")
    n_micro = p.pp_microbatches or local // t.micro_batch_size
    try:
        check_schedule(p.pp_schedule, p.pp, n_micro, p.pp_virtual)
    except ScheduleError as e:
        raise ConfigError(f"parallel.pp_microbatches: {e} (m = {n_micro}: global_batch_size/(dp*micro_batch_size) "
                          f"unless parallel.pp_microbatches is set)") from None


def check_schedule(kind: str, pp: int, microbatches: int, virtual: int = 1) -> None:
    """Raise ScheduleError if `kind` cannot run with these settings (the reason in one line)."""
    if kind not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {kind!r} (known: {', '.join(SCHEDULES)})")
    for name, value in (("pp", pp), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
    if virtual > 1 and kind != "interleaved":
        raise ScheduleError(f"{virtual} virtual stages per rank need the interleaved schedule, not {kind}")
    if kind == "interleaved":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ScheduleError(f"interleaved 1F1B runs micro-batches in rounds of about pp={pp}: "
                                f"{microbatches} is not a multiple of its {rounds} rounds "
                                f"(use a multiple of pp, or fewer than 2*pp)")


# --------------------------------------------------------------------------- compute order


def _gpipe(shape: PipelineShape, rank: int) -> list[tuple[str, int, int]]:
    m = shape.microbatches
    return [(FORWARD, i, 0) for i in range(m)] + [(BACKWARD, i, 0) for i in range(m)]


def _one_f_one_b(shape: PipelineShape, rank: int) -> list[tuple[str, int, int]]:
    m, pp = shape.microbatches, shape.pp
    warmup = min(pp - rank - 1, m)
    order = [(FORWARD, i, 0) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: the forward of i+warmup, then the backward of i
        order += [(FORWARD, i + warmup, 0), (BACKWARD, i, 0)]
    order += [(BACKWARD, i, 0) for i in range(m - warmup, m)]
    return order


def _interleaved(shape: PipelineShape, rank: int) -> list[tuple[str, int, int]]:
    m, pp, v = shape.microbatches, shape.pp, shape.virtual
    per_round = m // max(1, m // pp)
    total = m * v  # chunk-microbatch forwards (and backwards) on this rank
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)
    next_mb = {FORWARD: [0] * v, BACKWARD: [0] * v}

    def take(op: str, k: int) -> tuple[str, int, int]:
        # Forwards run chunk 0, 1, ..., v-1 for a round of micro-batches each; backwards the chunks
        # in reverse, since the gradient enters at the last virtual stage.
        chunk = (k // per_round) % v
        if op == BACKWARD:
            chunk = v - 1 - chunk
        mb = next_mb[op][chunk]
        next_mb[op][chunk] += 1
        return (op, mb, chunk)

    order = [take(FORWARD, k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [take(FORWARD, warmup + k), take(BACKWARD, k)]
    order += [take(BACKWARD, k) for k in range(total - warmup, total)]
    return order


_ORDERS = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved}


def compute_order(kind: str, pp: int, microbatches: int, virtual: int = 1, rank: int = 0,
                  forward_only: bool = False) -> list[tuple[str, int, int]]:
    """The (op, microbatch, chunk) compute steps of one rank, in order, without messages.

    forward_only (evaluation): every forward, chunk-major, whatever the kind."""
    shape = PipelineShape(pp, microbatches, virtual)
    if forward_only:
        return [(FORWARD, i, c) for c in range(virtual) for i in range(microbatches)]
    check_schedule(kind, pp, microbatches, virtual)
    return _ORDERS[kind](shape, rank)


# --------------------------------------------------------------------------- messages


def _producer(shape: PipelineShape, op: str, mb: int, stage: int):
    """The remote op whose output this op needs, or None (first/last stage, or the local forward)."""
    if op == FORWARD:
        return (FORWARD, mb, stage - 1) if stage > 0 else None
    return (BACKWARD, mb, stage + 1) if stage < shape.n_stages - 1 else None


def _tick_times(shape: PipelineShape, orders: list[list[tuple[str, int, int]]]) -> dict:
    """Start tick of every compute op, each as early as its inputs and its rank's order allow."""
    end: dict[tuple[str, int, int], int] = {}  # (op, mb, stage) -> end tick
    start: dict[tuple[str, int, int], int] = {}
    pc = [0] * shape.pp
    free_at = [0] * shape.pp
    remaining = sum(len(o) for o in orders)
    t = 0
    limit = 4 * remaining + 4 * shape.n_stages + 8
    while remaining:
        for rank, order in enumerate(orders):
            if pc[rank] == len(order) or free_at[rank] > t:
                continue
            op, mb, chunk = order[pc[rank]]
            stage = shape.stage(rank, chunk)
            need = _producer(shape, op, mb, stage)
            if op == BACKWARD and (FORWARD, mb, stage) not in end:
                raise ScheduleError(f"rank {rank}: backward of micro-batch {mb} chunk {chunk} before its forward")
            if need is not None and end.get(need, t + 1) > t:
                continue
            start[(op, mb, stage)] = t
            end[(op, mb, stage)] = free_at[rank] = t + _PLACEMENT_COST[op]
            pc[rank] += 1
            remaining -= 1
        t += 1
        if t > limit:
            stuck = {r: orders[r][pc[r]] for r in range(shape.pp) if pc[r] < len(orders[r])}
            raise ScheduleError(f"the compute orders wait on each other (deadlock); next ops {stuck}")
    return start


def build_schedule(kind: str, pp: int, microbatches: int, virtual: int = 1, *,
                   forward_only: bool = False) -> list[list[Instruction]]:
    """Every pipeline rank's instruction list for one step (index = pipeline rank).

    Training lists end with reduce_grads and optimizer_step; forward_only lists (evaluation) have
    neither. See the module docstring for where the P2P instructions are placed and why."""
    if not forward_only:
        check_schedule(kind, pp, microbatches, virtual)
    shape = PipelineShape(pp, microbatches, virtual)
    orders = [compute_order(kind, pp, microbatches, virtual, r, forward_only) for r in range(pp)]
    start = _tick_times(shape, orders)
    # (rank) -> list of (tick, sort key, instruction); compute ops sort before the exchange of
    # the tick at which they end, exchanges before compute ops that start at that tick.
    events: list[list[tuple]] = [[] for _ in range(pp)]
    for rank, order in enumerate(orders):
        for op, mb, chunk in order:
            stage = shape.stage(rank, chunk)
            t0 = start[(op, mb, stage)]
            events[rank].append((t0, 1, (), Instruction(op, mb, chunk)))
            t1 = t0 + _PLACEMENT_COST[op]
            last_stage = shape.n_stages - 1
            if op == FORWARD and stage < last_stage:
                dst_rank, dst_chunk = shape.place(stage + 1)
                key = ("act", mb, stage)
                events[rank].append((t1, 0, key, Instruction(SEND_ACT, mb, chunk, dst_rank)))
                events[dst_rank].append((t1, 0, key, Instruction(RECV_ACT, mb, dst_chunk, rank)))
            if op == BACKWARD and stage > 0:
                dst_rank, dst_chunk = shape.place(stage - 1)
                key = ("grad", mb, stage)
                events[rank].append((t1, 0, key, Instruction(SEND_GRAD, mb, chunk, dst_rank)))
                events[dst_rank].append((t1, 0, key, Instruction(RECV_GRAD, mb, dst_chunk, rank)))
    schedules = []
    for rank in range(pp):
        program = [ins for *_, ins in sorted(events[rank], key=lambda e: e[:3])]
        if not forward_only:
            program += [Instruction(REDUCE_GRADS), Instruction(OPTIMIZER_STEP)]
        schedules.append(program)
    return schedules


def p2p_batches(program: list[Instruction]) -> list[list[Instruction] | Instruction]:
    """The program with each run of consecutive P2P instructions grouped into one batch (a list):
    what the engine posts as one batch_isend_irecv and the simulator treats as one exchange."""
    out: list = []
    for ins in program:
        if ins.is_p2p:
            if out and isinstance(out[-1], list):
                out[-1].append(ins)
            else:
                out.append([ins])
        else:
            out.append(ins)
    return out


@dataclass(frozen=True)
class SendReceipts:
    """When a rank knows its sends were received without waiting on them: `order` numbers each
    send (op, chunk, mb) per peer, (peer, k); once the receive `covers` maps to (peer, n) has
    arrived, that peer has posted the receives of this rank's first n sends to it."""

    order: dict[tuple[str, int, int], tuple[int, int]]
    covers: dict[tuple[str, int, int], tuple[int, int]]


def send_receipts(schedules: list[list[Instruction]], rank: int) -> SendReceipts:
    """On gloo a send completes only once its receiver has posted the receive (a rendezvous) and
    reports nothing before it is waited, so an engine that never waits early keeps every tensor it
    sent until the step's end. But every rank posts its batches in program order, receives before
    sends (engine.py), and per pair the k-th send meets the k-th receive (above): when a message
    from peer P arrives, P had posted every receive in that batch or before it, so the sends they
    match can be waited at once, without stalling on P."""
    def batches(program):  # instruction index -> the index of its item in p2p_batches(program)
        return [i for i, item in enumerate(p2p_batches(program)) for _ in (item if isinstance(item, list) else [item])]

    def key(ins: Instruction) -> tuple[str, int, int]:
        return ins.op, ins.chunk, ins.microbatch

    mine = schedules[rank]
    order, covers = {}, {}
    for peer in sorted({ins.peer for ins in mine if ins.is_p2p}):
        theirs, at = schedules[peer], batches(schedules[peer])
        their_recvs = [at[i] for i, ins in enumerate(theirs) if ins.op in (RECV_ACT, RECV_GRAD) and ins.peer == rank]
        their_sends = [at[i] for i, ins in enumerate(theirs) if ins.op in (SEND_ACT, SEND_GRAD) and ins.peer == rank]
        my_sends = [ins for ins in mine if ins.op in (SEND_ACT, SEND_GRAD) and ins.peer == peer]
        my_recvs = [ins for ins in mine if ins.op in (RECV_ACT, RECV_GRAD) and ins.peer == peer]
        if len(my_sends) != len(their_recvs) or len(my_recvs) != len(their_sends):
            raise ScheduleError(f"ranks {rank} and {peer} disagree on how many messages they exchange")
        order.update((key(ins), (peer, k)) for k, ins in enumerate(my_sends))
        for recv, sent_at in zip(my_recvs, their_sends):
            covers[key(recv)] = (peer, sum(1 for posted_at in their_recvs if posted_at <= sent_at))
    return SendReceipts(order, covers)


def peak_in_flight(program: list[Instruction]) -> int:
    """Most (microbatch, chunk) forwards whose backward has not run yet: the activations held."""
    live = peak = 0
    for ins in program:
        if ins.op == FORWARD:
            live += 1
            peak = max(peak, live)
        elif ins.op == BACKWARD:
            live -= 1
    return peak


def format_schedule(schedules: list[list[Instruction]]) -> str:
    """One line per rank: `rank 0: F0.0 send_act 0.0 ->1 | ...` (batches in brackets)."""
    lines = []
    for rank, program in enumerate(schedules):
        parts = []
        for item in p2p_batches(program):
            parts.append("[" + ", ".join(map(str, item)) + "]" if isinstance(item, list) else str(item))
        lines.append(f"rank {rank}: " + " ".join(parts))
    return "\n".join(lines)
