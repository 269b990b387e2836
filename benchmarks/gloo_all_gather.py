"""gloo all_gather_single vs one P2P exchange of chunks into place, 2 forked ranks (RESULTS.md).
Run: .venv/bin/python benchmarks/gloo_all_gather.py"""
import sys, time, statistics
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src"))
import torch, torch.distributed as dist
from meshlm.testing import run_ranks

def bench(numel):
    torch.set_num_threads(1)
    r, n = dist.get_rank(), dist.get_world_size()
    out = torch.empty(numel)
    mine = out.view(n, -1)[r]
    mine.normal_()
    src = mine.clone()
    res = {}
    def ag(): dist.all_gather_single(out, src)
    def ag_inplace(): dist.all_gather_single(out, mine)
    def p2p():
        other = 1 - r
        chunks = out.view(n, -1)
        ws = dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[r], other), dist.P2POp(dist.irecv, chunks[other], other)])
        for w in ws: w.wait()
    for name, f in [("all_gather", ag), ("all_gather_inplace", ag_inplace), ("p2p", p2p)] * 2:
        dist.barrier(); f(); ts = []
        for _ in range(8):
            dist.barrier(); t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        res[name] = statistics.median(ts)
    return res

if __name__ == "__main__":
    for numel in (1 << 20, 1 << 23):
        out = run_ranks(bench, 2, numel)
        print(numel * 4 / 2**20, "MiB", {k: f"{v*1e3:.1f} ms" for k, v in out[0].items()})
