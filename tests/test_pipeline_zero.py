"""Pipelines beside ZeRO and across tied weights, against the single-process reference: ZeRO-3
interleaved with a chunk of no layers (each backward gathers and reduces its own chunk's units
only), the tied embedding kept in sync between first and last stage (with ZeRO 1-3), and a stage
without parameters under data parallelism."""

import pytest
import torch

from meshlm.mesh import ParallelContext
from meshlm.testing import run_ranks
from meshlm.train.data import prepare_data
from meshlm.train.trainer import Trainer

from helpers import build_trainer
from pipeline_runs import _rank, assert_matches, make_cfg, reference, run


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
