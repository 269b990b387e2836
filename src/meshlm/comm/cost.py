"""The alpha-beta cost model of collectives: time = steps * alpha + bytes on the wire * beta.

Reduces: guesswork; it predicts what a collective costs before you run it (the planner uses it).
Costs: accuracy; it ignores contention and protocol switches, so calibrate it with `meshlm bench comm`.

Vocabulary (the nccl-tests conventions, used everywhere in meshlm):
- S, the *message size*: the bytes of the full logical buffer. all_reduce: the tensor; all_gather:
  the gathered output; reduce_scatter: the input before scattering; all_to_all: one rank's input.
- alpha: the fixed cost of one step (a message start: launch, handshake, wire latency).
- beta = 1 / bandwidth: seconds per byte one rank pushes through its link.
- A ring over n ranks takes `steps(op, n)` steps and each rank sends `bus_factor(op, n) * S` bytes:
  all_reduce = reduce_scatter + all_gather, 2(n-1) steps, 2(n-1)/n * S bytes; the other two halves
  (n-1) steps, (n-1)/n * S. So T(op) = steps * alpha + bus_factor * S * beta.
- algbw = S / T (what the caller sees); busbw = algbw * bus_factor (what each link carried, comparable
  across n and across ops, and comparable with the hardware's link bandwidth).

For large S the beta term dominates and the ring's bytes per rank, 2(n-1)/n * S, are almost
independent of n: that is why a ring all-reduce scales and why busbw is the number to look at.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import numpy as np

# Collectives meshlm models. "p2p" is one send (or one simultaneous send+recv with two peers).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")
_P2P_OPS = ("send", "recv", "p2p")


def steps(op: str, n: int) -> int:
    """Messages one rank starts, one after another, in the ring (or chain) algorithm."""
    if op in _P2P_OPS:
        return 1
    if n <= 1 or op == "barrier":
        return 0
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        return n - 1
    raise ValueError(f"unknown op {op!r}")


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw: the bytes each rank sends per byte of message (nccl-tests' factors)."""
    if op in _P2P_OPS or op == "broadcast":
        return 1.0
    if n <= 1 or op == "barrier":
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    raise ValueError(f"unknown op {op!r}")


