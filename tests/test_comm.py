import os
import warnings

import pytest
import torch
import torch.distributed as dist

from meshlm.comm import P2P, Comm, FlightRecorder
from meshlm.comm.cost import HARDWARE, Link, Topology, bus_factor, fit_alpha_beta, load_profile, op_time, rank_traffic, save_profile, steps
from meshlm.mesh import Layout, ParallelContext
from meshlm.testing import run_ranks

# --------------------------------------------------------------------------- formulas (no processes)


def test_bus_factors_and_steps_are_the_ring_formulas():
    n = 4
    assert (steps("all_reduce", n), bus_factor("all_reduce", n)) == (6, 1.5)  # 2(n-1), 2(n-1)/n
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert (steps(op, n), bus_factor(op, n)) == (3, 0.75)  # n-1, (n-1)/n
    assert (steps("broadcast", n), bus_factor("broadcast", n)) == (3, 1.0)
    assert (steps("p2p", 2), bus_factor("p2p", 2)) == (1, 1.0)
    assert bus_factor("all_reduce", 1) == 0 and steps("all_gather", 1) == 0


@pytest.mark.parametrize("n", range(1, 10))
def test_per_rank_traffic_equals_the_formulas_exactly(n):
    for numel in (1, max(1, n - 1), n, 7 * n + 3, 1000, 4096):
        S = numel * 4
        per_rank = {op: [rank_traffic(op, n, r, numel, 4) for r in range(n)]
                    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")}
        # Every byte sent is received; over the group, the totals are the ring's.
        for op, factor in (("all_reduce", 2 * (n - 1)), ("all_gather", n - 1), ("reduce_scatter", n - 1),
                           ("broadcast", n - 1)):
            assert sum(s for s, _ in per_rank[op]) == sum(r for _, r in per_rank[op]) == factor * S, (op, n, numel)
        if numel % n == 0:  # then every rank carries exactly its share: 2(n-1)/n * S and (n-1)/n * S
            assert all(t == (2 * (n - 1) * S // n,) * 2 for t in per_rank["all_reduce"])
            assert all(t == ((n - 1) * S // n,) * 2 for t in per_rank["all_gather"] + per_rank["reduce_scatter"])
            assert all(rank_traffic("all_to_all", n, r, numel, 4) == ((n - 1) * S // n,) * 2 for r in range(n))
    assert rank_traffic("broadcast", 4, 2, 10, 4, root=2) == (40, 0)  # the root only sends
    assert rank_traffic("broadcast", 4, 1, 10, 4, root=2) == (0, 40)  # the chain's last only receives


def test_topology_tiers_a_group_spanning_nodes_runs_at_the_slower_tier():
    h100 = HARDWARE["h100"]
    S = 2**30
    assert h100.link(range(8)) == h100.intra  # a tp group inside one node
    assert h100.link([0, 8]) == Link(h100.inter.alpha_s, h100.inter.bandwidth_Bps)  # dp across nodes
    assert h100.time("all_reduce", S, 8) == pytest.approx(14 * 2e-6 + 1.75 * S / 450e9, rel=1e-12)
    assert h100.time("all_reduce", S, 16) == pytest.approx(30 * 6e-6 + (30 / 16) * S / 50e9, rel=1e-12)
    mixed = Topology("t", 2, intra=Link(1e-6, 100e9), inter=Link(5e-6, 200e9))
    assert mixed.link([0, 2]) == Link(5e-6, 100e9)  # slower on both terms
    for name in ("h100", "a100", "pcie", "cpu-loopback", "cpu-shm"):
        assert HARDWARE[name].time("all_gather", 2**20, 4) > 0
    # Bandwidth dominates large messages: time grows with S almost linearly.
    t1, t2 = op_time("all_reduce", 2**26, 8, h100.intra), op_time("all_reduce", 2**27, 8, h100.intra)
    assert 1.9 < t2 / t1 < 2.0


def test_every_preset_is_of_its_hardwares_order_of_magnitude():
    """A typo in a preset (8e-6 s as 8e-3, a bandwidth off by 1000) would skew every plan made
    with it: per-step latencies between 1 us and 1 ms, bandwidths between 0.1 and 1000 GB/s, the
    tier inside a node never slower than the one between nodes."""
    for topology in HARDWARE.values():
        for link in [topology.intra, topology.inter, *topology.op_links.values()]:
            assert 1e-6 <= link.alpha_s <= 1e-3 and 1e8 <= link.bandwidth_Bps <= 1e12, (topology.name, link)
        assert topology.intra.alpha_s <= topology.inter.alpha_s, topology.name
        assert topology.intra.bandwidth_Bps >= topology.inter.bandwidth_Bps, topology.name


def test_fit_recovers_alpha_and_beta_and_shrugs_off_an_outlier():
    sizes = [2**k for k in range(10, 27)]
    truth = Link(alpha_s=80e-6, bandwidth_Bps=1.2e9)
    times = [op_time("all_reduce", s, 4, truth) for s in sizes]
    fit = fit_alpha_beta("all_reduce", 4, sizes, times)
    assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6)
    assert fit.bandwidth_Bps == pytest.approx(truth.bandwidth_Bps, rel=1e-6)
    # Stalls on a noisy machine: least absolute deviation passes through the clean points, so the
    # fit is still the truth (to the IRLS floor); least squares, or IRLS stopped after a step or
    # two, lands 2-4% off.
    for stalled in ([5], [3, 9, 14]):
        noisy = [t * 6 if i in stalled else t for i, t in enumerate(times)]
        fit = fit_alpha_beta("all_reduce", 4, sizes, noisy)
        assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=1e-4), stalled
        assert fit.bandwidth_Bps == pytest.approx(truth.bandwidth_Bps, rel=1e-4), stalled


def test_times_that_do_not_grow_with_the_size_are_all_latency():
    """Small messages on a noisy machine can even get faster with size: the free fit's bandwidth
    term comes out negative, is dropped, and the latency-only fit (alpha the time per step, the
    bandwidth infinite) beats the bandwidth-only one."""
    sizes = [2**k for k in range(10, 21)]
    times = [6 * 80e-6 * (1 - 0.001 * i) for i in range(len(sizes))]  # all_reduce over 4: 6 steps
    fit = fit_alpha_beta("all_reduce", 4, sizes, times)
    assert fit.bandwidth_Bps == float("inf") and fit.alpha_s == pytest.approx(80e-6, rel=0.01)


@pytest.mark.parametrize("op", ["all_scatter", "all_reduce_coalesced", "allreduce", "gather", "send_recv"])
def test_an_unknown_op_is_refused_by_every_formula(op):
    """Not priced as the nearest known op: names that sort between the known ones included."""
    for formula in (lambda: steps(op, 4), lambda: bus_factor(op, 4), lambda: rank_traffic(op, 4, 0, 64, 4)):
        with pytest.raises(ValueError, match=repr(op)):
            formula()


def test_profile_round_trips(tmp_path):
    topo = Topology("m", 2, Link(1e-4, 1e9), Link(2e-4, 5e8), op_links={"all_reduce": Link(3e-4, 7e8)}, note="x")
    save_profile(topo, tmp_path / "p.json", fit_median_rel_err_ge_64KiB=0.1)
    assert load_profile(tmp_path / "p.json") == topo


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


# --------------------------------------------------------------------------- ring algorithms


def _assert_close(actual, expected):
    # torch.testing.assert_close's float32 tolerances, without its import of DTensor and sympy,
    # which costs each forked rank ~3 s. Summation order differs between ring and library.
    assert actual.shape == expected.shape and torch.allclose(actual, expected, rtol=1.3e-6, atol=1e-5), \
        (actual - expected).abs().max()


def _ring_sizes(n):  # fewer elements than ranks, sizes n does not divide, sizes it divides
    return sorted({1, n - 1, 7 * n + 3, 8 * n, 1000})


def _ring_rank(n):
    from meshlm.comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter

    ctx = ParallelContext(Layout(dp=n))
    r = ctx.rank
    counts = {}
    for numel in _ring_sizes(n):
        g = torch.Generator().manual_seed(1000 * r + numel)
        x = torch.randn(numel, generator=g)
        # The library all_reduce goes through the traced layer too, so its recorded bytes (the
        # formula) can be compared with the bytes the ring really sent, counted on its P2P ops.
        ring_comm, lib_comm = Comm(ctx), Comm(ctx)
        lib = x.clone()
        lib_comm.all_reduce(lib, "dp")
        _assert_close(ring_all_reduce(ring_comm, x.clone(), "dp"), lib)
        rows = {row["op"]: row for row in ring_comm.summary()}
        (lib_row,) = lib_comm.summary()
        counts[numel] = (rows["send"]["bytes_sent"] if rows else 0, rows["recv"]["bytes_recv"] if rows else 0,
                         lib_row["bytes_sent"], lib_row["bytes_recv"], rows["send"]["count"] if rows else 0)

        mine = ring_reduce_scatter(Comm(ctx), x, "dp")
        _assert_close(mine, lib.tensor_split(n)[r])
        if numel % n == 0:
            lib_part = torch.empty(numel // n)
            dist.reduce_scatter_single(lib_part, x)
            _assert_close(mine, lib_part)
            lib_all = torch.empty(numel)
            dist.all_gather_single(lib_all, x[: numel // n].contiguous())
            assert torch.equal(ring_all_gather(Comm(ctx), x[: numel // n], "dp"), lib_all)
    xi = torch.randint(-1000, 1000, (7 * n + 3,), generator=torch.Generator().manual_seed(r))
    lib_i = xi.clone()
    dist.all_reduce(lib_i)
    assert torch.equal(ring_all_reduce(Comm(ctx), xi.clone(), "dp"), lib_i)  # integers: exactly equal
    strided = xi[: 3 * (n + 1)].clone().view(3, n + 1).t()  # not contiguous: reduced in place all the same
    lib_strided = strided.contiguous()
    dist.all_reduce(lib_strided)
    assert ring_all_reduce(Comm(ctx), strided, "dp") is strided and torch.equal(strided, lib_strided)
    for wrong in (r + 2, r):  # a sizes list that disagrees with this rank's chunk, either way
        with pytest.raises(ValueError, match=rf"sizes\[{r}\] = {wrong} but"):
            ring_all_gather(Comm(ctx), torch.zeros(r + 1), "dp", [wrong] * n)
    sizes = [i + 1 for i in range(n)]  # uneven chunks: rank i contributes i+1 elements
    gathered = ring_all_gather(Comm(ctx), torch.full((sizes[r],), float(r)), "dp", sizes)
    assert torch.equal(gathered, torch.cat([torch.full((s,), float(i)) for i, s in enumerate(sizes)]))
    return counts


@pytest.mark.parametrize("n", range(2, 9))
def test_ring_algorithms_equal_the_library_collectives(n):
    results = run_ranks(_ring_rank, n, n, timeout=120)
    for counts in results:
        ring_sent, ring_recv, lib_sent, lib_recv, sends = counts[8 * n]
        assert ring_sent == ring_recv == lib_sent == lib_recv == 2 * (n - 1) * (8 * n * 4) // n
        assert sends == 2 * (n - 1)  # 2(n-1) steps, one message each
        for numel in _ring_sizes(n):
            ring_sent, ring_recv, lib_sent, lib_recv, _ = counts[numel]
            assert (ring_sent, ring_recv) == (lib_sent, lib_recv)
    for numel in _ring_sizes(n):  # over the group: 2(n-1) * S whatever the chunking
        assert sum(c[numel][0] for c in results) == 2 * (n - 1) * numel * 4


# --------------------------------------------------------------------------- gloo's rings


def _gloo_rings_rank(n):
    from meshlm.comm import traced

    os.environ["MESHLM_SHM_DISABLE"] = "1"  # the rings are what runs across hosts; here all ranks share one
    ctx = ParallelContext(Layout(dp=n))
    comm, r = Comm(ctx), ctx.rank
    started = {"rs": 0, "ag": 0}

    def counting(cls, key):
        def start(*args):
            started[key] += 1
            return cls(*args)
        return start

    traced.RingReduceScatter = counting(traced.RingReduceScatter, "rs")
    traced.DirectAllGather = counting(traced.DirectAllGather, "ag")
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        # integer values: every summation order gives the same, exact result
        inputs = [torch.randint(-50, 50, (n * (37 + k),), generator=torch.Generator().manual_seed(10 * r + k))
                  .to(dtype) for k in range(3)]
        expected = []
        for x in inputs:
            lib = torch.empty(x.numel() // n, dtype=dtype)
            dist.reduce_scatter_single(lib, x)
            expected.append(lib)
        kept = [x.clone() for x in inputs]
        outs = [torch.empty(x.numel() // n, dtype=dtype) for x in inputs]
        handles = [comm.reduce_scatter(o, x, "dp", async_op=True) for o, x in zip(outs, inputs)]  # 3 in flight
        for h in handles:
            h.wait()
        results.append(all(torch.equal(o, e) for o, e in zip(outs, expected)))
        results.append(all(torch.equal(x, k) for x, k in zip(inputs, kept)))  # the input is only read
        in_place = inputs[0].clone()  # ZeRO's form: the output is this rank's own chunk of the input
        mine = in_place.view(n, -1)[r]
        comm.reduce_scatter(mine, in_place, "dp")
        results.append(torch.equal(mine, expected[0]))

        gathered = [torch.empty(x.numel(), dtype=dtype) for x in inputs]
        lib_gathered = [torch.empty(x.numel(), dtype=dtype) for x in inputs]
        for g, x in zip(lib_gathered, inputs):
            dist.all_gather_single(g, x.view(n, -1)[r].contiguous())
        handles = [comm.all_gather(g, x.view(n, -1)[r], "dp", async_op=True) for g, x in zip(gathered, inputs)]
        for h in handles:
            h.wait()
        results.append(all(torch.equal(g, e) for g, e in zip(gathered, lib_gathered)))
        own = torch.zeros_like(inputs[1])  # ZeRO/FSDP's form: the input is this rank's chunk of the output
        own.view(n, -1)[r].copy_(inputs[1].view(n, -1)[r])
        comm.all_gather(own, own.view(n, -1)[r], "dp")
        results.append(torch.equal(own, lib_gathered[1]))
    strided = torch.arange(8.0 * n)[::2]  # not contiguous: the library op
    out = torch.empty(4)
    comm.reduce_scatter(out, strided, "dp")
    results.append(torch.equal(out, strided[4 * r: 4 * r + 4] * n))
    results.append(started == {"rs": 2 * 4, "ag": 2 * 4})  # every contiguous op above took a ring
    return results


@pytest.mark.parametrize("n", [2, 3, 5])
def test_reduce_scatter_and_all_gather_on_gloo_are_p2p_rings_equal_to_the_library_ops(n):
    for results in run_ranks(_gloo_rings_rank, n, n):
        assert all(results), results
