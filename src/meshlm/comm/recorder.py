"""The flight recorder: every collective this rank issued, in order, in a bounded ring buffer.

Reduces: the time to diagnose a hang or desync; the last entries of each rank say which
collective it is stuck in and which per-group sequence number it reached.
Costs: a few microseconds of Python per collective and `capacity` small objects of memory.

Two stores, for two questions:
- the ring buffer (a deque of the last `capacity` records, including ops still in flight,
  whose `t_end` is None): "what was this rank doing?" -> `dump()`, `pending()`;
- running totals per (op, axis), never truncated: "where did communication time go?" ->
  `summary()`, `format_summary()`.
"""

from __future__ import annotations

import json
import time
import zlib
from collections import deque
from typing import Any

from meshlm.comm.cost import bus_factor


class CommRecord:
    """One collective or point-to-point op as this rank saw it. Sizes in bytes, times from
    time.perf_counter (convert with FlightRecorder.wall_time)."""

    __slots__ = ("seq", "op", "axis", "group_size", "peer", "dtype", "numel", "nbytes",
                 "bytes_sent", "bytes_recv", "async_op", "t_start", "t_end", "cuda_events", "wait_event")

    def __init__(self, seq, op, axis, group_size, peer, dtype, numel, nbytes, bytes_sent, bytes_recv, async_op):
        self.seq, self.op, self.axis, self.group_size, self.peer = seq, op, axis, group_size, peer
        self.dtype, self.numel, self.nbytes = dtype, numel, nbytes
        self.bytes_sent, self.bytes_recv, self.async_op = bytes_sent, bytes_recv, async_op
        self.t_start = time.perf_counter()
        self.t_end: float | None = None
        self.cuda_events = None  # (start, end) torch.cuda.Event on GPU tensors
        self.wait_event = None  # an async GPU op's: recorded on the stream that waits, as it starts waiting

    @property
    def duration_s(self) -> float | None:
        if self.cuda_events is not None and self.t_end is not None:
            start, end = self.cuda_events
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return None if self.t_end is None else self.t_end - self.t_start

    @property
    def stall_s(self) -> float:
        """GPU seconds the waiting stream stood still for this op: from where it started waiting
        (the op's issue for a synchronous op, the handle's wait for an async one) to the op's end.
        Work the stream ran between issue and wait overlapped the op and is not counted."""
        if self.cuda_events is None or self.t_end is None:
            return 0.0
        end = self.cuda_events[1]
        end.synchronize()
        return (self.wait_event or self.cuda_events[0]).elapsed_time(end) / 1e3

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__ if k not in ("cuda_events", "wait_event")}
        d["dtype"] = str(self.dtype).removeprefix("torch.")
        return d


