"""The one small engine that executes any pipeline instruction list (GPipe, 1F1B, interleaved).

Reduces: per-rank memory (it runs only this rank's stage) and idle time, as far as the schedule it
is given allows; it never decides anything itself.
Costs: activation memory for every micro-batch forwarded but not yet backwarded (the schedule
decides how many), one P2P message per stage boundary per micro-batch in each direction, and a few
microseconds of Python per instruction.

How it runs the list (the simulator models exactly this):
- forward (mb, chunk): the input is the token ids on virtual stage 0, else the received
  activation; the last virtual stage computes the loss sum and keeps loss / divisor for backward.
- backward (mb, chunk): autograd from the kept loss (last stage) or from the kept output with the
  received gradient; the input's gradient is what goes to the previous stage.
- a run of consecutive send/recv instructions is one batch, posted without waiting. Receives are
  waited just before the first op that needs one of them; sends once they have finished (NCCL
  says so), or on gloo, whose sends say nothing until waited, once a message has arrived that
  their receiver posted after their receives (schedules.send_receipts: no stall), else at
  reduce_grads. On gloo sends and receives go out as two batches so a receive never waits
  for a send to a busy neighbour; NCCL needs one group (it serialises separate calls on a stream,
  and two ranks each waiting on a receive queued before its send would hang).
- deferred weight gradients (`defer_weight_grads=True`, see deferred_wgrad.py): each chunk's
  last backward, when the chunk sends a gradient, computes only what the send needs. That
  backward is on the drain's critical path: the previous stage waits on it, then the step ends.
  Its weight gradients are computed later, where they cost nothing: at the first op whose input
  has not arrived yet (the rank would wait anyway), else before reduce_grads; under the latest
  backward's no_sync decision; counted towards their backward's time. The other backwards keep
  the plain (in Python, cheaper) path: in steady state their neighbour has slack. The forward
  of those micro-batches and their backward (recomputation included) run armed. The simulator
  models the same split (OpCosts.weight_fraction; RunStats.weight_s gives the measured share).
- reduce_grads: the caller's reduction (data-parallel all-reduce, tied-embedding sync); every
  backward but this rank's last ran under the caller's `no_sync`, so DP reduces only once.
- optimizer_step: the caller's step, or the end of the run if none was given.
Busy time (forward and backward only) and wall time are recorded per run: the measured bubble.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from meshlm.parallel.pipeline import deferred_wgrad
from meshlm.parallel.pipeline.p2p import PipelineP2P, TensorSpec
from meshlm.parallel.pipeline.schedules import (BACKWARD, FORWARD, OPTIMIZER_STEP, RECV_ACT, RECV_GRAD,
                                                REDUCE_GRADS, SEND_ACT, SEND_GRAD, Instruction, SendReceipts,
                                                p2p_batches)
from meshlm.parallel.pipeline.stage import PipelineStageModel


WEIGHT_GRADS = "weight_grads"  # a timing record's kind: a flush of deferred weight gradients


@dataclass
class RunStats:
    """What one run of the engine measured on this rank (seconds)."""

    loss_sum: torch.Tensor  # float64; the summed token loss on the last stage, 0 elsewhere
    wall_s: float = 0.0  # first instruction to the end of the last backward (and its sends)
    busy_s: float = 0.0  # forwards + backwards
    forward_s: list[float] = field(default_factory=list)  # each forward, in order
    backward_s: list[float] = field(default_factory=list)
    recv_wait_s: list[float] = field(default_factory=list)  # each wait for a received batch
    weight_s: list[float] = field(default_factory=list)  # each flush of deferred weight gradients


class _Clock:
    """Host time on CPU; CUDA events on GPU (host timestamps would only time the launches),
    resolved once at the end of the run."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1000.0
        return b - a


