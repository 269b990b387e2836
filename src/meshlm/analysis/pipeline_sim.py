"""The pipeline simulator: runs the engine's own instruction lists on per-op costs and draws them.

Reduces: guessing; it shows a schedule's bubble, step time and activation memory (micro-batches in
flight per rank) before a run, and, fed the op costs a real run measured, what that run's bubble
should have been.
Costs: nothing at run time; it is a model: costs per op are taken as constant and P2P as a fixed
latency, so contention and stragglers are not in it.

Semantics (what `meshlm.parallel.pipeline.engine` does): compute ops run back to back; a run of
consecutive P2P instructions is one batch, posted without waiting when the rank reaches it; a
message completes `p2p` after both its send and its receive are posted. A rank waits for a batch's
receives just before the first op that uses one of them, and for its sends only at the end of the
step, before reducing gradients (sends="deferred"). With `OpCosts.weight_fraction` > 0 each
gradient-sending chunk's last backward costs only its input-gradient part; its weight-gradient
part runs as its own span before the next compute op whose input has not arrived yet, else before
the gradient reduction (the engine's deferred weight gradients). With sends="blocking" a rank instead waits at
every batch until all of it has matched, sends included (Megatron's blocking exchanges, and
NCCL's worst case): the tests use it to show that no schedule can deadlock even then.

`meshlm simulate pipeline --schedule S --pp P --microbatches M [--virtual V] [--forward-cost F
--backward-cost B --p2p-cost C] [--out timeline.png|svg] [--json]`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Sequence

from meshlm.errors import OneLineErrorParser, unwritable
from meshlm.parallel.pipeline.schedules import (BACKWARD, FORWARD, REDUCE_GRADS, SCHEDULES, Instruction,
                                                PipelineShape, ScheduleError, build_schedule, p2p_batches,
                                                peak_in_flight)


class SimulationDeadlock(RuntimeError):
    """No rank can make progress: the message says which ranks wait on which instructions."""


WEIGHT = "weight"  # a span of deferred weight gradients


@dataclass
class OpCosts:
    """Time of one forward / backward of one micro-batch through one model chunk, per rank if a
    sequence; backward None = 2 x forward; p2p = latency of one message; weight_fraction = the
    share of a backward that is weight gradients, deferred where the engine defers them (0: the
    engine's parallel.pp_defer_wgrad=false)."""

    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] | None = None
    p2p: float = 0.0
    weight_fraction: float = 0.0

    def of(self, op: str, rank: int) -> float:
        def pick(value):
            return value[rank] if isinstance(value, (list, tuple)) else value

        if op == FORWARD:
            return float(pick(self.forward))
        if op == BACKWARD:
            return float(pick(self.backward)) if self.backward is not None else 2.0 * float(pick(self.forward))
        return 0.0


@dataclass
class Span:
    rank: int
    start: float
    end: float
    op: str
    microbatch: int
    chunk: int


@dataclass
class SimResult:
    schedule: str
    pp: int
    microbatches: int
    virtual: int
    step_time: float
    bubble_fraction: float
    busy: list[float]
    idle: list[float]
    peak_inflight: list[int]
    spans: list[Span] = field(default_factory=list)

    def to_dict(self, spans: bool = False) -> dict:
        out = asdict(self)
        if not spans:
            out.pop("spans")
        return out


