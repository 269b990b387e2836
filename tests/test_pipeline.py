"""Pipeline parallelism against the single-process reference (same seed, same global batch):
every schedule at pp = 2 and 4 with m = 4 and 8, dp=2 x pp=2, tied embeddings across first and
last stage, a stage without parameters under DP, the shape handshake, evaluation, the gathered
weights, and `meshlm train --nproc 2 parallel.pp=2` through torchrun."""

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
from meshlm.train.data import prepare_data
from meshlm.train.trainer import Trainer

from helpers import build_trainer, poisoned_empty

GLOBAL_BATCH = 8
# Small enough for 4 ranks on 2 cores, deep enough for pp=4 x 2 virtual stages.
MODEL = ["model.preset=debug", "model.dim=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=64",
         "model.n_layers=8"]


def make_cfg(corpus, run_dir, world_size, *extra):
    return resolve(load_config(None, [
        *MODEL, f"data.path={corpus / 'topics.txt'}", f"data.cache_dir={corpus / 'cache'}",
        "train.seq_len=16", f"train.global_batch_size={GLOBAL_BATCH}", "train.micro_batch_size=2",
        "train.warmup_steps=2", "train.steps=4", "train.lr=1e-3", "train.eval_interval=0", "train.eval_batches=2",
        f"run.dir={run_dir}", "train.track_memory=false", *extra]), world_size=world_size)


def run(cfg, n_steps=3):
    """Step 0's gradients by name, n_steps losses, parameters after them, eval loss, bubble metrics
    and (on global rank 0) the gathered full weights."""
    torch.manual_seed(99)  # must not matter: init and data depend only on run.seed
    data = prepare_data(cfg.data, cfg.model.vocab_size, log=lambda m: None)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg.parallel), data)
    trainer.metrics.active = False
    loss_sum, tokens = trainer.forward_backward()
    first_loss = trainer._all_reduce(loss_sum.clone()).item() / tokens
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.dp.zero_grad()
    losses = [trainer.train_step().loss for _ in range(n_steps)]
    metrics = trainer.pipeline.step_metrics() if trainer.pipeline else {}
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    full = trainer.full_state_dict()
    return {"grads": grads, "losses": [first_loss, *losses], "params": params, "eval": trainer.evaluate(),
            "metrics": metrics, "full": {k: v.clone() for k, v in full.items()} if trainer.ctx.rank == 0 else None,
            "defers": trainer.pipeline is not None and trainer.pipeline.engine.weight_grads is not None,
            "tied": (trainer.model.output.weight.detach().clone() if hasattr(trainer.model, "output") else
                     trainer.model.tok_embeddings.weight.detach().clone() if hasattr(trainer.model, "tok_embeddings")
                     else None)}


_REFERENCES = {}


def reference(corpus, tmp_path_factory, *model):
    if model not in _REFERENCES:
        _REFERENCES[model] = run(make_cfg(corpus, tmp_path_factory.mktemp("ref"), 1, *model))
    return _REFERENCES[model]


def assert_matches(ref, ranks, aliases=None):
    """Loss, gradients (each rank holds some; together all of them), parameters after AdamW steps.
    `aliases`: names of pipeline copies -> the single-process parameter they copy."""
    aliases = aliases or {}
    covered = set()
    for got in ranks:
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-6)
        for name, grad in got["grads"].items():
            assert (grad - ref["grads"][aliases.get(name, name)]).abs().max() <= 1e-6, name
            covered.add(aliases.get(name, name))
        for name, value in got["params"].items():
            assert (value - ref["params"][aliases.get(name, name)]).abs().max() <= 1e-5, name
        assert got["eval"] == pytest.approx(ref["eval"], abs=1e-6)
    assert covered == set(ref["grads"])


def _rank(corpus, run_dir, world_size, extra):
    with poisoned_empty():  # with dp, buffers read before they are written would show as NaN
        return run(make_cfg(corpus, run_dir, world_size, *extra))


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]


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


def _sharded_rank(corpus, run_dir, extra):
    """Three steps' losses and (global rank 0) the full weights after them: gradients sharded."""
    trainer = build_trainer(make_cfg(corpus, run_dir, 2, *extra))
    losses = [trainer.train_step().loss for _ in range(3)]
    full = trainer.full_state_dict()
    return {"losses": losses, "full": {k: v.clone() for k, v in full.items()} if trainer.ctx.rank == 0 else None}


@pytest.mark.parametrize("split", ["3,3,0,2", "2,0,3,3"])
def test_zero3_interleaved_with_a_chunk_of_no_layers_equals_single_process(corpus, tmp_path, tmp_path_factory, split):
    """A rank whose later chunk has no layers: its first backward of a step reaches no unit. FSDP
    took every unit for unused after that backward, reduced the next backward's units at their
    first gradient and freed them under it (a crash). What is unused is decided at the step's end."""
    ref = reference(corpus, tmp_path_factory)
    extra = ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", f"parallel.pp_layers={split}",
             "parallel.zero=3"]
    ranks = run_ranks(_sharded_rank, 2, corpus, tmp_path, extra, timeout=180)
    for got in ranks:
        assert got["losses"] == pytest.approx(ref["losses"][1:], abs=1e-6)
    full = ranks[0]["full"]
    assert set(full) == set(ref["params"]) and all((full[n] - ref["params"][n]).abs().max() <= 1e-5 for n in full)