class _SendsInFlight:
    """The sends this rank posted and has not waited, each batch's handle with its sends' numbers
    per peer (SendReceipts.order), and how many of them each peer is known to have received."""

    def __init__(self, receipts: SendReceipts | None, limit: int | None = None):
        self.receipts = receipts
        self.limit = limit  # most batches left unwaited; the oldest is waited beyond it
        self.batches: list[tuple[object, list]] = []
        self.received: dict[int, int] = {}

    def add(self, handle, keys: list[tuple[str, int, int]]) -> None:
        self.batches.append((handle, [self.receipts.order[k] for k in keys] if self.receipts else []))
        while self.limit is not None and len(self.batches) > self.limit:
            self.batches.pop(0)[0].wait()

    def _wait_those(self, done: Callable[[object, list], bool]) -> None:
        """Wait the batches `done(handle, numbers)` says are finished (it costs no stall), drop them."""
        keep = []
        for handle, numbers in self.batches:
            if done(handle, numbers):
                handle.wait()
            else:
                keep.append((handle, numbers))
        self.batches = keep

    def prune(self) -> None:
        """Drop the batches whose sends report completion (NCCL's do; gloo's never do unwaited),
        waited first: free now, and it closes their flight-recorder records, which a hang report
        would otherwise list as pending (the oldest, so blamed first)."""
        self._wait_those(lambda handle, _: handle.is_completed())

    def arrived(self, recv_key: tuple[str, int, int]) -> None:
        """A message arrived: wait (at once, without stalling) the sends its sender has received."""
        cover = self.receipts.covers.get(recv_key) if self.receipts else None
        if cover is None:
            return
        peer, count = cover
        self.received[peer] = max(self.received.get(peer, 0), count)
        self._wait_those(lambda _, numbers: bool(numbers) and all(k < self.received.get(p, 0) for p, k in numbers))

    def wait_all(self) -> None:
        self._wait_those(lambda *_: True)