def ideal_bubble(kind: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The textbook bubble with uniform costs: (p-1)/(v*m+p-1) (v = 1 for GPipe and 1F1B)."""
    v = virtual if kind == "interleaved" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def check_fifo(schedules: list[list[Instruction]], shape: PipelineShape) -> None:
    """Raise if, for some pair of ranks, sends and receives are not listed in the same order.
    P2P matches the k-th send with the k-th receive of a pair, and activations and gradients have
    the same shape, so a different order would not hang: it would silently swap tensors."""
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for rank, program in enumerate(schedules):
        for ins in program:
            if ins.op.startswith("send"):
                sent.setdefault((rank, ins.peer), []).append(shape.message(rank, ins))
            elif ins.op.startswith("recv"):
                received.setdefault((ins.peer, rank), []).append(shape.message(rank, ins))
    for pair in sorted(set(sent) | set(received)):
        if sent.get(pair, []) != received.get(pair, []):
            raise SimulationDeadlock(f"rank {pair[0]} sends to rank {pair[1]} in the order {sent.get(pair, [])} "
                                     f"but rank {pair[1]} receives {received.get(pair, [])}")


def simulate(schedules: list[list[Instruction]], shape: PipelineShape, costs: OpCosts | None = None, *,
             kind: str = "", sends: str = "deferred") -> SimResult:
    """Play the per-rank instruction lists on `costs`; see the module docstring for the semantics."""
    if sends not in ("deferred", "blocking"):
        raise ValueError(f"sends must be deferred or blocking, got {sends!r}")
    costs = costs or OpCosts()
    check_fifo(schedules, shape)
    programs = [p2p_batches(p) for p in schedules]
    pp = len(programs)
    clock = [0.0] * pp
    pc = [0] * pp
    busy = [0.0] * pp
    spans: list[Span] = []
    posted: dict[tuple[str, tuple], float] = {}  # ("send"|"recv", message) -> time posted
    batch_of: list[dict[tuple, list[tuple]]] = [{} for _ in range(pp)]  # received message -> its batch's receives
    my_sends: list[list[tuple]] = [[] for _ in range(pp)]

    def matched(side: str, message: tuple) -> float | None:
        """When the op `side` of `message` completes, or None while its partner is not posted."""
        partner = posted.get(("recv" if side == "send" else "send", message))
        return None if partner is None else max(partner, posted[(side, message)]) + costs.p2p

    def needs(rank: int, ins: Instruction) -> tuple | None:
        stage = shape.stage(rank, ins.chunk)
        if ins.op == FORWARD and stage > 0:
            return ("act", ins.microbatch, stage - 1)
        if ins.op == BACKWARD and stage < shape.n_stages - 1:
            return ("grad", ins.microbatch, stage + 1)
        return None

    # Each gradient-sending chunk's last backward defers its weight gradients (engine.py).
    deferred = [{(c, mb) for c, mb in {i.chunk: i.microbatch for i in schedules[r] if i.op == BACKWARD}.items()
                 if shape.stage(r, c) > 0} if costs.weight_fraction > 0 else set() for r in range(pp)]
    last_backward = [max((i for i, item in enumerate(program) if not isinstance(item, list) and item.op == BACKWARD),
                         default=-1) for program in programs]
    owed = [0.0] * pp  # weight-gradient time a rank still has to spend
    owed_mb = [(-1, 0)] * pp

    def flush(rank: int) -> None:
        if owed[rank] > 0:
            mb, chunk = owed_mb[rank]
            spans.append(Span(rank, clock[rank], clock[rank] + owed[rank], WEIGHT, mb, chunk))
            clock[rank] += owed[rank]
            busy[rank] += owed[rank]
            owed[rank] = 0.0

    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            while pc[rank] < len(programs[rank]):
                item = programs[rank][pc[rank]]
                if isinstance(item, list):  # a P2P batch: post every op of it now
                    messages = []
                    for ins in item:
                        side = "send" if ins.op.startswith("send") else "recv"
                        message = shape.message(rank, ins)
                        posted.setdefault((side, message), clock[rank])
                        messages.append((side, message))
                    if sends == "blocking":  # the rank waits here until the whole batch matched
                        done = [matched(side, message) for side, message in messages]
                        if any(d is None for d in done):
                            break
                        clock[rank] = max([clock[rank], *done])
                    else:
                        receives = [message for side, message in messages if side == "recv"]
                        for message in receives:
                            batch_of[rank][message] = receives
                        my_sends[rank] += [message for side, message in messages if side == "send"]
                elif item.is_compute:
                    if pc[rank] == last_backward[rank]:
                        flush(rank)  # the engine flushes before its last (syncing) backward
                    message = needs(rank, item)
                    if message is not None and sends == "deferred":
                        # Before the first op that uses a received tensor, wait for its batch's receives.
                        done = [matched("recv", m) for m in batch_of[rank][message]]
                        if any(d is None for d in done):
                            break  # its sender is not simulated that far yet: come back then
                        if any(d > clock[rank] for d in done):
                            flush(rank)  # it would wait: owed weight gradients fill the wait
                        clock[rank] = max([clock[rank], *done])
                    cost = costs.of(item.op, rank)
                    if item.op == BACKWARD and (item.chunk, item.microbatch) in deferred[rank]:
                        owed[rank] += costs.weight_fraction * cost
                        owed_mb[rank] = (item.microbatch, item.chunk)
                        cost -= costs.weight_fraction * cost
                    spans.append(Span(rank, clock[rank], clock[rank] + cost, item.op, item.microbatch, item.chunk))
                    clock[rank] += cost
                    busy[rank] += cost
                elif item.op == REDUCE_GRADS:
                    flush(rank)
                    # The engine waits for its outstanding sends here, before touching gradients.
                    done = [matched("send", m) for m in my_sends[rank]]
                    if any(d is None for d in done):
                        break
                    clock[rank] = max([clock[rank], *done])
                pc[rank] += 1
                progress = True
    for rank in range(pp):
        flush(rank)
    stuck = {r: programs[r][pc[r]] for r in range(pp) if pc[r] < len(programs[r])}
    if stuck:
        described = "; ".join(f"rank {r} waits at {[str(i) for i in it] if isinstance(it, list) else str(it)}"
                              for r, it in stuck.items())
        raise SimulationDeadlock(f"deadlock: {described}")
    step_time = max(clock) if clock else 0.0
    idle = [step_time - b for b in busy]
    bubble = 1.0 - sum(busy) / (pp * step_time) if step_time > 0 else 0.0
    return SimResult(kind, shape.pp, shape.microbatches, shape.virtual, step_time, bubble, busy, idle,
                     [peak_in_flight(p) for p in schedules], spans)


def simulate_schedule(kind: str, pp: int, microbatches: int, virtual: int = 1, costs: OpCosts | None = None,
                      sends: str = "deferred") -> SimResult:
    shape = PipelineShape(pp, microbatches, virtual)
    return simulate(build_schedule(kind, pp, microbatches, virtual), shape, costs, kind=kind, sends=sends)


# --------------------------------------------------------------------------- drawing


def draw_timeline(result: SimResult, path: str, title: str | None = None, measured_bubble: float | None = None,
                  xlabel: str = "time") -> None:
    """A Gantt chart of the spans, one row per rank (rank 0 on top), as in the GPipe and Megatron
    papers: forwards blue, backwards green, deferred weight gradients purple, later chunks in lighter shades, micro-batch in the box.
    The format follows the file name (.png or .svg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    width = max(6.0, min(18.0, 0.32 * result.step_time / max(1e-12, min(s.end - s.start for s in result.spans))))
    fig, ax = plt.subplots(figsize=(width, 0.55 * result.pp + 1.3))
    base = {FORWARD: (0.20, 0.45, 0.80), BACKWARD: (0.20, 0.62, 0.30), WEIGHT: (0.55, 0.40, 0.70)}
    for s in result.spans:
        shade = 0.45 * s.chunk / max(1, result.virtual - 1) if result.virtual > 1 else 0.0
        color = tuple(c + (1 - c) * shade for c in base[s.op])
        ax.broken_barh([(s.start, s.end - s.start)], (s.rank - 0.4, 0.8), facecolors=color,
                       edgecolors="white", linewidth=0.6)
        ax.text((s.start + s.end) / 2, s.rank, str(s.microbatch), ha="center", va="center", fontsize=7,
                color="white")
    ax.set_yticks(range(result.pp), [f"rank {r}" for r in range(result.pp)])
    ax.set_ylim(result.pp - 0.5, -0.5)
    ax.set_xlim(0, result.step_time)
    ax.set_xlabel(xlabel)
    label = title or f"{result.schedule} pp={result.pp} m={result.microbatches}" + (
        f" v={result.virtual}" if result.virtual > 1 else "")
    label += f" — bubble {result.bubble_fraction:.1%}"
    if measured_bubble is not None:
        label += f" (measured {measured_bubble:.1%})"
    ax.set_title(label, fontsize=10)
    handles = [Patch(color=base[FORWARD], label="forward"), Patch(color=base[BACKWARD], label="backward")]
    if any(s.op == WEIGHT for s in result.spans):
        handles.append(Patch(color=base[WEIGHT], label="deferred weight gradients"))
    if result.virtual > 1:
        handles.append(Patch(color=(0.75, 0.75, 0.75), label="lighter: later chunk"))
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncols=len(handles), bbox_to_anchor=(1.0, 1.25),
              frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------- command line


def format_result(result: SimResult) -> str:
    v = f" v={result.virtual}" if result.virtual > 1 else ""
    lines = [f"{result.schedule} pp={result.pp} m={result.microbatches}{v}: step time {result.step_time:.3f}, "
             f"bubble {result.bubble_fraction:.4f} (uniform-cost formula "
             f"{ideal_bubble(result.schedule, result.pp, result.microbatches, result.virtual):.4f})",
             f"{'rank':>4} {'busy':>9} {'idle':>9} {'peak in flight':>15}"]
    for r in range(result.pp):
        lines.append(f"{r:>4} {result.busy[r]:>9.3f} {result.idle[r]:>9.3f} {result.peak_inflight[r]:>15}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="meshlm simulate pipeline",
                                description="Simulate a pipeline schedule on per-op costs and draw its timeline.")
    p.add_argument("--schedule", required=True, choices=SCHEDULES)
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    p.add_argument("--virtual", type=int, default=1, help="model chunks per rank (interleaved)")
    p.add_argument("--forward-cost", type=float, default=1.0, help="one forward of one micro-batch through one chunk")
    p.add_argument("--backward-cost", type=float, default=None, help="default: 2 x forward cost")
    p.add_argument("--p2p-cost", type=float, default=0.0, help="latency of one activation/gradient message")
    p.add_argument("--weight-fraction", type=float, default=0.0,
                   help="share of a backward that is weight gradients, deferred as the engine defers them "
                        "(0 = not deferred)")
    p.add_argument("--out", help="draw the timeline to this .png or .svg (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad usage, 0 for --help
        return int(e.code or 0)
    for name, value, positive in (("forward-cost", args.forward_cost, True), ("backward-cost", args.backward_cost, True),
                                  ("p2p-cost", args.p2p_cost, False)):
        if value is not None and not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            print(f"meshlm: error: --{name}: must be a finite number {'> 0' if positive else '>= 0'}, got {value}",
                  file=sys.stderr)
            return 2
    if args.out and not args.out.lower().endswith((".png", ".svg")):
        print("meshlm: error: --out: the file name must end in .png or .svg", file=sys.stderr)
        return 2
    problem = unwritable(args.out, "--out")
    if problem:
        print(f"meshlm: error: {problem}", file=sys.stderr)
        return 2
    if not 0 <= args.weight_fraction < 1:
        print("meshlm: error: --weight-fraction: must be in [0, 1)", file=sys.stderr)
        return 2
    costs = OpCosts(args.forward_cost, args.backward_cost, args.p2p_cost, args.weight_fraction)
    try:
        result = simulate_schedule(args.schedule, args.pp, args.microbatches, args.virtual, costs)
    except ScheduleError as e:
        print(f"meshlm: error: --schedule {args.schedule} --pp {args.pp} --microbatches {args.microbatches} "
              f"--virtual {args.virtual}: {e}", file=sys.stderr)
        return 2
    if args.out:
        try:
            draw_timeline(result, args.out, xlabel=f"time (one forward of one micro-batch through one chunk = "
                                                   f"{args.forward_cost:g})")
        except ImportError:
            print("meshlm: error: --out needs matplotlib (pip install 'meshlm[plot]')", file=sys.stderr)
            return 2
    if args.json:
        out = result.to_dict()
        out["ideal_bubble_fraction"] = ideal_bubble(args.schedule, args.pp, args.microbatches, args.virtual)
        out["costs"] = {"forward": costs.forward, "backward": costs.of(BACKWARD, 0), "p2p": costs.p2p,
                        "weight_fraction": costs.weight_fraction}
        if args.out:
            out["out"] = args.out
        print(json.dumps(out, indent=2))
    else:
        print(format_result(result))
        if args.out:
            print(f"timeline written to {args.out}")
    return 0