class FlightRecorder:
    def __init__(self, rank: int = 0, capacity: int = 4096):
        self.rank = rank
        self.records: deque[CommRecord] = deque(maxlen=capacity)
        self._seq: dict[str, int] = {}  # per group (axis) or per P2P channel: ops issued so far
        self._totals: dict[tuple[str, str], list] = {}  # (op, axis) -> [n, count, bytes, sent, recv, time]
        self._unresolved: list[CommRecord] = []  # GPU records whose events are read lazily
        # Host seconds this rank spent blocked in communication (sync ops, and waits on async ones):
        # a step's time minus this is the rank's own work, which names a straggler (debug/stragglers.py).
        self.blocked_s = 0.0
        # On GPUs the host rarely blocks (NCCL ops make the compute stream wait instead): the seconds
        # the streams stood still for communication, from the ops' events (`settle`).
        self.device_blocked_s = 0.0
        self.last_event = time.perf_counter()  # newest start or finish: the watchdog's sign of life
        # A running CRC of every op's (op, size, dtype), equal on ranks that do the same work: the
        # trainer compares them each step to catch a desync the backend let through (debug/fingerprint.py).
        self.fingerprint = 0
        # The same over the collectives on the pipeline axis alone, which every stage of a pipeline
        # makes alike (the loss's sum, the pipeline's checks): compared across the stages.
        self.pipeline_fingerprint = 0
        # One anchor pair, so perf_counter stamps convert to wall-clock time comparable across ranks.
        self._anchor = (time.time(), time.perf_counter())

    def start(self, op: str, axis: str, group_size: int, dtype, numel: int, nbytes: int,
              bytes_sent: int, bytes_recv: int, *, peer: int | None = None, async_op: bool = False,
              channel: str | None = None) -> CommRecord:
        """Stamp the start of an op. `channel` names its sequence: by default the axis, so on every
        rank of a group the k-th collective on that group carries seq k (a desync shows up as two
        ranks of one group at different seq or ops); P2P ops pass 'send->7' / 'recv<-3'."""
        key = channel or axis
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        record = CommRecord(seq, op, axis, group_size, peer, dtype, numel, nbytes, bytes_sent, bytes_recv, async_op)
        self.records.append(record)
        self.last_event = record.t_start
        signature = f"{op} {numel} {dtype}".encode()
        self.fingerprint = zlib.crc32(signature, self.fingerprint)
        if axis == "pp" and op not in ("send", "recv"):  # a stage's sends depend on its place in the pipeline
            self.pipeline_fingerprint = zlib.crc32(signature, self.pipeline_fingerprint)
        return record

    def finish(self, record: CommRecord) -> None:
        if record.t_end is not None:  # waiting twice on a handle is allowed; count it once
            return
        record.t_end = self.last_event = time.perf_counter()
        if not record.async_op and record.cuda_events is None:  # a GPU op's wait is in its stall_s
            self.blocked_s += record.t_end - record.t_start
        if record.cuda_events is not None:
            self._unresolved.append(record)  # reading a CUDA event now would synchronise the GPU
        else:
            self._add(record, record.t_end - record.t_start)

    def _add(self, r: CommRecord, seconds: float) -> None:
        t = self._totals.get((r.op, r.axis))
        if t is None:
            t = self._totals[(r.op, r.axis)] = [r.group_size, 0, 0, 0, 0, 0.0]
        t[1] += 1
        t[2] += r.nbytes
        t[3] += r.bytes_sent
        t[4] += r.bytes_recv
        t[5] += seconds

    def _resolve(self) -> None:
        for r in self._unresolved:
            self._add(r, r.duration_s)
            self.device_blocked_s += r.stall_s
        self._unresolved.clear()

    def settle(self) -> float:
        """Communication this rank has waited for so far, in seconds: host time blocked in ops plus,
        on GPUs, stream time stalled on them. Reads the GPU events of the ops finished so far, which
        waits for the GPU to reach the newest of them: call it where the step waits for the GPU
        anyway (the trainer, after the step's loss is on the host); every call empties the list."""
        self._resolve()
        return self.blocked_s + self.device_blocked_s

    # ---- reading

    def wall_time(self, perf: float) -> float:
        return self._anchor[0] + (perf - self._anchor[1])

    def dump(self) -> list[dict[str, Any]]:
        """The ring buffer, oldest first, with wall-clock start/end (for the hang report)."""
        out = []
        for r in self.records:
            d = r.as_dict()
            d["rank"] = self.rank
            d["t_start"] = self.wall_time(r.t_start)
            d["t_end"] = None if r.t_end is None else self.wall_time(r.t_end)
            out.append(d)
        return out

    def pending(self) -> list[dict[str, Any]]:
        """Ops started and not finished (an async op never waited, or the op a hung rank is in)."""
        return [d for d in self.dump() if d["t_end"] is None]

    def write(self, path: str) -> None:
        """The ring buffer as JSON lines, one op per line (what a hang report collects per rank)."""
        with open(path, "w") as f:
            for d in self.dump():
                f.write(json.dumps(d) + "\n")

    def sequence_numbers(self) -> dict[str, int]:
        return dict(self._seq)

    def summary(self) -> list[dict[str, Any]]:
        """Per (op, axis): count, bytes (sum of message sizes S), bytes sent/received by this rank,
        time, algbw = bytes/time and busbw = algbw * bus_factor(op, group size), in bytes/s. An
        async op's time runs from its issue to the end of its wait, overlapped compute included:
        its bandwidths are lower bounds (docs/communication.md)."""
        self._resolve()
        rows = []
        for (op, axis), (n, count, nbytes, sent, recv, seconds) in sorted(self._totals.items()):
            algbw = nbytes / seconds if seconds > 0 else 0.0
            rows.append(dict(op=op, axis=axis, group_size=n, count=count, bytes=nbytes, bytes_sent=sent,
                             bytes_recv=recv, time_s=seconds, algbw=algbw, busbw=algbw * bus_factor(op, n)))
        return rows

    def format_summary(self, title: str | None = None) -> str:
        rows = self.summary()
        head = title or f"communication summary (rank {self.rank})"
        lines = [f"# {head}",
                 f"# {'op':<15} {'axis':<8} {'n':>3} {'count':>7} {'MiB':>10} {'sent MiB':>10} "
                 f"{'time(ms)':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
        for r in rows:
            lines.append(f"  {r['op']:<15} {r['axis']:<8} {r['group_size']:>3} {r['count']:>7} "
                         f"{r['bytes'] / 2**20:>10.3f} {r['bytes_sent'] / 2**20:>10.3f} {r['time_s'] * 1e3:>10.2f} "
                         f"{r['algbw'] / 1e9:>11.3f} {r['busbw'] / 1e9:>11.3f}")
        if not rows:
            lines.append("  (no communication)")
        return "\n".join(lines)
