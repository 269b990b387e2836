"""The planner's step-time model (analysis/steptime.py): long pipelines extended by steady-state
cycles and the fewest whole simulated rounds, a stage simulated at the cost of its parts,
recompute, TP and CP costs derived by hand, throughput, parameters per rank equal to the memory
model's, and collectives without background progress hiding nothing."""

import pytest

from meshlm.analysis import plan as planner
from meshlm.analysis.pipeline_sim import OpCosts, simulate_schedule
from meshlm.analysis.steptime import (SIM_MICROBATCHES_MIN, SIM_MICROBATCHES_PER_STAGE, Layout, _pipeline,
                                      rank_params, step_time)
from meshlm.config import load_config, resolve


@pytest.mark.parametrize("kind,pp,v,p2p", [("1f1b", 4, 1, 0.05), ("interleaved", 4, 2, 0.05), ("1f1b", 8, 1, 0.05),
                                           ("interleaved", 2, 2, 0.0), ("interleaved", 2, 2, 0.002)])
def test_long_pipelines_extend_the_simulation_by_steady_state_cycles(kind, pp, v, p2p):
    fwd, bwd = (1.0,) * (pp - 1) + (1.1,), (2.0,) * (pp - 1) + (2.2,)  # the last stage has the head
    m = 96
    assert m > max(SIM_MICROBATCHES_PER_STAGE * pp, SIM_MICROBATCHES_MIN)
    direct = simulate_schedule(kind, pp, m, v, OpCosts(list(fwd), list(bwd), p2p, 0.49)).step_time
    assert _pipeline(kind, pp, m, v, fwd, bwd, p2p, 0.49) == pytest.approx(direct, rel=2e-3)


@pytest.mark.parametrize("pp", [2, 3, 5, 6, 16])
def test_the_simulation_runs_the_fewest_whole_rounds_that_reach_its_minimum(monkeypatch, pp):
    """Beyond SIM_MICROBATCHES_MIN (and PER_STAGE per stage), the simulation stops at the first
    whole round of pp micro-batches (the interleaved schedule runs in rounds) and extrapolates."""
    import meshlm.analysis.steptime as steptime

    lengths = []
    real = steptime._simulate.__wrapped__
    monkeypatch.setattr(steptime, "_simulate", lambda kind, pp, m, *a: lengths.append(m) or real(kind, pp, m, *a))
    _pipeline("interleaved", pp, 50 * pp, 2, (1.0,) * pp, (2.0,) * pp, 0.0, 0.0)
    floor = max(SIM_MICROBATCHES_MIN, SIM_MICROBATCHES_PER_STAGE * pp)
    longest = max(lengths)
    assert longest % pp == 0 and floor <= longest < floor + pp, (pp, lengths)


def test_a_pipeline_stage_is_simulated_at_the_cost_of_its_parts(monkeypatch):
    """What the simulator is handed per stage and micro-batch (forward and backward, every chunk)
    adds up, over a step, to the parts the step reports: compute, recompute and each axis's
    exposed communication (dp 1: nothing once a step). CP at 16 exposes its hops forward too."""
    import meshlm.analysis.steptime as steptime

    handed = []
    real = steptime._pipeline
    monkeypatch.setattr(steptime, "_pipeline", lambda *a: handed.append(a) or real(*a))
    work = planner.workload("llama3-8b", 64)
    for lay in (Layout(1, 1, 4, 16, 0, "full", 1, "1f1b"), Layout(1, 4, 4, 4, 1, "none", 1, "interleaved", 2)):
        handed.clear()
        t = step_time(work, lay)
        kind, pp, m, v, fwd, bwd = handed[0][:6]
        assert t.cp_comm_s > 0 and m == t.microbatches
        per_stage = sum(f + b for f, b in zip(fwd, bwd)) * v * m / pp
        assert per_stage == pytest.approx(t.compute_s + t.recompute_s + t.tp_comm_s + t.cp_comm_s, rel=1e-12)


