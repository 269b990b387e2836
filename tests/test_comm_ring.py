"""Ring algorithms over point-to-point ops (comm/ring.py) against the library collectives at
worlds 2 to 8, with the bytes they really send equal to the formula's; and gloo's reduce-scatter
and all-gather, which run as such rings, against the library ops."""

import os

import pytest
import torch
import torch.distributed as dist

from meshlm.comm import Comm
from meshlm.mesh import Layout, ParallelContext
from meshlm.testing import run_ranks


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
