"""meshlm's collectives on 2 forked ranks of one host, fp32, median of 8, each rank pinned to a core:
gloo's library ops against what `Comm` runs there (shared memory, comm/shared_memory.py) and what
it runs across hosts (MESHLM_SHM_DISABLE=1: the P2P rings of comm/gloo_rings.py). RESULTS.md:
"zero0 above parity" (and, for the rings against gloo, "gloo's reduce-scatter replaced by a P2P
ring", measured with this script's predecessor). Run: .venv/bin/python benchmarks/collectives.py"""
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from meshlm.bench.report import prepare_cpu_rank  # noqa: E402
from meshlm.comm import Comm  # noqa: E402
from meshlm.mesh import Layout, ParallelContext  # noqa: E402
from meshlm.testing import run_ranks  # noqa: E402


def bench(numel):
    r, n = dist.get_rank(), dist.get_world_size()
    prepare_cpu_rank(r, torch.device("cpu"))
    ctx = ParallelContext(Layout(dp=n))
    shm = Comm(ctx)
    os.environ["MESHLM_SHM_DISABLE"] = "1"
    rings = Comm(ctx)
    x = torch.randn(numel)
    part = torch.empty(numel // n)
    cases = {
        "all_reduce gloo": lambda: dist.all_reduce(x),
        "all_reduce shm": lambda: shm.all_reduce(x, "dp"),
        "reduce_scatter gloo": lambda: dist.reduce_scatter_single(part, x),
        "reduce_scatter ring": lambda: rings.reduce_scatter(part, x, "dp"),
        "reduce_scatter shm": lambda: shm.reduce_scatter(part, x, "dp"),
        "all_gather gloo": lambda: dist.all_gather_single(x, part),
        "all_gather direct": lambda: rings.all_gather(x, part, "dp"),
        "all_gather shm": lambda: shm.all_gather(x, part, "dp"),
    }
    times = {}
    for name, f in list(cases.items()) * 2:
        dist.barrier()
        f()
        samples = []
        for _ in range(8):
            dist.barrier()
            t = time.perf_counter()
            f()
            samples.append(time.perf_counter() - t)
        times[name] = statistics.median(samples)
    return times


if __name__ == "__main__":
    for numel in (1 << 18, 1 << 20, 1 << 22, 1 << 23):
        times = run_ranks(bench, 2, numel)[0]
        print(f"{numel * 4 / 2**20:g} MiB: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in times.items()) + " (ms)")
