"""The traced communication layer (comm/traced.py): the flight recorder's bounds and summary, GPU
stalls counted as the stream's waits, groups of one, outputs of the wrong size, dtype or stride
refused on every backend, and exact recorded bytes of collectives and point-to-point ops over n
ranks. The cost formulas are in test_comm_cost.py, the ring algorithms in test_comm_ring.py."""

import warnings

import pytest
import torch

from meshlm.comm import P2P, Comm, FlightRecorder
from meshlm.comm.cost import bus_factor
from meshlm.mesh import Layout, ParallelContext
from meshlm.testing import run_ranks


def test_recorder_is_bounded_but_the_summary_counts_everything(tmp_path):
    import json

    rec = FlightRecorder(rank=3, capacity=8)
    for _ in range(20):
        rec.finish(rec.start("all_reduce", "dp", 4, torch.float32, 10, 40, 60, 60))
    hung = rec.start("all_gather", "tp", 2, torch.bfloat16, 8, 16, 8, 8)  # never finished
    assert len(rec.dump()) == 8 and [d["seq"] for d in rec.dump()] == list(range(13, 20)) + [0]
    (row,) = rec.summary()
    assert (row["count"], row["bytes"], row["bytes_sent"]) == (20, 800, 1200)
    (pending,) = rec.pending()
    assert (pending["op"], pending["axis"], pending["dtype"], pending["rank"], pending["t_end"]) == \
        ("all_gather", "tp", "bfloat16", 3, None)
    rec.write(tmp_path / "flight.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "flight.jsonl").read_text().splitlines()]
    assert lines[-1]["op"] == "all_gather" and lines[0]["t_end"] >= lines[0]["t_start"] > 1e9
    assert hung.t_end is None


class _FakeClock:
    """A GPU stream's clock for CUDA-event stand-ins: the test moves it by hand."""
    now = 0.0


class _FakeCudaEvent:
    def __init__(self, enable_timing=False):
        self.t = None
        self.enable_timing = enable_timing

    def record(self):
        self.t = _FakeClock.now

    def synchronize(self):
        pass

    def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event's, which refuses events without timing
        assert self.enable_timing and end.enable_timing, "elapsed_time between events created without enable_timing"
        return (end.t - self.t) * 1e3


def test_gpu_stalls_count_what_the_stream_waited_not_what_overlapped(monkeypatch):
    """On NCCL the host does not block: the exposed communication is the time the stream stood still,
    from the op's issue (synchronous op) or from the handle's wait (async op) to the op's end."""
    from meshlm.comm import traced

    monkeypatch.setattr(traced.torch.cuda, "Event", _FakeCudaEvent)
    rec = FlightRecorder()

    def issue(async_op):
        record = rec.start("all_reduce", "dp", 2, torch.bfloat16, 8, 16, 16, 16, async_op=async_op)
        record.cuda_events = (_FakeCudaEvent(enable_timing=True), _FakeCudaEvent(enable_timing=True))
        record.cuda_events[0].record()
        return record

    class Work:  # the wait: the stream stands still until the op's end
        def __init__(self, seconds):
            self.seconds = seconds

        def wait(self):
            _FakeClock.now += self.seconds

    _FakeClock.now = 100.0
    handle = traced.Handle([Work(0.010)], [issue(async_op=True)], rec)
    _FakeClock.now += 0.030  # backward ran 30 ms under the op: hidden
    handle.wait()
    sync = issue(async_op=False)
    _FakeClock.now += 0.005  # a synchronous op: all of it exposed
    sync.cuda_events[1].record()
    rec.finish(sync)
    # One handle for a send and a receive (ring attention's hop): one stall of 2 ms, not two.
    pair = traced.Handle([Work(0.001), Work(0.001)], [issue(async_op=True), issue(async_op=True)], rec)
    pair.wait()
    assert rec.blocked_s == 0  # on GPUs the host's waits are inside the stalls
    assert rec.settle() == pytest.approx(0.017)
    assert rec.settle() == pytest.approx(0.017) and rec._unresolved == []  # read once
    assert sum(row["time_s"] for row in rec.summary()) == pytest.approx(0.045 + 2 * 0.002)  # the ops' durations


@pytest.mark.parametrize("async_op", [False, True])
def test_groups_of_one_rank_communicate_nothing_and_record_nothing(async_op):
    """Every op on a group of one: the input is the result (copied where the output is another
    buffer, before or after it in memory), a handle where one was asked for, nothing recorded."""
    comm = Comm(ParallelContext(Layout()))  # world of 1, no process group
    x = torch.arange(4.0)
    done = comm.all_reduce(x, "dp", async_op=async_op)
    assert torch.equal(x, torch.arange(4.0))
    done = [done, comm.broadcast(x, 0, "dp", async_op=async_op)]
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        for out_first in (True, False):  # output below the input in memory, and above it
            memory = torch.zeros(8)
            out, inp = (memory[:4], memory[4:]) if out_first else (memory[4:], memory[:4])
            inp.copy_(torch.arange(4.0) + 1)
            done.append(getattr(comm, op)(out, inp, "tp", async_op=async_op))
            assert torch.equal(out, torch.arange(4.0) + 1), (op, out_first)
    comm.barrier("tp")
    if async_op:
        for handle in done:
            handle.wait()
    else:
        assert done == [None] * len(done)
    assert comm.summary() == [] and comm.recorder.dump() == []


def test_collectives_refuse_outputs_of_the_wrong_size_by_name():
    comm = Comm(ParallelContext(Layout()))
    for numel in (3, 5):  # one element short, one too many
        with pytest.raises(ValueError, match=rf"all_gather over tp \(n=1\): output has {numel} elements, expected 1 x 4"):
            comm.all_gather(torch.empty(numel), torch.ones(4), "tp")
        with pytest.raises(ValueError, match=rf"reduce_scatter over tp \(n=1\): input has {numel} elements, expected 1 x 4"):
            comm.reduce_scatter(torch.empty(4), torch.ones(numel), "tp")


def _mismatched_dtypes_rank(n):
    """Every rank passes an output of another dtype: refused alike on every rank, before any rank
    communicates (NCCL refuses it; gloo, the shared-memory window and the one-rank copy cast)."""
    comm = Comm(ParallelContext(Layout(dp=n)))
    errors = []
    for op, out, inp in (("all_gather", torch.empty(4 * n, dtype=torch.bfloat16), torch.ones(4)),
                         ("reduce_scatter", torch.empty(4), torch.ones(4 * n, dtype=torch.bfloat16)),
                         ("all_to_all", torch.empty(2 * n, dtype=torch.float64), torch.ones(2 * n))):
        with pytest.raises(ValueError, match=rf"{op} over dp: output is torch\.\w+, input torch\.\w+") as caught:
            getattr(comm, op)(out, inp, "dp")
        errors.append(str(caught.value))
    return errors, comm.summary()


@pytest.mark.parametrize("n", [1, 2])
def test_collectives_refuse_an_output_of_another_dtype_on_every_backend(n):
    for errors, summary in run_ranks(_mismatched_dtypes_rank, n, n, timeout=60):
        assert errors[0] == "all_gather over dp: output is torch.bfloat16, input torch.float32 (must be the same)"
        assert summary == []


def _strided_rank(n):
    ctx = ParallelContext(Layout(dp=n))
    comm = Comm(ctx)
    base = torch.arange(8.0) + 100 * ctx.rank
    column = base.view(4, 2)[:, 0]  # elements 0, 2, 4, 6 of base
    errors = []
    for op, call in (("all_reduce", lambda: comm.all_reduce(column, "dp")),
                     ("broadcast", lambda: comm.broadcast(column, 0, "dp"))):
        with pytest.raises(ValueError, match=rf"{op} over dp: the tensor is a strided view") as caught:
            call()
        errors.append(str(caught.value))
    transposed = (torch.arange(6.0) + ctx.rank).view(2, 3).t()  # dense in another order: fine
    comm.all_reduce(transposed, "dp")
    return errors, base.tolist(), transposed.tolist()


@pytest.mark.parametrize("n", [1, 2])
def test_a_strided_view_is_refused_not_reduced_beside_its_elements(n):
    """gloo reads and writes numel elements from a strided view's first: a column of a [4, 2]
    tensor came back with its neighbours' sums written into the other column. NCCL refuses it;
    so does Comm, on every backend, before anything is written."""
    for rank, (errors, base, transposed) in enumerate(run_ranks(_strided_rank, n, n, timeout=60)):
        assert errors[0] == ("all_reduce over dp: the tensor is a strided view (shape [4], stride [2]); pass a "
                             "contiguous copy and copy the result back")
        assert base == [float(i + 100 * rank) for i in range(8)]
        assert transposed == [[n * i + sum(range(n)) + 0.0 for i in (j, j + 3)] for j in range(3)]


# --------------------------------------------------------------------------- traced collectives (n ranks)


def _traced_rank(n):
    ctx = ParallelContext(Layout(dp=n))
    comm = Comm(ctx)
    r = ctx.rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = torch.full((1000,), float(r + 1))
        comm.all_reduce(a, "dp")
        assert torch.equal(a, torch.full((1000,), n * (n + 1) / 2))
        b = torch.arange(1001.0) * (r + 1)  # not divisible by n
        comm.all_reduce(b, "dp")
        assert torch.equal(b, torch.arange(1001.0) * n * (n + 1) / 2)
        gathered = torch.empty(250 * n)
        comm.all_gather(gathered, torch.full((250,), float(r)), "dp")
        assert torch.equal(gathered, torch.arange(n).float().repeat_interleave(250))
        part = torch.empty(250)
        comm.reduce_scatter(part, torch.arange(250.0 * n) * (r + 1), "dp")
        assert torch.equal(part, torch.arange(250.0 * r, 250.0 * (r + 1)) * n * (n + 1) / 2)
        out = torch.empty(3 * n)
        comm.all_to_all(out, torch.arange(3.0 * n) + 100 * r, "dp")
        assert torch.equal(out, torch.cat([torch.arange(3.0 * r, 3.0 * r + 3) + 100 * j for j in range(n)]))
        c = torch.full((10,), float(r))
        comm.broadcast(c, src=n - 1, axis="dp")
        assert torch.equal(c, torch.full((10,), float(n - 1)))
        got = torch.empty(16)
        comm.batch_isend_irecv([P2P("send", torch.full((16,), float(r)), (r + 1) % n),
                                P2P("recv", got, (r - 1) % n)], axis="dp").wait()
        assert torch.equal(got, torch.full((16,), float((r - 1) % n)))
        z = torch.ones(64)
        handle = comm.all_reduce(z, "dp", async_op=True)
        pending = [d["op"] for d in comm.recorder.pending()]
        handle.wait()
        handle.wait()  # twice is harmless and counted once
        assert pending == ["all_reduce"] and comm.recorder.pending() == []
        assert torch.equal(z, torch.full((64,), float(n)))
        comm.barrier()
    return {"summary": comm.summary(), "seq": comm.recorder.sequence_numbers(),
            "warnings": [str(w.message) for w in caught], "table": comm.format_summary()}


@pytest.mark.parametrize("n", [3, 4])
def test_traced_collectives_record_exact_bytes(n):
    results = run_ranks(_traced_rank, n, n, timeout=60)
    for rank, out in enumerate(results):
        assert out["warnings"] == []  # the non-deprecated tensor collectives of torch 2.13
        rows = {(row["op"], row["axis"]): row for row in out["summary"]}
        assert set(rows) == {("all_reduce", "dp"), ("all_gather", "dp"), ("reduce_scatter", "dp"),
                             ("all_to_all", "dp"), ("broadcast", "dp"), ("send", "dp"), ("recv", "dp"),
                             ("barrier", "world")}
        ar, ag, rs, a2a = (rows[(op, "dp")] for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"))
        assert (ar["count"], ar["bytes"], ar["group_size"]) == (3, 4000 + 4004 + 256, n)
        S = 250 * n * 4  # the gathered output / the input before scattering
        assert ag["bytes_sent"] == ag["bytes_recv"] == (n - 1) * S // n and ag["bytes"] == S
        assert rs["bytes_sent"] == rs["bytes_recv"] == (n - 1) * S // n and rs["bytes"] == S
        assert a2a["bytes_sent"] == a2a["bytes_recv"] == (n - 1) * (3 * n * 4) // n
        assert rows[("send", "dp")]["bytes_sent"] == rows[("recv", "dp")]["bytes_recv"] == 64
        for row in out["summary"]:
            if row["time_s"] > 0 and row["op"] != "barrier":
                assert row["busbw"] == pytest.approx(row["algbw"] * bus_factor(row["op"], row["group_size"]))
                assert row["algbw"] == pytest.approx(row["bytes"] / row["time_s"])
        assert out["seq"]["dp"] == 7 and out["seq"]["world"] == 1  # 7 collectives on dp, one barrier
        assert "all_reduce" in out["table"]
    # The ring formula over all ranks, including the 1001-element tensor that n does not divide.
    sent = [next(row["bytes_sent"] for row in o["summary"] if row["op"] == "all_reduce") for o in results]
    assert sum(sent) == 2 * (n - 1) * (4000 + 4004 + 256)


def _p2p_and_merged_rank():
    """Blocking and async sends and receives between two ranks, two async ops behind one merged
    handle, an uneven all-to-all, a desynchronised all-reduce: each record's kind, bytes each way
    and completion."""
    from meshlm.comm.traced import Handle

    comm = Comm(ParallelContext(Layout(dp=2)))
    r, peer = comm.rank, 1 - comm.rank
    got = torch.empty(8)
    if r == 0:
        comm.send(torch.full((8,), 1.0), peer)
        comm.recv(got, peer)
    else:
        comm.recv(got, peer)
        comm.send(torch.full((8,), 2.0), peer)
    blocking = torch.equal(got, torch.full((8,), float(peer + 1)))
    got2 = torch.empty(16)
    handles = [comm.isend(torch.full((16,), float(r)), peer), comm.irecv(got2, peer)]
    pending = len(comm.recorder.pending())
    for h in handles:
        h.wait()
    a, b = torch.ones(32), torch.full((32,), float(r))
    merged = Handle.merge([comm.all_reduce(a, "dp", async_op=True), comm.all_reduce(b, "dp", async_op=True)])
    merged.wait()
    # Uneven rows of 5 elements: rank 0 keeps 1 row and sends 2, rank 1 sends 3 and keeps 1.
    ins, outs = ([1, 2], [1, 3]) if r == 0 else ([3, 1], [2, 1])
    mixed = torch.empty(sum(outs), 5)
    comm.all_to_all(mixed, torch.full((sum(ins), 5), float(r)), "dp", outs, ins)
    ok = torch.equal(mixed[outs[0]:] if r == 0 else mixed[:outs[0]], torch.full((outs[peer], 5), float(peer)))
    # debug.fault=desync on a bf16 all-reduce: rank 0 sends the same 12 bytes as int16 (debug/faults.py)
    comm.desync_next = r == 0
    comm.all_reduce(torch.ones(6, dtype=torch.bfloat16), "dp")
    comm.barrier()
    ok = ok and blocking and torch.equal(got2, torch.full((16,), float(peer))) and torch.equal(a, torch.full((32,), 2.0)) \
        and torch.equal(b, torch.ones(32))
    records = [(d["op"], d["async_op"], d["numel"], d["bytes_sent"], d["bytes_recv"], d["t_end"] is not None)
               for d in comm.recorder.dump()]
    return ok, pending, records, [d["dtype"] for d in comm.recorder.dump()], comm.recorder.pending()


def test_point_to_point_records_and_merged_handles_complete():
    for rank, (ok, pending, records, dtypes, left) in enumerate(run_ranks(_p2p_and_merged_rank, 2, timeout=60)):
        assert ok and pending == 2 and left == []
        blocking = [("send", False, 8, 32, 0, True), ("recv", False, 8, 0, 32, True)]
        assert records == [*(blocking if rank == 0 else blocking[::-1]),
                           ("send", True, 16, 64, 0, True), ("recv", True, 16, 0, 64, True),
                           ("all_reduce", True, 32, 128, 128, True), ("all_reduce", True, 32, 128, 128, True),
                           ("all_to_all", False, *((15, 40, 60) if rank == 0 else (20, 60, 40)), True),
                           ("all_reduce", False, 6, 12, 12, True), ("barrier", False, 0, 0, 0, True)]
        assert dtypes[-2] == ("int16" if rank == 0 else "bfloat16")