class PipelineEngine:
    def __init__(self, stage: PipelineStageModel, p2p: PipelineP2P, activation_dtype: torch.dtype = torch.float32,
                 sequence_shards: int = 1, defer_weight_grads: bool = False):
        """`defer_weight_grads`: switch the linear layers of every chunk that sends a gradient
        (all but virtual stage 0) to deferred weight gradients, which this engine flushes."""
        self.stage = stage
        self.p2p = p2p
        # Under sequence parallelism the residual stream between blocks is split along the sequence
        # over tp, so each tp rank sends its 1/tp slice to the same tp rank of the next stage
        # (Megatron does the same): stage boundaries cost 1/tp of the bytes.
        self.sequence_shards = sequence_shards
        self.device = p2p.ctx.device
        self.activation_dtype = activation_dtype
        self.split_sends = p2p.ctx.backend == "gloo"
        self.weight_grads: deferred_wgrad.WeightGradStore | None = None
        if defer_weight_grads:
            store = deferred_wgrad.WeightGradStore()
            switched = sum(deferred_wgrad.defer_weight_grads(module, store) for chunk in range(stage.virtual)
                           if not stage.is_first(chunk) for module in stage.chunk_modules(chunk))
            # tensor-parallel layers keep their own autograd functions: with nothing to defer, no store
            self.weight_grads = store if switched else None

    def run(self, program: Sequence[Instruction], microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
            loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], loss_divisor: float = 1.0,
            autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
            no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
            reduce_grads: Callable[[], None] | None = None, optimizer_step: Callable[[], None] | None = None,
            train: bool = True, receipts: SendReceipts | None = None) -> RunStats:
        """Execute `program` on `microbatches` [(inputs, targets)] (every stage gets them all; the
        first uses the inputs, the last the targets, the others their shape). `receipts`: when
        this rank's sends are known received (schedules.send_receipts), used on gloo."""
        stage, p2p = self.stage, self.p2p
        rows, seq = microbatches[0][0].shape if microbatches else (0, 0)
        spec = TensorSpec((rows, seq // self.sequence_shards, stage.cfg.dim), self.activation_dtype)
        if microbatches:
            p2p.agree(spec)
        last_backward = max((i for i, ins in enumerate(program) if ins.op == BACKWARD), default=-1)
        deferred = self._deferred_backwards(program) if self.weight_grads is not None and train else set()
        def armed(key):  # forwards and backwards of deferred micro-batches take the deferring path
            return self.weight_grads.armed_for() if key in deferred else contextlib.nullcontext()
        stats = RunStats(torch.zeros((), dtype=torch.float64, device=self.device))
        clock = _Clock(self.device)
        inputs: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, mb) -> received activation
        grads: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, mb) -> received gradient
        outputs: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, mb) -> kept for backward
        to_send: dict[tuple[str, int, int], torch.Tensor] = {}
        recv_handle: dict[tuple[str, int, int], object] = {}  # (op, chunk, mb) -> its batch's handle
        # Forward-only (evaluation), the last chunks' sends get no later message from their
        # receiver to show them received: beyond two batches unwaited, the oldest is waited. Safe:
        # the schedules are deadlock-free with blocking sends; cheap: the receiver posts each
        # receive one forward after the last, so a send two batches back has met its receive.
        sends_in_flight = _SendsInFlight(receipts if self.split_sends else None,
                                         limit=2 if self.split_sends and not train else None)
        timed: list[tuple[str, object, object]] = []
        start, end = clock.mark(), None
        index = 0
        grad_mode = torch.enable_grad() if train else torch.no_grad()
        owed_sync: Callable[[], contextlib.AbstractContextManager] | None = None  # weight grads to flush
        owner = n_backward = 0  # which backward (in order) the owed weight gradients belong to
        with grad_mode:
            for item in p2p_batches(program):
                if isinstance(item, list):
                    self._post(item, spec, inputs, grads, to_send, recv_handle, sends_in_flight, train)
                    index += len(item)
                    continue
                ins = item
                if owed_sync is not None and (index == last_backward or not self._input_ready(ins, recv_handle)):
                    # The gradient is on its way and this rank would wait now: fill the wait. And
                    # before the rank's last backward, which syncs: data parallelism's buckets go
                    # on the wire during it, and must already hold what earlier backwards owe.
                    self._flush_weight_grads(owed_sync, timed, clock, owner)
                    owed_sync = None
                if ins.op == FORWARD:
                    key = (ins.chunk, ins.microbatch)
                    x = self._wait(recv_handle, (RECV_ACT, *key), timed, clock, inputs, key, sends_in_flight) \
                        if not stage.is_first(ins.chunk) else microbatches[ins.microbatch][0].to(self.device)
                    t0 = clock.mark()
                    with autocast(), armed(key):
                        out = stage(x, ins.chunk, seq_len=seq)
                    if stage.is_last(ins.chunk):
                        loss = loss_fn(out, microbatches[ins.microbatch][1].to(self.device))
                        stats.loss_sum += loss.detach().double()
                        out = loss / loss_divisor
                        del loss  # its graph holds the stage's input: past the backward, to the next forward
                    elif out.dtype != spec.dtype or tuple(out.shape) != spec.shape:
                        raise RuntimeError(f"chunk {ins.chunk} produced activations of {list(out.shape)} {out.dtype}; "
                                           f"the stages agreed on {spec}")
                    timed.append((FORWARD, t0, clock.mark()))
                    if train:
                        outputs[key] = out
                    if not stage.is_last(ins.chunk):
                        to_send[(SEND_ACT, *key)] = out.detach()
                    if not train:
                        inputs.pop(key, None)
                    del x, out
                elif ins.op == BACKWARD:
                    key = (ins.chunk, ins.microbatch)
                    grad = None if stage.is_last(ins.chunk) else \
                        self._wait(recv_handle, (RECV_GRAD, *key), timed, clock, grads, key, sends_in_flight)
                    out = outputs.pop(key)
                    t0 = clock.mark()
                    sync = no_sync if index != last_backward else contextlib.nullcontext
                    with sync(), armed(key):  # armed: a recomputed forward must match
                        torch.autograd.backward(out, grad_tensors=grad)
                    timed.append((BACKWARD, t0, clock.mark()))
                    if key in deferred:
                        # The latest backward's no_sync decision covers all that is owed: the
                        # rank's last backward makes a flush the last accumulation, so it syncs.
                        owed_sync, owner = sync, n_backward
                    n_backward += 1
                    x = inputs.pop(key, None)
                    if not stage.is_first(ins.chunk):
                        to_send[(SEND_GRAD, *key)] = x.grad
                    grads.pop(key, None)
                    # Held by these names until the next backward, the micro-batch's output,
                    # received gradient and input would live through the forwards between, and
                    # the last ones through the reduction and the optimizer step.
                    del out, grad, x
                elif ins.op == REDUCE_GRADS:
                    sends_in_flight.wait_all()
                    end = clock.mark()
                    if reduce_grads is not None:
                        reduce_grads()
                elif ins.op == OPTIMIZER_STEP:
                    if optimizer_step is not None:
                        optimizer_step()
                index += 1
            if owed_sync is not None:
                self._flush_weight_grads(owed_sync, timed, clock, owner)
        sends_in_flight.wait_all()  # forward-only programs have no reduce_grads
        if end is None:
            end = clock.mark()
        weight_s = []
        for kind, a, b in timed:
            seconds = clock.seconds(a, b)
            if isinstance(kind, tuple):  # (WEIGHT_GRADS, owner): part of the backward that owed them
                weight_s.append((kind[1], seconds))
            else:
                {FORWARD: stats.forward_s, BACKWARD: stats.backward_s}.get(kind, stats.recv_wait_s).append(seconds)
        for owner, seconds in weight_s:
            stats.backward_s[owner] += seconds
            stats.weight_s.append(seconds)
        stats.busy_s = sum(stats.forward_s) + sum(stats.backward_s)
        stats.wall_s = clock.seconds(start, end)
        return stats

    def _deferred_backwards(self, program: Sequence[Instruction]) -> set[tuple[int, int]]:
        """(chunk, micro-batch) of each gradient-sending chunk's last backward in `program`."""
        last = {ins.chunk: ins.microbatch for ins in program if ins.op == BACKWARD}
        return {(chunk, mb) for chunk, mb in last.items() if not self.stage.is_first(chunk)}

    @staticmethod
    def _input_ready(ins: Instruction, recv_handle) -> bool:
        """Whether compute op `ins` can start at once (its received input, if any, has arrived);
        False for every other op, so owed weight gradients are flushed before reductions."""
        if ins.op == FORWARD:
            handle = recv_handle.get((RECV_ACT, ins.chunk, ins.microbatch))
        elif ins.op == BACKWARD:
            handle = recv_handle.get((RECV_GRAD, ins.chunk, ins.microbatch))
        else:
            return False
        return handle is None or handle.is_completed()

    def _flush_weight_grads(self, sync: Callable[[], contextlib.AbstractContextManager], timed, clock,
                            owner: int) -> None:
        t0 = clock.mark()
        with sync():
            self.weight_grads.flush()
        timed.append(((WEIGHT_GRADS, owner), t0, clock.mark()))

    def _post(self, batch: list[Instruction], spec: TensorSpec, inputs, grads, to_send, recv_handle,
              sends_in_flight: _SendsInFlight, train: bool) -> None:
        """Post one batch: allocate the receive buffers, start everything, remember the handles."""
        sends, recvs, sent = [], [], []
        for ins in batch:
            key = (ins.chunk, ins.microbatch)
            if ins.op in (RECV_ACT, RECV_GRAD):
                buffer = self.p2p.empty(spec)
                (inputs if ins.op == RECV_ACT else grads)[key] = buffer
                recvs.append((ins, ("recv", buffer, ins.peer)))
            else:
                tensor = to_send.pop((ins.op, *key))
                sends.append(("send", tensor.contiguous(), ins.peer))
                sent.append((ins.op, *key))
        sends_in_flight.prune()  # finished sends: their buffers can be freed
        if self.split_sends:
            handle = self.p2p.post([op for _, op in recvs]) if recvs else None
            if sends:
                sends_in_flight.add(self.p2p.post(sends), sent)
        else:
            handle = self.p2p.post([op for _, op in recvs] + sends)
            if sends:
                sends_in_flight.add(handle, sent)
        for ins, _ in recvs:
            recv_handle[(ins.op, ins.chunk, ins.microbatch)] = handle

    def _wait(self, recv_handle, handle_key, timed, clock, store, key, sends_in_flight) -> torch.Tensor:
        handle = recv_handle.pop(handle_key, None)
        if handle is None:
            raise RuntimeError(f"{handle_key[0]} {key[1]}.{key[0]}: used before it was received (bad schedule)")
        t0 = clock.mark()
        handle.wait()
        sends_in_flight.arrived(handle_key)
        timed.append(("wait", t0, clock.mark()))
        tensor = store[key]
        if handle_key[0] == RECV_ACT and torch.is_grad_enabled():
            tensor.requires_grad_(True)
        return tensor
