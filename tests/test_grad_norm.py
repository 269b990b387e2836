"""The reported gradient norm and clipping under every layout, against one process.

A replicated parameter (a norm weight under TP, the tied embedding's pipeline duplicate, a kv head
replicated across tp ranks) must count toward the global norm exactly once, and ZeRO/FSDP shards
and CP's token split must add up to the same sum of squares. With `train.grad_clip` far below the
norm, clipping scales every update by clip/norm, so a wrong norm also changes every weight: both
the reported norm (each step) and the weights after three clipped AdamW steps are compared.
Every layout also leaves no communication pending: each async op a step starts, it waits for."""

import pytest
import torch

from meshlm.testing import run_ranks

from helpers import build_trainer, small_cfg

STEPS = 3
CLIP = ("train.grad_clip=0.05",)  # the debug model's norms are ~0.3-0.6: clipping binds on every step


def norms_losses_weights(corpus, run_dir, world_size, layouts):
    out = []
    for layout in layouts:
        cfg = small_cfg(corpus, run_dir, world_size, *CLIP, *layout, steps=STEPS)
        trainer = build_trainer(cfg)
        results = [trainer.train_step() for _ in range(STEPS)]
        pending = [(op["op"], op["axis"]) for op in trainer.comm.recorder.pending()]  # started, never waited
        weights = {name: t.detach().clone() for name, t in trainer.full_state_dict().items()}
        out.append(([r.grad_norm for r in results], [r.loss for r in results],
                     weights if trainer.ctx.rank == 0 else None, pending))
    return out


TIED = ("model.tie_embeddings=true",)
BATCH6 = ("train.global_batch_size=6",)
HEADS6 = ("model.dim=96", "model.n_heads=6", "model.n_kv_heads=3", "model.ffn_dim=192")
LAYOUTS = {
    2: [("parallel.zero=0",), ("parallel.zero=1",), ("parallel.zero=2",), ("parallel.zero=3",),
        ("parallel.tp=2",), ("parallel.tp=2", "parallel.sp=true"), ("parallel.cp=2",),
        ("parallel.pp=2", *TIED), ("parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "model.n_layers=4")],
    4: [("parallel.tp=4",),  # tp a multiple of n_kv_heads=2: each kv head replicated on two ranks
        ("parallel.dp=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero=1", *TIED),
        ("parallel.dp=2", "parallel.pp=2", "parallel.zero=1", *TIED),
        ("parallel.tp=2", "parallel.sp=true", "parallel.pp=2", *TIED),  # sequence shards between stages
        ("parallel.tp=2", "parallel.cp=2", "parallel.zero=0"),
        ("parallel.dp=2", "parallel.cp=2", "parallel.zero=3")],
    # A world that is not a power of two, where off-by-one shard and rank arithmetic that 2 and 4
    # forgive shows: bucket and FSDP shards of 1/3 (padded), vocab 512 in shards of 171 (padded
    # to 513), heads and sequence split 3 ways, 3 pipeline stages, 6 CP chunks of 5 tokens.
    3: [(*BATCH6, f"parallel.zero={zero}") for zero in range(4)] + [
        (*HEADS6, "train.seq_len=30", "parallel.tp=3", "parallel.sp=true"),
        (*HEADS6, "model.n_kv_heads=1", "parallel.tp=3"),  # one kv head replicated on 3 ranks
        ("train.seq_len=30", "parallel.cp=3"),
        ("model.n_layers=3", "parallel.pp=3", *TIED),
        (*BATCH6, "model.n_layers=6", "parallel.pp=3", "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2")],
}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_grad_norm_and_clipping_equal_one_process(corpus, tmp_path, world):
    layouts = LAYOUTS[world]
    def model_keys(layout):  # the single-process reference has the same model and batch
        return tuple(x for x in layout if x.startswith(("model.", "train.")))

    refs = {}
    for model in sorted({model_keys(layout) for layout in layouts}):
        ((norms, losses, weights, _),) = norms_losses_weights(corpus, tmp_path / "one", 1, [model])
        assert min(norms) > 5 * float(CLIP[0].split("=")[1])  # clipping acts on every step
        refs[model] = norms, losses, weights
    per_rank = run_ranks(norms_losses_weights, world, corpus, tmp_path / "n", world, layouts, timeout=400)
    for i, layout in enumerate(layouts):
        ref_norms, ref_losses, ref_weights = refs[model_keys(layout)]
        for rank, results in enumerate(per_rank):
            norms, losses, weights, pending = results[i]
            assert pending == [], (layout, rank)  # every async op a step started, it also waited for
            assert norms == pytest.approx(ref_norms, rel=1e-6), (layout, rank)
            assert losses == pytest.approx(ref_losses, abs=1e-5), (layout, rank)
            if weights is not None:
                for name, ref in ref_weights.items():
                    assert torch.allclose(weights[name], ref, atol=1e-5, rtol=0), (layout, name)


def _norms_of_distinct_squares_rank():
    from meshlm.comm import Comm
    from meshlm.mesh import Layout, ParallelContext
    from meshlm.parallel.grad_norm import global_grad_norm

    comm = Comm(ParallelContext(Layout(tp=2, dp=2, pp=2)))
    squares = torch.tensor(2.0 ** comm.ctx.rank)  # each rank a distinct bit: a sum names its ranks
    replicated, sharded = global_grad_norm(squares, comm), global_grad_norm(squares, comm, dp_sharded=True)
    return replicated.item() ** 2, sharded.item() ** 2, squares.item()


def test_the_norm_sums_over_data_parallel_ranks_only_when_they_hold_distinct_shards():
    """The global norm's contract on its own, at tp 2 x dp 2 x pp 2: tp and pp shards are always
    distinct elements (summed); dp replicas hold copies (ZeRO-0/1, the default), summed only with
    `dp_sharded` (ZeRO-2/3). Rank r contributes 2^r, so each squared norm says which ranks it
    summed; the expected sets come from the layout's rank formula, r = tp_i + 2 * (dp_i + 2 * pp_i).
    The engines' tests pass `dp_sharded` explicitly; a parameterless pipeline stage relies on
    the default (with True it would issue a dp all-reduce no other engine does)."""
    per_rank = run_ranks(_norms_of_distinct_squares_rank, 8, timeout=120)
    for rank, (replicated, sharded, mine) in enumerate(per_rank):
        same_dp = [r for r in range(8) if (r // 2) % 2 == (rank // 2) % 2]  # every tp and pp coordinate
        assert mine == 2.0 ** rank
        assert replicated == pytest.approx(sum(2.0 ** r for r in same_dp), rel=1e-6), rank
        assert sharded == pytest.approx(2.0 ** 8 - 1, rel=1e-6), rank