def _blocks_gathered_per_backward_rank(corpus, run_dir, extra):
    """Step 2's backwards in order: the blocks each gathers (its own, or prefetched)."""
    trainer = build_trainer(make_cfg(corpus, run_dir, 2, *extra))
    fsdp, seen, per_backward = trainer.dp, [], []
    gather, pre_backward, end = fsdp._gather, fsdp._pre_backward, fsdp._end_of_backward
    in_backward = [False]

    def traced_gather(unit, wait=True):
        if in_backward[0] and not unit.gathered and unit is not fsdp.root:
            seen.append(unit.name)
        return gather(unit, wait)

    def traced_pre_backward(unit):
        in_backward[0] = True
        pre_backward(unit)

    def traced_end():
        per_backward.append(sorted(set(seen)))
        seen.clear()
        in_backward[0] = False
        end()

    fsdp._gather, fsdp._pre_backward, fsdp._end_of_backward = traced_gather, traced_pre_backward, traced_end
    trainer.train_step()
    per_backward.clear()
    trainer.train_step()
    return per_backward


def test_zero3_interleaved_a_chunks_backward_gathers_its_own_blocks_only(corpus, tmp_path):
    """FSDP prefetched the next block in the rank's order, under an interleaved schedule the other
    chunk's (and the root's output gradient prefetched the rank's top block in every chunk's
    backward): gathered for nothing, it stayed unsharded to the backward's end (one block's
    parameters beside the first stage's backward peak: -15% against the memory model)."""
    extra = ["parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "model.n_layers=4",
             "parallel.zero=3"]
    for per_backward in run_ranks(_blocks_gathered_per_backward_rank, 2, corpus, tmp_path, extra, timeout=180):
        assert len(per_backward) == 8  # 4 micro-batches x 2 chunks
        assert all(len(blocks) == 1 for blocks in per_backward), per_backward  # a chunk is one block here