def ring_chunks(numel: int, n: int) -> list[int]:
    """Element counts of the n ring chunks: torch.tensor_split's rule, the first numel % n get one more."""
    q, r = divmod(numel, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def rank_traffic(op: str, n: int, rank: int, numel: int, itemsize: int, *, root: int = 0,
                 in_splits: Sequence[int] | None = None, out_splits: Sequence[int] | None = None,
                 row_numel: int = 1) -> tuple[int, int]:
    """(bytes sent, bytes received) by group rank `rank` in the ring/chain algorithm, exactly.

    numel: elements of S (see the module docstring). With chunks c_i (`ring_chunks`):
    - reduce_scatter: at step s rank r sends chunk r-s-1 and adds chunk r-s-2 it receives, ending
      with chunk r reduced: it sends every chunk but its own, receives every chunk but r-1's.
    - all_gather: rank r starts with chunk r, at step s forwards chunk r-s: sends all but chunk r+1,
      receives all but its own.
    - all_reduce = both: sent 2S - c_r - c_{r+1}, received 2S - c_{r-1} - c_r (= 2(n-1)/n * S each
      when n divides S). `meshlm.comm.ring` implements exactly this, and the tests count its bytes.
    - all_to_all: everything but the slice a rank keeps for itself (splits in rows of row_numel).
    - broadcast, as a chain root -> root+1 -> ... : the root only sends, the last rank only receives.
    """
    if n <= 1:
        return 0, 0
    if op in ("all_reduce", "all_gather", "reduce_scatter"):
        sent, recv = _ring_traffic(op, n, rank, numel)
    elif op == "all_to_all":
        ins = list(in_splits) if in_splits is not None else [numel // n // row_numel] * n
        outs = list(out_splits) if out_splits is not None else ins
        sent = (sum(ins) - ins[rank]) * row_numel
        recv = (sum(outs) - outs[rank]) * row_numel
    elif op == "broadcast":
        position = (rank - root) % n
        sent = numel if position < n - 1 else 0
        recv = numel if position > 0 else 0
    elif op == "barrier":
        sent = recv = 0
    else:
        raise ValueError(f"unknown collective {op!r}")
    return sent * itemsize, recv * itemsize


@functools.lru_cache(maxsize=4096)  # a training step repeats the same few shapes; this runs per op
def _ring_traffic(op: str, n: int, rank: int, numel: int) -> tuple[int, int]:
    c = ring_chunks(numel, n)
    rs = (numel - c[rank], numel - c[(rank - 1) % n])
    ag = (numel - c[(rank + 1) % n], numel - c[rank])
    if op == "reduce_scatter":
        return rs
    if op == "all_gather":
        return ag
    return rs[0] + ag[0], rs[1] + ag[1]


# --------------------------------------------------------------------------- links and topology


@dataclass(frozen=True)
class Link:
    """One tier of the network as one rank sees it: per-step latency and unidirectional bandwidth."""

    alpha_s: float
    bandwidth_Bps: float

    @property
    def beta_s_per_byte(self) -> float:
        return 1.0 / self.bandwidth_Bps


def slower(a: Link, b: Link) -> Link:
    """A ring that crosses two tiers runs at the pace of its slowest hop, on both terms."""
    return Link(max(a.alpha_s, b.alpha_s), min(a.bandwidth_Bps, b.bandwidth_Bps))


def op_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """Predicted seconds for one `op` with message size `nbytes` over `n` ranks on `link`."""
    if n <= 1 and op not in _P2P_OPS:
        return 0.0
    return steps(op, n) * link.alpha_s + bus_factor(op, n) * nbytes / link.bandwidth_Bps


@dataclass(frozen=True)
class Topology:
    """Ranks packed `ranks_per_node` to a node (ranks r // ranks_per_node share one), two tiers.

    `op_links` holds per-collective effective links from a measured profile: a library's
    collective may not be the ideal ring (gloo's reduce_scatter is a full all_reduce plus a copy),
    so a calibrated model keeps the ring's structure but one (alpha, beta) per op.
    """

    name: str
    ranks_per_node: int
    intra: Link
    inter: Link
    op_links: Mapping[str, Link] = field(default_factory=dict)
    note: str = ""
    # Whether an async collective progresses while the host computes (NCCL's stream, gloo's
    # thread), so it can hide under backward; meshlm's shared-memory ones run when waited.
    background: bool = True

    def spans_nodes(self, ranks: Sequence[int]) -> bool:
        return len({r // self.ranks_per_node for r in ranks}) > 1

    def link(self, ranks: Sequence[int] | int, op: str | None = None) -> Link:
        """The link a group runs at: group given as its global ranks, or as a size (then it is
        assumed packed from rank 0, the way tp groups are). Spanning nodes -> the slower tier."""
        group = range(ranks) if isinstance(ranks, int) else ranks
        if self.spans_nodes(group):
            return slower(self.intra, self.inter)
        return self.op_links.get(op, self.intra) if op else self.intra

    def time(self, op: str, nbytes: float, ranks: Sequence[int] | int) -> float:
        n = ranks if isinstance(ranks, int) else len(ranks)
        return op_time(op, nbytes, n, self.link(ranks, op))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["op_links"] = {k: asdict(v) for k, v in self.op_links.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Topology":
        return cls(name=d["name"], ranks_per_node=int(d["ranks_per_node"]), intra=Link(**d["intra"]),
                   inter=Link(**d["inter"]), op_links={k: Link(**v) for k, v in d.get("op_links", {}).items()},
                   note=d.get("note", ""), background=bool(d.get("background", True)))


def save_profile(topology: Topology, path: str, **extra) -> None:
    with open(path, "w") as f:
        json.dump({**topology.to_dict(), **extra}, f, indent=2)
        f.write("\n")


def load_profile(path: str) -> Topology:
    with open(path) as f:
        return Topology.from_dict(json.load(f))


# Order-of-magnitude presets. Bandwidths are per GPU, per direction; alphas are per ring step as
# NCCL achieves them, not the wire's physical latency. Calibrate on the real machine.
# `meshlm bench comm` on the 2-core development VM (gloo over TCP loopback, 2 ranks), rounded;
# the measured table is in docs/communication.md. Per-op links: gloo's collectives are not ideal rings.
_LOOPBACK = Link(alpha_s=135e-6, bandwidth_Bps=1.6e9)  # the P2P fit
_LOOPBACK_OPS = {
    "all_reduce": Link(alpha_s=230e-6, bandwidth_Bps=1.1e9),
    "all_gather": Link(alpha_s=270e-6, bandwidth_Bps=0.62e9),  # gathers into a temporary, then copies
    "reduce_scatter": Link(alpha_s=580e-6, bandwidth_Bps=0.33e9),  # a full all_reduce, then a copy
    "all_to_all": Link(alpha_s=135e-6, bandwidth_Bps=0.92e9),
}
# `meshlm bench comm --transport meshlm --min-bytes 64K` on the same VM: what meshlm's Comm runs for
# ranks on one host (comm/shared_memory.py, its phases separated by comm/shm_barrier.py's futex
# barrier; every all-reduce size), the median of three fits per parameter, rounded.
_SHM_OPS = {
    "all_reduce": Link(alpha_s=66e-6, bandwidth_Bps=5.0e9),
    "all_gather": Link(alpha_s=105e-6, bandwidth_Bps=3.6e9),
    "reduce_scatter": Link(alpha_s=120e-6, bandwidth_Bps=3.6e9),
    "all_to_all": _LOOPBACK_OPS["all_to_all"],  # gloo's own
}
HARDWARE: dict[str, Topology] = {
    "h100": Topology(
        "h100", 8,
        intra=Link(alpha_s=2e-6, bandwidth_Bps=450e9),  # NVLink 4 through NVSwitch: 900 GB/s bidirectional
        inter=Link(alpha_s=6e-6, bandwidth_Bps=50e9),  # one 400 Gb/s InfiniBand NIC per GPU
        note="DGX/HGX H100: 8 GPUs on NVSwitch, 8 x 400 Gb/s InfiniBand per node"),
    "a100": Topology(
        "a100", 8,
        intra=Link(alpha_s=3e-6, bandwidth_Bps=300e9),  # NVLink 3: 600 GB/s bidirectional
        inter=Link(alpha_s=8e-6, bandwidth_Bps=25e9),  # one 200 Gb/s HDR InfiniBand NIC per GPU
        note="DGX A100: 8 GPUs on NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node"),
    "pcie": Topology(
        "pcie", 8,
        intra=Link(alpha_s=8e-6, bandwidth_Bps=20e9),  # PCIe Gen4 x16 through the host bridge
        inter=Link(alpha_s=15e-6, bandwidth_Bps=12.5e9),  # 100 Gb/s Ethernet (RoCE)
        note="8 GPUs without NVLink, talking over PCIe; 100 Gb/s Ethernet between nodes"),
    "cpu-loopback": Topology(
        "cpu-loopback", 1 << 20, intra=_LOOPBACK, inter=_LOOPBACK, op_links=_LOOPBACK_OPS,
        note="gloo over TCP loopback on the 2-core development VM (see docs/communication.md)"),
    "cpu-shm": Topology(
        "cpu-shm", 1 << 20, intra=_LOOPBACK, inter=_LOOPBACK, op_links=_SHM_OPS, background=False,
        note="meshlm's collectives through shared memory, ranks on one host, on the 2-core development VM"),
}


# --------------------------------------------------------------------------- fitting


def fit_alpha_beta(op: str, n: int, nbytes: Sequence[float], times: Sequence[float]) -> Link:
    """Fit T = steps*alpha + bus_factor*S*beta to measurements, minimising relative error.

    Relative error, because a 1 KiB message at 100 us and a 64 MiB one at 50 ms matter equally
    to a planner; least absolute deviation (IRLS), because a shared 2-core VM throws outliers
    and the median error is what we report. alpha and beta are kept >= 0.
    """
    t = np.asarray(times, dtype=np.float64)
    a = np.full_like(t, float(steps(op, n)))
    b = bus_factor(op, n) * np.asarray(nbytes, dtype=np.float64)
    cols = np.stack([a / t, b / t], axis=1)  # rows scaled by 1/T: residual = relative error

    def solve(active: list[int]) -> np.ndarray:
        x = np.zeros(2)
        w = np.ones_like(t)
        for _ in range(100):
            sw = np.sqrt(w)[:, None]
            x_new = np.zeros(2)
            x_new[active] = np.linalg.lstsq(cols[:, active] * sw, sw[:, 0], rcond=None)[0]
            if np.allclose(x_new, x, rtol=1e-10, atol=0):
                break
            x = x_new
            w = 1.0 / np.maximum(np.abs(cols @ x - 1.0), 1e-4)
        return x

    x = solve([0, 1])
    if (x < 0).any() or a[0] == 0:  # a negative term has no physical meaning: drop it
        candidates = [solve([1])] + ([solve([0])] if a[0] > 0 else [])
        x = min(candidates, key=lambda c: np.abs(cols @ c - 1.0).sum())
    alpha, beta = float(x[0]), float(x[1])
    return Link(alpha_s=max(alpha, 0.0), bandwidth_Bps=1.0 / beta if beta > 0 else math.inf)