def test_recompute_and_tp_cost_time_and_the_bottleneck_is_named():
    work = planner.workload("llama3-70b", 64)
    plain = step_time(work, Layout(2, 8, 4, 1, 0, "none", 1, "1f1b"))
    full = step_time(work, Layout(2, 8, 4, 1, 0, "full", 1, "1f1b"))
    assert full.recompute_s == pytest.approx(plain.compute_s / 3, rel=0.05)  # one more forward of the blocks
    # A full recompute re-gathers each region's input (fp32 under autocast: ZeRO 0 in bf16) and
    # reduce-scatters the attention's output; the MLP's is past the block's last saved tensor.
    m, tokens = work.model, work.seq
    gather = work.comm_time("all_gather", tokens * m.dim * 4, 8, 1)
    scatter = work.comm_time("reduce_scatter", tokens * m.dim * 2, 8, 1)
    assert full.step_time_s > plain.step_time_s
    assert full.tp_comm_s - plain.tp_comm_s == pytest.approx(
        full.microbatches * m.n_layers // 4 * (2 * gather + scatter), rel=1e-9)
    assert plain.bottleneck == "tp comm"
    assert step_time(work, Layout(2, 2, 8, 2, 0, "full", 1, "1f1b")).bottleneck == "memory"
    # ZeRO-3 gathers 140 GB per micro-batch and the blocks again (with full recompute, whose forward
    # costs about as much, the two are within 2%: the step time does not ask what fits)
    fsdp = step_time(work, Layout(64, 1, 1, 1, 3, "selective", 1))
    assert fsdp.bottleneck == "dp comm"
    assert step_time(planner.workload("1b", 1), Layout(1, 1, 1, 1, 0, "none", 4)).bottleneck == "compute"


def test_throughput_and_the_parts_of_a_step_are_what_they_say(monkeypatch):
    """tokens/s is the global batch's tokens over the step; a layout without a pipeline has no P2P
    on its critical path; the simulated pipeline gets a weight-gradient share only where meshlm
    defers (ZeRO 0/1 and tp 1: tensor-parallel linears keep their own backward)."""
    import meshlm.analysis.steptime as steptime

    work = planner.workload("llama3-8b", 8)
    plain = step_time(work, Layout(8, 1, 1, 1, 1, "none", 1))
    assert plain.tokens_per_s == pytest.approx(work.global_batch * work.seq / plain.step_time_s, rel=1e-12)
    assert plain.pp_comm_s == 0 and plain.bubble_s == 0
    shares = []
    real = steptime._pipeline
    monkeypatch.setattr(steptime, "_pipeline", lambda *a: shares.append(a[-1]) or real(*a))
    for tp, zero in [(1, 1), (2, 1), (1, 2)]:
        shares.clear()
        step_time(work, Layout(8 // (2 * tp), tp, 2, 1, zero, "none", 1, "1f1b"))
        assert shares and all((share > 0) == (tp == 1 and zero <= 1) for share in shares), (tp, zero, shares)


def test_selective_recompute_costs_the_attention_cores_forward_again():
    """Per layer and token, full recompute replays 2·P + 4·s·h FLOPs (the block's matmuls and the
    attention core), selective only the core's 4·s·h: their ratio, from the model's shape."""
    work = planner.workload("llama3-70b", 64)
    m = work.model
    weights = 2 * m.dim * m.dim + 2 * m.dim * m.n_kv_heads * m.head_dim + 3 * m.dim * m.ffn_dim
    core = 4 * work.seq * m.dim
    full, selective = (step_time(work, Layout(2, 8, 4, 1, 0, mode, 1, "1f1b")).recompute_s
                       for mode in ("full", "selective"))
    assert selective / full == pytest.approx(core / (2 * weights + core), rel=1e-9)


@pytest.mark.parametrize("tp,cp", [(8, 2), (1, 16)])  # the backward's hop exposed; both hops exposed
def test_the_cp_ring_exposes_what_its_hops_take_beyond_the_attention_they_hide_under(tp, cp):
    """Per layer, c - 1 hops of K and V for this rank's tokens (b·s/c·kv_local·p bytes each, kv
    heads split over tp): forward each hides under the attention to one block (4·b·s/c·s·h/(t·c)
    FLOPs), backward's carries the fp32 gradients too (p + 4 bytes) and hides under twice that; the
    gradients' last hop, home after the last block, hides under nothing."""
    work = planner.workload("llama3-8b", 16)
    m = work.model
    lay = Layout(16 // (tp * cp), tp, 1, cp, 1, "none", 1)
    tokens = work.seq // cp
    kv_local = max(1, m.n_kv_heads // tp) * m.head_dim
    hop = [work.comm_time("p2p", 2 * tokens * kv_local * p, cp, tp) for p in (work.itemsize, work.itemsize + 4)]
    block = 4 * tokens * work.seq * m.dim / tp / cp / work.flop_rate
    exposed = max(0.0, hop[0] - block) + max(0.0, hop[1] - 2 * block)
    assert exposed > 0
    # the gradients' last hop, home to their owner after the last block: nothing left to hide under
    last = work.comm_time("p2p", 2 * tokens * kv_local * 4, cp, tp)
    microbatches = work.global_batch // lay.dp
    assert step_time(work, lay).cp_comm_s == pytest.approx(microbatches * m.n_layers * ((cp - 1) * exposed + last),
                                                          rel=1e-9)


@pytest.mark.parametrize("model,tp,pp", [("llama3-8b", 1, 1), ("llama3-8b", 2, 2), ("llama3-8b", 4, 4),
                                         ("1b", 1, 1), ("1b", 2, 2)])  # 1b: tied embeddings
def test_the_planners_parameters_per_rank_are_the_memory_models(model, tp, pp):
    """What DP reduces and gathers is sized by rank_params: equal, element for element, to the
    memory model's count, which tests/test_memory.py checks against the built model."""
    from meshlm.analysis.memory_terms import rank_parameters

    work = planner.workload(model, 16)
    lay = Layout(16 // (tp * pp), tp, pp, 1, 1, "none", 1, "1f1b" if pp > 1 else "none")
    cfg = resolve(load_config(None, [f"model.preset={model}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                                     f"parallel.dp={lay.dp}", "train.global_batch_size=512",
                                     "train.micro_batch_size=1"]), world_size=16)
    assert [rank_params(work, lay, r) for r in range(pp)] == [sum(rank_parameters(cfg, r).values()) for r in range(pp)]


def test_collectives_without_background_progress_hide_nothing_under_backward():
    from dataclasses import replace

    from meshlm.analysis.steptime import Workload
    from meshlm.comm.cost import HARDWARE, Topology

    class Device:  # the scaling bench's calibrated device: a flop rate and a comm topology
        def __init__(self, links):
            self.links = links

        def peak_tflops(self, dtype="float32"):
            return 0.1

        def topology(self, gpus_per_node=None):
            return self.links

    cfg = resolve(load_config(None, ["model.preset=125m"]))  # gradients of many 25 MiB buckets
    shm = HARDWARE["cpu-shm"]
    for zero in (0, 3):
        lay = Layout(dp=2, tp=1, pp=1, cp=1, zero=zero, recompute="none", micro_batch_size=8)
        hidden, exposed = (step_time(Workload(cfg.model, 128, 16, "float32", Device(links), 2, 2), lay)
                           for links in (replace(shm, background=True), shm))
        assert exposed.exposed_comm_s > hidden.exposed_comm_s > 0, zero
        # Nothing hidden: DDP's whole all-reduce; ZeRO-3's gathers (forward: every weight; backward:
        # the blocks', the root unit of embedding, final norm and head stays gathered) and reduce-scatter.
        work = Workload(cfg.model, 128, 16, "float32", Device(shm), 2, 2)
        state = 4 * rank_params(work, lay, 0)
        m = cfg.model
        blocks = 4 * m.n_layers * (2 * m.dim * m.dim + 2 * m.dim * m.n_kv_heads * m.head_dim + 3 * m.dim * m.ffn_dim
                                   + 2 * m.dim)
        whole = (work.comm_time("all_reduce", state, 2, 1) if zero == 0 else
                 work.comm_time("all_gather", state, 2, 1) + work.comm_time("all_gather", blocks, 2, 1)
                 + work.comm_time("reduce_scatter", state, 2, 1))
        assert exposed.dp_comm_s == pytest.approx(whole, rel=1e-9), zero
    # gloo's and NCCL's collectives progress while the host computes (a thread, a stream): every
    # preset but the shared-memory one, and a topology that does not say, hides DDP's all-reduce.
    lay = Layout(dp=2, tp=1, pp=1, cp=1, zero=0, recompute="none", micro_batch_size=8)
    for links in [*(t for t in HARDWARE.values() if t is not shm), Topology("t", 8, shm.intra, shm.inter)]:
        hides, waits = (step_time(Workload(cfg.model, 128, 16, "float32", Device(topo), 2, 2), lay).dp_comm_s
                        for topo in (links, replace(links, background=False)))
        assert hides < waits, links.name
