"""The GPUs the planner knows: memory, dense bf16 peak, and the two network tiers it prices.

Reduces: one table instead of figures scattered through the planner; `meshlm plan --gpu NAME`.
Costs: accuracy; bandwidths are effective (what NCCL achieves), not measured on your machine;
calibrate the link figures with `meshlm bench comm` there.

Why effective, not line rate: the alpha-beta model (`meshlm.comm.cost`) charges bytes on the wire
at `bandwidth`, and what a ring collective really achieves is its bus bandwidth, which sits below
the link's line rate by NCCL's protocol overhead (~20% on NVLink, ~5% on InfiniBand):

- NVLink 4 (H100, H200): line rate 450 GB/s per direction; "with the protocol overhead (~20%) NCCL
  can get an effective NVLink bandwidth of 370 GB/s" (NCCL maintainer, NVIDIA/nccl-tests#212).
  NVLink SHARP lifts an 8-GPU all-reduce to ~480 GB/s bus bandwidth; meshlm's rings do not use
  it, so the ring figure is the one to charge.
- NVLink 3 (A100): line rate 300 GB/s per direction; the same 20% gives 240, and users report
  200-230 GB/s all-reduce bus bandwidth on 8 A100s (NVIDIA/nccl-tests#149): 230.
- NVLink 5 (B200): line rate 900 GB/s per direction; 20% off: 720.
- InfiniBand NDR 400 Gb/s (one ConnectX-7 per GPU in DGX/HGX H100, H200, B200 nodes): 50 GB/s
  line rate; "for NDR @ 400Gbps you should see 46-48GB/s per NIC" (NVIDIA/nccl-tests#290): 46.
- InfiniBand HDR 200 Gb/s (one per GPU in DGX A100): 25 GB/s line rate, ~92% as for NDR: 23.
- alpha (per ring step): NVLink ~3 us, InfiniBand ~8 us, what NCCL's simple protocol costs per
  message at these sizes (order of magnitude: the planner's messages are MBs to GBs, where beta rules).

Memory is the device total `nvidia-smi` reports (e.g. 81559 MiB on an H100 80GB HBM3), of which
the planner lets the model use `USABLE_FRACTION` (see there). Peaks are `flops.PEAK_TFLOPS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.comm.cost import Link, Topology
from meshlm.errors import ConfigError

# The share of device memory a layout may fill with what the memory model counts. The rest is
# what it does not count: the CUDA context and cuBLAS workspaces (~0.5-1 GiB), NCCL's channel
# buffers (~1-2 GiB at scale) and the caching allocator's fragmentation; practitioners aim for
# ~90% and treat more as a likely OOM.
USABLE_FRACTION = 0.90

_MIB = 2**20


@dataclass(frozen=True)
class GPU:
    name: str
    peak_key: str  # the key of flops.PEAK_TFLOPS (a substring of the CUDA device name)
    memory_bytes: int
    nvlink: Link  # between GPUs of one node (NVSwitch: every pair at full rate)
    network: Link  # between nodes, per GPU (one NIC per GPU)
    gpus_per_node: int = 8
    note: str = ""

    def peak_tflops(self, dtype: str = "bfloat16") -> float:
        from meshlm.analysis.flops import peak_tflops_for_name

        return peak_tflops_for_name(self.peak_key, dtype)

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * USABLE_FRACTION)

    def topology(self, gpus_per_node: int | None = None) -> Topology:
        """The two-tier topology of `meshlm.comm.cost` for a cluster of these GPUs."""
        return Topology(self.name, gpus_per_node or self.gpus_per_node, intra=self.nvlink, inter=self.network,
                        note=self.note)


_NVLINK4 = Link(alpha_s=3e-6, bandwidth_Bps=370e9)
_NVLINK3 = Link(alpha_s=3e-6, bandwidth_Bps=230e9)
_NVLINK5 = Link(alpha_s=3e-6, bandwidth_Bps=720e9)
_NDR = Link(alpha_s=8e-6, bandwidth_Bps=46e9)
_HDR = Link(alpha_s=8e-6, bandwidth_Bps=23e9)

GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100-80gb", "H100", 81559 * _MIB, _NVLINK4, _NDR, note="DGX/HGX H100 SXM: NVLink 4 + 8 x 400 Gb/s NDR"),
    GPU("h200-141gb", "H200", 143771 * _MIB, _NVLINK4, _NDR, note="HGX H200: NVLink 4 + 8 x 400 Gb/s NDR"),
    GPU("a100-80gb", "A100", 81920 * _MIB, _NVLINK3, _HDR, note="DGX A100 80GB: NVLink 3 + 8 x 200 Gb/s HDR"),
    GPU("a100-40gb", "A100", 40960 * _MIB, _NVLINK3, _HDR, note="DGX A100 40GB: NVLink 3 + 8 x 200 Gb/s HDR"),
    # The datasheet's 180 GB (DGX B200: 1,440 GB for 8 GPUs); no nvidia-smi figure to hand.
    GPU("b200-180gb", "B200", 180 * 10**9, _NVLINK5, _NDR, note="DGX B200: NVLink 5 + 8 x 400 Gb/s NDR"),
)}


def gpu(name: str) -> GPU:
    """The table's entry for `name` (case-insensitive); ConfigError naming --gpu otherwise."""
    key = name.lower()
    if key not in GPUS:
        raise ConfigError(f"--gpu: unknown GPU {name!r} (known: {', '.join(GPUS)})")
    return GPUS[key]


def table() -> str:
    """The table as Markdown, for docs/planning.md (so the docs quote the code, not a copy)."""
    rows = ["| GPU | memory | usable | bf16 dense peak | NVLink (effective) | network per GPU (effective) |",
            "|---|---|---|---|---|---|"]
    for g in GPUS.values():
        rows.append(f"| {g.name} | {g.memory_bytes / 2**30:.1f} GiB | {g.usable_bytes / 2**30:.1f} GiB | "
                    f"{g.peak_tflops():.0f} TFLOP/s | {g.nvlink.bandwidth_Bps / 1e9:.0f} GB/s, "
                    f"{g.nvlink.alpha_s * 1e6:.0f} us | {g.network.bandwidth_Bps / 1e9:.0f} GB/s, "
                    f"{g.network.alpha_s * 1e6:.0f} us |")
    return "\n".join(rows)
