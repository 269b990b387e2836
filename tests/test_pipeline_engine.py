"""The pipeline engine's own contract, which a "same numbers as one process" test cannot see:
where the data-parallel reduction may overlap (only the rank's last backward outside `no_sync`),
that reduce_grads and the optimizer step run once, in that order, after every send finished; how
sends and receives are batched on gloo and on NCCL; what the run's timings add up to; which op
can start without waiting; and how a bad schedule or stage is named."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from meshlm.parallel.pipeline.engine import PipelineEngine, _Clock
from meshlm.parallel.pipeline.schedules import (BACKWARD, FORWARD, OPTIMIZER_STEP, RECV_ACT, RECV_GRAD, REDUCE_GRADS,
                                                SEND_ACT, Instruction)
from meshlm.testing import RankFailure, run_ranks
from tests.helpers import pp2_engine, pp2_microbatches

MICROBATCHES = 4


class _RecordedHandle:
    """A posted batch's handle that records when the engine learns it finished."""

    def __init__(self, handle, events: list, posted: int) -> None:
        self.handle, self.events, self.posted = handle, events, posted

    def is_completed(self) -> bool:
        done = self.handle.is_completed()
        if done:
            self.events.append(("done", self.posted))
        return done

    def wait(self) -> None:
        self.handle.wait()
        self.events.append(("done", self.posted))


def _recorded_run(kind: str, nccl_batching: bool = False):
    """One training run of `kind` at pp=2 on this rank: the engine's calls, in order."""
    import torch.distributed as dist

    from meshlm.model.loss import token_loss_sum
    from meshlm.parallel.pipeline.schedules import build_schedule

    rank = dist.get_rank()
    engine, stage = pp2_engine()
    if nccl_batching:
        engine.split_sends = False
    events, state = [], {"no_sync": False}
    post = engine.p2p.post

    def recorded_post(ops):
        events.append(("post", sorted({k for k, _, _ in ops})))
        return _RecordedHandle(post(ops), events, len(events) - 1)

    engine.p2p.post = recorded_post

    @contextlib.contextmanager
    def no_sync():
        state["no_sync"] = True
        try:
            yield
        finally:
            state["no_sync"] = False

    # Every backward accumulates into this stage's last parameter: record whether it was synced.
    last_param = [p for p in stage.parameters()][-1]
    last_param.register_post_accumulate_grad_hook(lambda p: events.append(("grad", state["no_sync"])))
    program = build_schedule(kind, 2, MICROBATCHES, 1)[rank]
    stats = engine.run(program, pp2_microbatches(MICROBATCHES), loss_fn=token_loss_sum, loss_divisor=64.0,
                       no_sync=no_sync,
                       reduce_grads=lambda: events.append(("reduce",)),
                       optimizer_step=lambda: events.append(("step",)))
    dist.barrier()
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    counts = {op: sum(ins.op == op for ins in program) for op in (FORWARD, BACKWARD, RECV_ACT, RECV_GRAD)}
    return events, stats, grads, counts


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_only_the_last_backward_syncs_then_reduce_and_step_run_once_after_every_send(kind):
    for events, stats, _, counts in run_ranks(_recorded_run, 2, kind, timeout=60):
        synced = [e[1] for e in events if e[0] == "grad"]
        assert synced == [True] * (counts[BACKWARD] - 1) + [False]  # DP overlaps the last backward only
        tail = [e for e in events if e[0] in ("reduce", "step")]
        assert tail == [("reduce",), ("step",)]
        reduce = events.index(("reduce",))
        assert reduce > max(i for i, e in enumerate(events) if e[0] in ("post", "grad"))
        sends = {i for i, e in enumerate(events) if e[0] == "post" and "send" in e[1]}
        assert sends and sends <= {e[1] for e in events[:reduce] if e[0] == "done"}  # the step's wall time ends here


def test_timings_add_up_and_count_every_op_and_wait():
    for _, stats, _, counts in run_ranks(_recorded_run, 2, "1f1b", timeout=60):
        assert len(stats.forward_s) == counts[FORWARD] and len(stats.backward_s) == counts[BACKWARD]
        assert len(stats.recv_wait_s) == counts[RECV_ACT] + counts[RECV_GRAD] == MICROBATCHES
        assert stats.busy_s == pytest.approx(sum(stats.forward_s) + sum(stats.backward_s), rel=1e-12)
        assert 0 < stats.busy_s <= stats.wall_s
        assert not stats.weight_s


def test_gloo_posts_receives_apart_from_sends_and_the_nccl_batching_computes_the_same():
    split = run_ranks(_recorded_run, 2, "1f1b", timeout=60)
    together = run_ranks(_recorded_run, 2, "1f1b", True, timeout=60)
    for (events, *_), (joined, *_) in zip(split, together):
        posts = [e[1] for e in events if e[0] == "post"]
        assert posts and all(len(kinds) == 1 for kinds in posts)  # a receive never waits on a send
        assert any(len(e[1]) == 2 for e in joined if e[0] == "post")
    for (_, a, grads, _), (_, b, same, _) in zip(split, together):
        assert a.loss_sum.item() == b.loss_sum.item()
        assert all(torch.equal(grads[n], same[n]) for n in grads)


class _CountingClock:
    """Each mark one tick later than the last: every timed op lasts exactly one tick, so what the
    engine adds up can be compared exactly."""

    def __init__(self, device) -> None:
        self.now = 0

    def mark(self) -> int:
        self.now += 1
        return self.now

    def seconds(self, a: int, b: int) -> float:
        return float(b - a)


