"""Pipeline parallelism against the single-process reference (same seed, same global batch):
every schedule at pp = 2 and 4 with m = 4 and 8, dp=2 x pp=2, the shape handshake, evaluation,
the gathered weights, `meshlm train --nproc 2 parallel.pp=2` through torchrun, and torch's own
pipelining. Pipelines beside ZeRO and tied weights: test_pipeline_zero.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

from meshlm.config import load_config, resolve
from meshlm.mesh import ParallelContext
from meshlm.parallel.pipeline.schedules import build_schedule
from meshlm.testing import RankFailure, run_ranks

from pipeline_runs import MODEL, SCHEDULES, _rank, assert_matches, reference


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("kind,virtual", SCHEDULES)
@pytest.mark.parametrize("m", [4, 8])
def test_pipeline_equals_single_process(corpus, tmp_path, tmp_path_factory, pp, kind, virtual, m):
    ref = reference(corpus, tmp_path_factory)
    extra = [f"parallel.pp={pp}", f"parallel.pp_schedule={kind}", f"parallel.pp_virtual={virtual}",
             f"parallel.pp_microbatches={m}"]
    ranks = run_ranks(_rank, pp, corpus, tmp_path, pp, extra, timeout=180)
    assert_matches(ref, ranks)
    # The gathered weights on global rank 0 are the single-process model's, all of them.
    full = ranks[0]["full"]
    assert set(full) == set(ref["params"]) and all((full[n] - ref["params"][n]).abs().max() <= 1e-5 for n in full)
    metrics = ranks[0]["metrics"]
    assert 0 <= metrics["pp_bubble_predicted"] < 1 and 0 <= metrics["pp_bubble_measured"] < 1
    assert metrics["pp_step_s"] > 0


@pytest.mark.parametrize("kind,virtual", SCHEDULES)
def test_fewer_micro_batches_than_stages_equals_single_process(corpus, tmp_path, tmp_path_factory, kind, virtual):
    """m = 2 < pp = 4: 1F1B never reaches its steady state (all warm-up), which must still be right."""
    ref = reference(corpus, tmp_path_factory)
    extra = ["parallel.pp=4", f"parallel.pp_schedule={kind}", f"parallel.pp_virtual={virtual}",
             "parallel.pp_microbatches=2"]
    assert_matches(ref, run_ranks(_rank, 4, corpus, tmp_path, 4, extra, timeout=180))


@pytest.mark.parametrize("extra", [["train.recompute=full"], ["train.recompute=selective"],
                                   ["parallel.pp_defer_wgrad=false"]])
def test_pipeline_with_recompute_or_plain_backward_equals_single_process(corpus, tmp_path, tmp_path_factory, extra):
    """Deferred weight gradients (on by default) under recomputation, whose forward replays inside
    the backward, and the plain backward they replace."""
    ref = reference(corpus, tmp_path_factory)
    extra = ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", *extra]
    assert_matches(ref, run_ranks(_rank, 2, corpus, tmp_path, 2, extra, timeout=180))


@pytest.mark.parametrize("zero,kind,virtual", [(1, "1f1b", 1), (1, "interleaved", 2)])
def test_bf16_weights_pipeline_equals_single_process(corpus, tmp_path, tmp_path_factory, zero, kind, virtual):
    """bf16 weights (ZeRO 1-3) send bf16 activations between stages: the same bits as one process
    running the same micro-batches in bf16 (the stages agree on the dtype, or the first send fails)."""
    bf16 = (f"parallel.zero={zero}", "train.dtype=bfloat16")
    ref = reference(corpus, tmp_path_factory, *bf16)
    extra = [*bf16, "parallel.pp=2", f"parallel.pp_schedule={kind}", f"parallel.pp_virtual={virtual}"]
    assert_matches(ref, run_ranks(_rank, 2, corpus, tmp_path, 2, extra, timeout=180))


@pytest.mark.parametrize("kind,virtual", SCHEDULES)
def test_data_parallel_times_pipeline_equals_single_process(corpus, tmp_path, tmp_path_factory, kind, virtual):
    ref = reference(corpus, tmp_path_factory)
    extra = ["parallel.dp=2", "parallel.pp=2", f"parallel.pp_schedule={kind}", f"parallel.pp_virtual={virtual}"]
    ranks = run_ranks(_rank, 4, corpus, tmp_path, 4, extra, timeout=180)
    assert_matches(ref, ranks)
    # ZeRO-0 (DDP) defers weight gradients by default, on every rank holding a chunk after the
    # first (virtual stage 0 sends no gradient: nothing of it defers, and it keeps no store)
    assert sum(r["defers"] for r in ranks) == (4 if virtual == 2 else 2)


def _rank_with_receives_reported_on_arrival(corpus, run_dir, world_size, extra):
    """NCCL's completion semantics on gloo: a receive reports itself complete once its data is there
    (gloo's reports nothing before it is waited), so owed weight gradients are flushed late, where
    NCCL would flush them: possibly not before the rank's last backward."""
    from meshlm.parallel.pipeline import engine
    from meshlm.parallel.pipeline.schedules import BACKWARD, FORWARD, RECV_ACT, RECV_GRAD

    def arrived(ins, recv_handle):
        if ins.op not in (FORWARD, BACKWARD):
            return False
        handle = recv_handle.get((RECV_ACT if ins.op == FORWARD else RECV_GRAD, ins.chunk, ins.microbatch))
        if handle is not None:
            handle.wait()
        return True

    engine.PipelineEngine._input_ready = staticmethod(arrived)
    return _rank(corpus, run_dir, world_size, extra)


@pytest.mark.parametrize("zero", [0, 1])
def test_weight_gradients_owed_at_the_last_backward_are_in_the_data_parallel_reduction(
        corpus, tmp_path, tmp_path_factory, monkeypatch, zero):
    """Interleaved, pp rank 0's last backward is chunk 0's (it defers nothing) and syncs: the
    weight gradients chunk 1 still owes must be in DDP's buckets before it, not added after the
    buckets went on the wire (wrong gradients, different on each dp replica). On gloo's rings: the
    shared-memory all-reduce starts at its wait, which would hide a bucket launched too early."""
    ref = reference(corpus, tmp_path_factory)
    monkeypatch.setenv("MESHLM_SHM_DISABLE", "1")
    extra = ["parallel.dp=2", "parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2",
             f"parallel.zero={zero}"]
    ranks = run_ranks(_rank_with_receives_reported_on_arrival, 4, corpus, tmp_path, 4, extra, timeout=180)
    if zero == 0:
        assert_matches(ref, ranks)
    else:  # ZeRO-1's gradients are sharded: the losses and the weights after three steps
        for got in ranks:
            assert got["losses"] == pytest.approx(ref["losses"], abs=1e-6)
            for name, value in got["params"].items():
                assert (value - ref["params"][name]).abs().max() <= 1e-5, name


def _mismatched_shapes():
    from meshlm.comm import Comm
    from meshlm.mesh import Layout
    from meshlm.parallel.pipeline.p2p import PipelineP2P, TensorSpec

    import torch.distributed as dist

    p2p = PipelineP2P(Comm(ParallelContext(Layout(pp=2))))
    p2p.agree(TensorSpec((2, 16, 32 if dist.get_rank() == 0 else 48), torch.float32))


def test_stages_that_disagree_on_activation_shapes_fail_clearly_instead_of_hanging():
    with pytest.raises(RankFailure) as e:
        run_ranks(_mismatched_shapes, 2, timeout=60)
    assert "expects activations of [2, 16, 32] float32 but pipeline rank 1 expects [2, 16, 48]" in str(e.value)


# Through the CLI once, with the schedule that exercises the most (chunks, virtual stages): each
# schedule's parity with one process is tested in-process above, at a fraction of the time.
@pytest.mark.parametrize("kind,virtual", [("interleaved", 2)])
def test_meshlm_train_with_pp_follows_the_single_process_loss_curve(corpus, tmp_path, tmp_path_factory, kind,
                                                                     virtual):
    ref = reference(corpus, tmp_path_factory, "train.steps=4")  # 1 + 3 steps; the LR schedule spans 4
    proc = subprocess.run(
        [sys.executable, "-m", "meshlm.cli", "train", "--nproc", "2", "parallel.pp=2", f"parallel.pp_schedule={kind}",
         f"parallel.pp_virtual={virtual}",
         *MODEL, f"data.path={corpus / 'topics.txt'}", f"data.cache_dir={corpus / 'cache'}", "train.seq_len=16",
         "train.global_batch_size=8", "train.micro_batch_size=2", "train.warmup_steps=2", "train.steps=4",
         "train.lr=1e-3", "train.eval_interval=3", "train.eval_batches=2", "run.sample_tokens=4",
         f"run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["loss"] for r in rows[:3]] == pytest.approx(ref["losses"][1:], abs=1e-5)
    assert rows[2]["eval_loss"] == pytest.approx(ref["eval"], abs=1e-5)  # after 3 steps, like the reference
    assert {"pp_bubble_measured", "pp_bubble_predicted"} <= set(rows[-1])
    assert "--- sample" in proc.stdout  # `meshlm generate`'s loader read the gathered weights


def _against_torch_pipelining():
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    from meshlm.bench.pp import ChunkModule, build_stage
    from meshlm.comm import Comm
    from meshlm.mesh import Layout
    from meshlm.parallel.pipeline.engine import PipelineEngine
    from meshlm.parallel.pipeline.p2p import PipelineP2P
    from meshlm.model.loss import token_loss_sum

    import torch.distributed as dist

    ctx = ParallelContext(Layout(pp=2))
    rank, m = ctx.rank, 4
    tokens = torch.randint(0, 512, (8, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    diffs = {}
    for kind, v, defer in (("1f1b", 1, False), ("1f1b", 1, True), ("interleaved", 2, True)):
        cfg = resolve(load_config(None, [*MODEL, "model.n_layers=4", "train.seq_len=16", "parallel.pp=2",
                                         f"parallel.pp_schedule={kind}", f"parallel.pp_virtual={v}"]), world_size=2)
        ours, _ = build_stage(cfg, 2, rank, v, ctx.device)
        PipelineEngine(ours, PipelineP2P(Comm(ctx)), defer_weight_grads=defer).run(
            build_schedule(kind, 2, m, v)[rank], list(zip(inputs.chunk(m), targets.chunk(m))),
            loss_fn=token_loss_sum, loss_divisor=float(targets.numel()))
        theirs, _ = build_stage(cfg, 2, rank, v, ctx.device)
        stages = [PipelineStage(ChunkModule(theirs, c), c * 2 + rank, 2 * v, ctx.device) for c in range(v)]
        loss_fn = lambda out, tgt: token_loss_sum(out, tgt) / targets.numel()  # noqa: E731
        schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=False) if v > 1 else \
            Schedule1F1B(stages[0], m, loss_fn=loss_fn, scale_grads=False)
        schedule.step(inputs, return_outputs=False) if rank == 0 else schedule.step(target=targets)
        mine = dict(ours.named_parameters())
        diffs[kind, defer] = max((mine[n].grad - p.grad).abs().max().item() for n, p in theirs.named_parameters())
        dist.barrier()
    return diffs


def test_gradients_equal_torch_pipelinings_for_the_same_stages_and_schedule():
    for rank_diffs in run_ranks(_against_torch_pipelining, 2, timeout=120):
        assert len(rank_diffs) == 3 and all(diff <= 1e-6 for diff in rank_diffs.values()), rank_diffs
