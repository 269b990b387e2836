"""gloo's reduce_scatter_single / all_gather_single / all_reduce against one P2P exchange (what
meshlm's rings do at n = 2), on 2 forked ranks, fp32, median of 8 (RESULTS.md: gloo's
reduce-scatter and all-gather replaced by P2P rings). Run: .venv/bin/python benchmarks/gloo_rings.py"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from meshlm.testing import run_ranks  # noqa: E402


def bench(numel):
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    other = 1 - r
    x = torch.randn(numel)
    half = torch.empty(numel // n)
    chunks = x.view(n, -1)

    def exchange(send, receive):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, other), dist.P2POp(dist.irecv, receive, other)]):
            work.wait()

    cases = {
        "gloo reduce_scatter": lambda: dist.reduce_scatter_single(half, x),
        "gloo all_reduce": lambda: dist.all_reduce(x),
        "P2P reduce-scatter (exchange halves, add)": lambda: (exchange(chunks[other], half), half.add_(chunks[r])),
        "gloo all_gather": lambda: dist.all_gather_single(x, chunks[r].clone()),
        "P2P all-gather (exchange chunks in place)": lambda: exchange(chunks[r], chunks[other]),
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
    for numel in (1 << 20, 1 << 23):
        print(f"{numel * 4 / 2**20:.0f} MiB:", {k: f"{v * 1e3:.1f} ms" for k, v in run_ranks(bench, 2, numel)[0].items()})