def _counted_run(defer: bool):
    import torch.distributed as dist

    import meshlm.parallel.pipeline.engine as engine_module
    from meshlm.model.loss import token_loss_sum
    from meshlm.parallel.pipeline.schedules import build_schedule

    engine_module._Clock = _CountingClock  # the forked rank's own copy of the module
    engine, _ = pp2_engine(defer)
    stats = engine.run(build_schedule("1f1b", 2, MICROBATCHES, 1)[dist.get_rank()], pp2_microbatches(MICROBATCHES),
                       loss_fn=token_loss_sum)
    dist.barrier()
    return stats


@pytest.mark.parametrize("defer", [False, True])
def test_each_op_is_timed_once_and_deferred_weight_gradients_count_toward_the_backward_that_owed_them(defer):
    first, last = run_ranks(_counted_run, 2, defer, timeout=60)
    for stats in (first, last):
        assert stats.forward_s == [1.0] * MICROBATCHES and stats.recv_wait_s == [1.0] * MICROBATCHES
        assert stats.busy_s == sum(stats.forward_s) + sum(stats.backward_s)
    assert first.backward_s == [1.0] * MICROBATCHES and not first.weight_s  # stage 0 sends no gradient
    # The last stage defers its last backward's weight gradients: one flush, one tick, owed by it.
    assert last.backward_s == [1.0] * (MICROBATCHES - 1) + [2.0 if defer else 1.0]
    assert last.weight_s == ([1.0] if defer else [])
    # Wall time: the first mark to the one before reduce_grads (each op two marks, each wait two).
    assert last.wall_s == 2 * (2 * MICROBATCHES + MICROBATCHES + defer) + 1


def _bad_program(kind: str):
    import torch.distributed as dist

    from meshlm.model.loss import token_loss_sum

    engine, stage = pp2_engine()
    if kind == "unreceived":  # the last stage forwards micro-batch 1 without receiving its activation
        program = [Instruction(FORWARD, 1, 0)] if dist.get_rank() == 1 else []
    else:  # the first stage's output is longer than the sequence the stages agreed on
        forward = stage.forward
        stage.forward = lambda x, chunk, seq_len: torch.cat([forward(x, chunk, seq_len=seq_len)] * 2, dim=1)
        program = [Instruction(FORWARD, 0, 0)] if dist.get_rank() == 0 else []
    engine.run(program, pp2_microbatches(MICROBATCHES), loss_fn=token_loss_sum)


@pytest.mark.parametrize("kind,message", [
    ("unreceived", r"recv_act 1\.0: used before it was received"),
    ("long", r"chunk 0 produced activations of \[1, 32, 64\] torch.float32; the stages agreed on"),
])
def test_a_bad_schedule_or_stage_is_named_instead_of_hanging(kind, message):
    with pytest.raises(RankFailure, match=message):
        run_ranks(_bad_program, 2, kind, timeout=60)


@pytest.mark.parametrize("backend,split", [("gloo", True), ("nccl", False), ("mpi", False)])
def test_only_gloo_posts_receives_and_sends_as_separate_batches(backend, split):
    ctx = SimpleNamespace(device=torch.device("cpu"), backend=backend)
    assert PipelineEngine(None, SimpleNamespace(ctx=ctx)).split_sends is split


class _Handle:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def test_an_op_is_ready_when_its_own_input_has_arrived():
    ready = PipelineEngine._input_ready
    arrived, on_its_way = _Handle(True), _Handle(False)
    handles = {(RECV_ACT, 0, 1): on_its_way, (RECV_GRAD, 0, 1): arrived, (RECV_GRAD, 0, 2): on_its_way}
    assert not ready(Instruction(FORWARD, 1, 0), handles)
    assert ready(Instruction(BACKWARD, 1, 0), handles)
    assert not ready(Instruction(BACKWARD, 2, 0), handles)
    assert ready(Instruction(FORWARD, 3, 0), handles)  # nothing to receive (first stage, or posted later)
    assert not ready(Instruction(REDUCE_GRADS), handles)  # owed weight gradients go before reductions
    assert not ready(Instruction(OPTIMIZER_STEP), handles)
    assert not ready(Instruction(SEND_ACT, 1, 0, peer=1), handles)


def test_a_send_dropped_as_finished_is_waited_so_its_record_closes():
    """NCCL reports a send finished without a wait; dropped unwaited, its flight-recorder record
    stayed pending for ever, and a hang report blamed that old, finished send first."""
    from meshlm.comm.recorder import FlightRecorder
    from meshlm.comm.traced import Handle
    from meshlm.parallel.pipeline.engine import _SendsInFlight

    recorder = FlightRecorder(0)
    record = recorder.start("send", "pp", 2, torch.float32, 10, 40, 40, 0, peer=1, async_op=True, channel="send->1")
    finished = SimpleNamespace(is_completed=lambda: True, wait=lambda: True)
    sends = _SendsInFlight(receipts=None)
    sends.add(Handle([finished], [record], recorder), [])
    sends.prune()
    assert sends.batches == [] and recorder.pending() == []


def test_the_cuda_clock_converts_event_milliseconds_to_seconds():
    clock = _Clock(torch.device("cuda"))  # constructing it touches no GPU
    start = SimpleNamespace(elapsed_time=lambda end: end.ms)
    end = SimpleNamespace(ms=1500.0, synchronize=lambda: None)
    assert clock.seconds(start, end) == 1.5
    assert _Clock(torch.device("cpu")).seconds(1.0, 3.5) == 2.5
