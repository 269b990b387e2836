"""gloo reduce_scatter_single vs all_reduce vs one P2P exchange of halves on 2 forked ranks (RESULTS.md:
gloo's reduce-scatter replaced by a P2P ring). Run: .venv/bin/python benchmarks/gloo_reduce_scatter.py"""
import sys, time, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src"))
import torch, torch.distributed as dist
from meshlm.testing import run_ranks

def bench(numel):
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel)
    out = torch.empty(numel // n)
    tmp = torch.empty(numel // n)
    res = {}
    def rs(): dist.reduce_scatter_single(out, x)
    def ar(): dist.all_reduce(x)
    def p2p():
        other = 1 - r
        chunks = x.view(n, -1)
        ws = dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[other], other), dist.P2POp(dist.irecv, tmp, other)])
        for w in ws: w.wait()
        torch.add(tmp, chunks[r], out=out)
    for name, f in [("reduce_scatter", rs), ("all_reduce", ar), ("p2p_halves", p2p)] * 2:
        dist.barrier(); f(); ts = []
        for _ in range(8):
            dist.barrier(); t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        res[name] = statistics.median(ts)
    return res

if __name__ == "__main__":
    for numel in (1 << 20, 1 << 23):
        out = run_ranks(bench, 2, numel)
        print(numel * 4 / 2**20, "MiB", {k: f"{v*1e3:.1f} ms" for k, v in out[0].items()})
