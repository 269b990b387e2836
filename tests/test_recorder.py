"""comm/recorder.py on a clock the test moves: the seconds blocked that a step's exposed
communication is made of, each op's time and bandwidths, the summary table, the fingerprints
(against zlib's CRC of the documented signature), sequence numbers and wall-clock times."""

import types
import zlib

import pytest
import torch

from meshlm.comm import recorder as recorder_module
from meshlm.comm.recorder import FlightRecorder


@pytest.fixture
def clock(monkeypatch):
    """perf_counter and time.time of the recorder, both at the test's hand."""
    now = types.SimpleNamespace(perf=100.0, wall=1.7e9)
    monkeypatch.setattr(recorder_module, "time", types.SimpleNamespace(perf_counter=lambda: now.perf,
                                                                       time=lambda: now.wall))
    return now


def _op(rec, clock, seconds, op="all_reduce", axis="dp", n=4, nbytes=1000, **kw):
    record = rec.start(op, axis, n, torch.float32, nbytes // 4, nbytes, nbytes, nbytes, **kw)
    clock.perf += seconds
    rec.finish(record)
    return record


def test_blocked_seconds_are_the_synchronous_ops_and_each_op_times_once(clock):
    """What a step reports as exposed communication on gloo: the host's time inside synchronous
    ops (an async op's wait is added by its handle, comm/traced.py), each op counted once."""
    rec = FlightRecorder()
    _op(rec, clock, 2.5)
    clock.perf += 1.0  # compute between ops
    started = clock.perf
    asynchronous = _op(rec, clock, 4.0, op="all_gather", async_op=True)
    assert rec.last_event == clock.perf == asynchronous.t_end
    rec.finish(asynchronous)  # a handle waited twice
    assert rec.blocked_s == 2.5 and rec.settle() == 2.5
    assert asynchronous.duration_s == clock.perf - started == 4.0 and asynchronous.stall_s == 0.0  # no stream
    times = {row["op"]: (row["count"], row["time_s"]) for row in rec.summary()}
    assert times == {"all_reduce": (1, 2.5), "all_gather": (1, 4.0)}
    hung = rec.start("broadcast", "dp", 4, torch.float32, 1, 4, 4, 4)
    clock.perf += 3.0
    assert rec.last_event == hung.t_start and hung.duration_s is None and rec.blocked_s == 2.5
    # A GPU op beside them (a run mixing CPU and GPU groups): its stream's stall adds to the host's.
    on_gpu = rec.start("all_reduce", "tp", 2, torch.float32, 1, 4, 4, 4)
    on_gpu.cuda_events = (_Event(10.0), _Event(10.75))
    clock.perf += 5.0
    rec.finish(on_gpu)
    assert rec.blocked_s == 2.5 and rec.settle() == 2.5 + 0.75 and rec.device_blocked_s == 0.75


class _Event:
    """A CUDA event already recorded at `t` seconds of the stream's clock."""

    def __init__(self, t):
        self.t = t

    def synchronize(self):
        pass

    def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event's
        return (end.t - self.t) * 1e3


def test_the_summary_gives_each_op_and_axis_its_bandwidths_and_its_table(clock):
    rec = FlightRecorder(rank=5)
    assert rec.summary() == []
    assert rec.format_summary() == "\n".join([
        "# communication summary (rank 5)",
        "# op              axis       n   count        MiB   sent MiB   time(ms)  algbw GB/s  busbw GB/s",
        "  (no communication)"])
    _op(rec, clock, 0.5, nbytes=5 * 2**18)
    _op(rec, clock, 1.5, nbytes=5 * 2**18)  # 2.5 MiB in 2 s
    _op(rec, clock, 0.0, op="send", axis="pp", n=2, nbytes=1000)  # no time measured: no bandwidth
    rows = rec.summary()
    assert [(r["op"], r["axis"], r["group_size"], r["count"], r["bytes"], r["bytes_sent"], r["bytes_recv"])
            for r in rows] == [("all_reduce", "dp", 4, 2, 5 * 2**19, 5 * 2**19, 5 * 2**19),
                               ("send", "pp", 2, 1, 1000, 1000, 1000)]
    assert rows[0]["algbw"] == 5 * 2**18 and rows[0]["busbw"] == 5 * 2**18 * 2 * 3 / 4  # the ring's 2(n-1)/n
    assert rows[1]["algbw"] == rows[1]["busbw"] == 0.0
    assert rec.format_summary("step 3").splitlines() == [
        "# step 3",
        "# op              axis       n   count        MiB   sent MiB   time(ms)  algbw GB/s  busbw GB/s",
        "  all_reduce      dp         4       2      2.500      2.500    2000.00       0.001       0.002",
        "  send            pp         2       1      0.001      0.001       0.00       0.000       0.000"]


def test_fingerprints_are_the_crc_of_every_op_and_of_the_pipeline_axis_collectives(clock):
    """Every op enters the fingerprint as "op numel dtype"; the pipeline fingerprint takes the
    collectives on the pp axis alone (every stage makes them alike), not its sends and receives."""
    rec = FlightRecorder()
    ops = [("all_reduce", "dp", None), ("all_reduce", "pp", None), ("send", "pp", "send->1"),
           ("recv", "pp", "recv<-1"), ("broadcast", "tp", None), ("all_gather", "pp", None),
           ("all_reduce", "world", None)]
    for i, (op, axis, channel) in enumerate(ops):
        rec.finish(rec.start(op, axis, 2, torch.bfloat16, 10 + i, 20 + 2 * i, 0, 0, channel=channel))
    expected = pipeline = 0
    for i, (op, axis, _) in enumerate(ops):
        signature = f"{op} {10 + i} torch.bfloat16".encode()
        expected = zlib.crc32(signature, expected)
        if axis == "pp" and op not in ("send", "recv"):
            pipeline = zlib.crc32(signature, pipeline)
    assert rec.fingerprint == expected and rec.pipeline_fingerprint == pipeline != 0
    assert rec.sequence_numbers() == {"dp": 1, "pp": 2, "send->1": 1, "recv<-1": 1, "tp": 1, "world": 1}
    assert [d["seq"] for d in rec.dump()] == [0, 0, 0, 0, 0, 1, 0]


def test_the_dump_gives_wall_clock_times_every_rank_can_compare(clock):
    rec = FlightRecorder(rank=2)  # anchored at perf 100 = wall 1.7e9
    clock.wall += 50.0  # the wall clock moves on (or is set) after the anchor: the stamps stay on its scale
    clock.perf += 157.0  # further from the anchor than the anchor from 0
    _op(rec, clock, 0.25, nbytes=8)
    (d,) = rec.dump()
    assert (d["rank"], d["t_start"], d["t_end"], d["dtype"], d["numel"], d["nbytes"]) == \
        (2, 1.7e9 + 157.0, 1.7e9 + 157.25, "float32", 2, 8)
    assert set(d) == {"seq", "op", "axis", "group_size", "peer", "dtype", "numel", "nbytes", "bytes_sent",
                      "bytes_recv", "async_op", "t_start", "t_end", "rank"}