def _bytes_per_backward_rank(corpus, run_dir, extra):
    """Step 2, interleaved ZeRO-3: per forward and per backward (in program order), the chunk and
    the bytes all-gathered and reduce-scattered over dp, beside what the chunk's own units hold
    (from parameter counts: each block a unit, the chunk's share of the root one more; padded to
    the dp size, fp32)."""
    from meshlm.parallel.pipeline.schedules import BACKWARD

    trainer = build_trainer(make_cfg(corpus, run_dir, 4, *extra))
    stage, recorder, dp = trainer.model, trainer.dp.comm.recorder, trainer.ctx.size("dp")

    def units(chunk, blocks_only=False):
        out = [sum(p.numel() for p in stage.layers[str(i)].parameters()) for i in stage.chunk_layers[chunk]]
        root = sum(p.numel() for m in stage.chunk_modules(chunk) if m not in list(stage.layers.values())
                   for p in m.parameters())
        out += [] if blocks_only or not root else [root]
        return sum(-(-n // dp) * dp * 4 for n in out)

    def dp_bytes(op, start):
        return sum(r.nbytes for r in list(recorder.records)[start:] if r.op == op and r.axis == "cp+dp")

    measured, original = [], torch.autograd.backward
    stage.register_forward_pre_hook(lambda m, args: measured.append(["F", args[1], len(recorder.records)]),
                                   prepend=True)
    stage.register_forward_hook(lambda m, args, out: measured[-1].extend(
        [dp_bytes("all_gather", measured[-1][2]), 0]))

    def traced_backward(*args, **kwargs):
        start = len(recorder.records)
        original(*args, **kwargs)
        measured.append(["B", None, start, dp_bytes("all_gather", start), dp_bytes("reduce_scatter", start)])

    trainer.train_step()
    recorder.records.clear()
    measured.clear()
    torch.autograd.backward = traced_backward
    try:
        trainer.train_step()
    finally:
        torch.autograd.backward = original
    backward_chunks = iter([ins.chunk for ins in trainer.pipeline.program if ins.op == BACKWARD])
    rows = []
    for kind, chunk, _, gathered, reduced in measured:
        chunk = next(backward_chunks) if kind == "B" else chunk
        expect = (units(chunk), 0) if kind == "F" else (units(chunk, blocks_only=True), units(chunk))
        rows.append((kind, chunk, (gathered, reduced), expect))
    return rows


def test_zero3_interleaved_each_backward_reduces_its_own_chunks_units_only(corpus, tmp_path):
    """FSDP reduced its units strictly in the rank's order: in one chunk's backward the other
    chunk's units waited, and were reduce-scattered at its end with zero gradients (twice the
    chunk's own bytes a backward here); the root (the embedding, or the norm and the head) was
    gathered in every chunk's forward. Now each forward gathers, and each backward gathers and
    reduces, the units of its own chunk only."""
    extra = ["parallel.pp=2", "parallel.dp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2",
             "model.n_layers=4", "parallel.zero=3"]
    for rows in run_ranks(_bytes_per_backward_rank, 4, corpus, tmp_path, extra, timeout=240):
        assert len(rows) == 8, rows  # 2 micro-batches x 2 chunks, forward and backward
        assert all(measured == expect for _, _, measured, expect in rows), rows


def test_tied_embeddings_stay_in_sync_across_first_and_last_stage(corpus, tmp_path, tmp_path_factory):
    tied = ("model.tie_embeddings=true",)
    ref = reference(corpus, tmp_path_factory, *tied)
    ranks = run_ranks(_rank, 4, corpus, tmp_path, 4, [*tied, "parallel.pp=4", "parallel.pp_schedule=1f1b"],
                      timeout=180)
    assert_matches(ref, ranks, aliases={"output.weight": "tok_embeddings.weight"})
    # Stage 0 holds the embedding, stage 3 the head: after the AdamW steps, bit for bit the same.
    assert torch.equal(ranks[0]["tied"], ranks[3]["tied"])
    assert "output.weight" in ranks[3]["grads"] and "tok_embeddings.weight" in ranks[0]["grads"]


def _tied_zero_rank(corpus, run_dir, extra):
    cfg = make_cfg(corpus, run_dir, 4, *extra)
    data = prepare_data(cfg.data, cfg.model.vocab_size, log=lambda m: None)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg.parallel), data)
    trainer.metrics.active = False
    losses = [trainer.train_step().loss for _ in range(3)]
    full = trainer.full_state_dict()
    # Each stage's copy of the tied weight, whole (collective over dp for the sharded engines).
    own = trainer.dp.full_state_dict()
    copy = own.get("output.weight" if trainer.ctx.coord("pp") == 1 else "tok_embeddings.weight")
    return {"losses": losses, "full": {k: v.clone() for k, v in full.items()} if trainer.ctx.rank == 0 else None,
            "copy": None if copy is None else copy.clone(), "pp": trainer.ctx.coord("pp"),
            "defers": trainer.pipeline.engine.weight_grads is not None}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_tied_embeddings_across_stages_with_zero(corpus, tmp_path, tmp_path_factory, zero):
    """ZeRO shards the tied weight's gradient differently on the first and last stage; the two
    copies must still get the same summed gradient and stay equal, bit for bit."""
    tied = ("model.tie_embeddings=true",)
    ref = reference(corpus, tmp_path_factory, *tied)
    extra = [*tied, "parallel.dp=2", "parallel.pp=2", "parallel.pp_schedule=1f1b", f"parallel.zero={zero}"]
    ranks = run_ranks(_tied_zero_rank, 4, corpus, tmp_path, extra, timeout=180)
    ref_losses = ref["losses"][1:]  # the reference's first entry is the forward-backward before the steps
    for got in ranks:
        assert got["losses"] == pytest.approx(ref_losses, abs=1e-6)
    full, alias = ranks[0]["full"], {"output.weight": "tok_embeddings.weight"}
    assert {alias.get(n, n) for n in full} == set(ref["params"])
    assert all((full[n] - ref["params"][alias.get(n, n)]).abs().max() <= 1e-5 for n in full)
    first = [r["copy"] for r in ranks if r["pp"] == 0]
    last = [r["copy"] for r in ranks if r["pp"] == 1]
    assert all(torch.equal(a, b) for a in first for b in last)
    # ZeRO-2/3 reduce inside each backward: they keep the plain backward (docs/pipeline.md). The
    # first stage sends no gradient and defers nothing in any case.
    assert all(r["defers"] == (zero <= 1 and r["pp"] == 1) for r in ranks)


def _uneven_rank(corpus, run_dir):
    # Stage 1 of 3 gets no layer at all: it only passes activations and gradients along.
    cfg = make_cfg(corpus, run_dir, 6, "model.n_layers=3", "parallel.dp=2", "parallel.pp=3", "parallel.pp_layers=2,0,1")
    out = run(cfg)
    out["n_params"] = len(out["params"])
    return out


def test_a_stage_without_parameters_does_not_break_data_parallelism(corpus, tmp_path, tmp_path_factory):
    ref = reference(corpus, tmp_path_factory, "model.n_layers=3")
    ranks = run_ranks(_uneven_rank, 6, corpus, tmp_path, timeout=180)
    assert [r["n_params"] for r in ranks] == [19, 19, 0, 0, 11, 11]  # ranks: dp fastest, then pp
    assert_matches(ref, ranks)


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
