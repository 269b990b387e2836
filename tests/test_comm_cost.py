"""The collective cost model (comm/cost.py), no processes: steps, bus factors and per-rank bytes
against the ring formulas, topology tiers, the presets' orders of magnitude, the alpha-beta fit
(outliers, latency only), unknown ops refused, profiles round-tripped."""

import pytest

from meshlm.comm.cost import HARDWARE, Link, Topology, bus_factor, fit_alpha_beta, load_profile, op_time, rank_traffic, save_profile, steps


def test_bus_factors_and_steps_are_the_ring_formulas():
    n = 4
    assert (steps("all_reduce", n), bus_factor("all_reduce", n)) == (6, 1.5)  # 2(n-1), 2(n-1)/n
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert (steps(op, n), bus_factor(op, n)) == (3, 0.75)  # n-1, (n-1)/n
    assert (steps("broadcast", n), bus_factor("broadcast", n)) == (3, 1.0)
    assert (steps("p2p", 2), bus_factor("p2p", 2)) == (1, 1.0)
    assert bus_factor("all_reduce", 1) == 0 and steps("all_gather", 1) == 0


@pytest.mark.parametrize("n", range(1, 10))
def test_per_rank_traffic_equals_the_formulas_exactly(n):
    for numel in (1, max(1, n - 1), n, 7 * n + 3, 1000, 4096):
        S = numel * 4
        per_rank = {op: [rank_traffic(op, n, r, numel, 4) for r in range(n)]
                    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")}
        # Every byte sent is received; over the group, the totals are the ring's.
        for op, factor in (("all_reduce", 2 * (n - 1)), ("all_gather", n - 1), ("reduce_scatter", n - 1),
                           ("broadcast", n - 1)):
            assert sum(s for s, _ in per_rank[op]) == sum(r for _, r in per_rank[op]) == factor * S, (op, n, numel)
        if numel % n == 0:  # then every rank carries exactly its share: 2(n-1)/n * S and (n-1)/n * S
            assert all(t == (2 * (n - 1) * S // n,) * 2 for t in per_rank["all_reduce"])
            assert all(t == ((n - 1) * S // n,) * 2 for t in per_rank["all_gather"] + per_rank["reduce_scatter"])
            assert all(rank_traffic("all_to_all", n, r, numel, 4) == ((n - 1) * S // n,) * 2 for r in range(n))
    assert rank_traffic("broadcast", 4, 2, 10, 4, root=2) == (40, 0)  # the root only sends
    assert rank_traffic("broadcast", 4, 1, 10, 4, root=2) == (0, 40)  # the chain's last only receives


def test_topology_tiers_a_group_spanning_nodes_runs_at_the_slower_tier():
    h100 = HARDWARE["h100"]
    S = 2**30
    assert h100.link(range(8)) == h100.intra  # a tp group inside one node
    assert h100.link([0, 8]) == Link(h100.inter.alpha_s, h100.inter.bandwidth_Bps)  # dp across nodes
    assert h100.time("all_reduce", S, 8) == pytest.approx(14 * 2e-6 + 1.75 * S / 450e9, rel=1e-12)
    assert h100.time("all_reduce", S, 16) == pytest.approx(30 * 6e-6 + (30 / 16) * S / 50e9, rel=1e-12)
    mixed = Topology("t", 2, intra=Link(1e-6, 100e9), inter=Link(5e-6, 200e9))
    assert mixed.link([0, 2]) == Link(5e-6, 100e9)  # slower on both terms
    for name in ("h100", "a100", "pcie", "cpu-loopback", "cpu-shm"):
        assert HARDWARE[name].time("all_gather", 2**20, 4) > 0
    # Bandwidth dominates large messages: time grows with S almost linearly.
    t1, t2 = op_time("all_reduce", 2**26, 8, h100.intra), op_time("all_reduce", 2**27, 8, h100.intra)
    assert 1.9 < t2 / t1 < 2.0


def test_every_preset_is_of_its_hardwares_order_of_magnitude():
    """A typo in a preset (8e-6 s as 8e-3, a bandwidth off by 1000) would skew every plan made
    with it: per-step latencies between 1 us and 1 ms, bandwidths between 0.1 and 1000 GB/s, the
    tier inside a node never slower than the one between nodes."""
    for topology in HARDWARE.values():
        for link in [topology.intra, topology.inter, *topology.op_links.values()]:
            assert 1e-6 <= link.alpha_s <= 1e-3 and 1e8 <= link.bandwidth_Bps <= 1e12, (topology.name, link)
        assert topology.intra.alpha_s <= topology.inter.alpha_s, topology.name
        assert topology.intra.bandwidth_Bps >= topology.inter.bandwidth_Bps, topology.name


def test_fit_recovers_alpha_and_beta_and_shrugs_off_an_outlier():
    sizes = [2**k for k in range(10, 27)]
    truth = Link(alpha_s=80e-6, bandwidth_Bps=1.2e9)
    times = [op_time("all_reduce", s, 4, truth) for s in sizes]
    fit = fit_alpha_beta("all_reduce", 4, sizes, times)
    assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6)
    assert fit.bandwidth_Bps == pytest.approx(truth.bandwidth_Bps, rel=1e-6)
    # Stalls on a noisy machine: least absolute deviation passes through the clean points, so the
    # fit is still the truth (to the IRLS floor); least squares, or IRLS stopped after a step or
    # two, lands 2-4% off.
    for stalled in ([5], [3, 9, 14]):
        noisy = [t * 6 if i in stalled else t for i, t in enumerate(times)]
        fit = fit_alpha_beta("all_reduce", 4, sizes, noisy)
        assert fit.alpha_s == pytest.approx(truth.alpha_s, rel=1e-4), stalled
        assert fit.bandwidth_Bps == pytest.approx(truth.bandwidth_Bps, rel=1e-4), stalled


def test_times_that_do_not_grow_with_the_size_are_all_latency():
    """Small messages on a noisy machine can even get faster with size: the free fit's bandwidth
    term comes out negative, is dropped, and the latency-only fit (alpha the time per step, the
    bandwidth infinite) beats the bandwidth-only one."""
    sizes = [2**k for k in range(10, 21)]
    times = [6 * 80e-6 * (1 - 0.001 * i) for i in range(len(sizes))]  # all_reduce over 4: 6 steps
    fit = fit_alpha_beta("all_reduce", 4, sizes, times)
    assert fit.bandwidth_Bps == float("inf") and fit.alpha_s == pytest.approx(80e-6, rel=0.01)


@pytest.mark.parametrize("op", ["all_scatter", "all_reduce_coalesced", "allreduce", "gather", "send_recv"])
def test_an_unknown_op_is_refused_by_every_formula(op):
    """Not priced as the nearest known op: names that sort between the known ones included."""
    for formula in (lambda: steps(op, 4), lambda: bus_factor(op, 4), lambda: rank_traffic(op, 4, 0, 64, 4)):
        with pytest.raises(ValueError, match=repr(op)):
            formula()


def test_profile_round_trips(tmp_path):
    topo = Topology("m", 2, Link(1e-4, 1e9), Link(2e-4, 5e8), op_links={"all_reduce": Link(3e-4, 7e8)}, note="x")
    save_profile(topo, tmp_path / "p.json", fit_median_rel_err_ge_64KiB=0.1)
    assert load_profile(tmp_path / "p.json") == topo
