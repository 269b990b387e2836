"""3D and 4D parallelism: data (ZeRO) x tensor (+sequence) x context x pipeline parallelism composed
in one run of 8 or 16 ranks, against the single-process run: the same losses and the same weights
after AdamW."""

import pytest
import torch

from meshlm.testing import run_ranks

from helpers import build_trainer, small_cfg

STEPS = 3


def losses_and_weights(corpus, run_dir, world_size, *extra):
    cfg = small_cfg(corpus, run_dir, world_size, "model.n_layers=4", *extra, steps=STEPS)
    trainer = build_trainer(cfg)
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    weights = {name: t.detach().clone() for name, t in trainer.full_state_dict().items()}
    return losses, weights, trainer.ctx.rank


@pytest.mark.parametrize("zero", [1, 3])
def test_dp_tp_sp_pp_on_eight_ranks_equals_one_process(corpus, tmp_path, zero):
    ref_losses, ref_weights, _ = losses_and_weights(corpus, tmp_path / "one", 1)
    layout = ["parallel.dp=2", "parallel.tp=2", "parallel.sp=true", "parallel.pp=2", f"parallel.zero={zero}",
              "model.tie_embeddings=false"]  # ZeRO cannot sync tied embeddings across pipeline stages
    results = run_ranks(losses_and_weights, 8, corpus, tmp_path / "3d", 8, *layout, timeout=300)
    for losses, weights, rank in results:
        assert losses == pytest.approx(ref_losses, abs=1e-5), rank
        if rank == 0:  # the gathered full weights live on global rank 0
            assert weights.keys() == ref_weights.keys()
            for name, ref in ref_weights.items():
                assert torch.allclose(weights[name], ref, atol=1e-5, rtol=0), name


@pytest.mark.parametrize("world,layout", [
    (8, ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2", "parallel.pp=2", "model.tie_embeddings=true"]),
    (16, ["parallel.dp=2", "parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.pp_schedule=interleaved",
          "parallel.pp_virtual=2", "parallel.zero=2"]),
], ids=["tp2-sp-cp2-pp2-tied", "dp2-tp2-cp2-pp2-interleaved-zero2"])
def test_all_four_axes_equal_one_process(corpus, tmp_path, world, layout):
    tied = [x for x in layout if x.startswith("model.")]
    ref_losses, ref_weights, _ = losses_and_weights(corpus, tmp_path / "one", 1, *tied)
    results = run_ranks(losses_and_weights, world, corpus, tmp_path / "4d", world, *layout, timeout=400)
    for losses, weights, rank in results:
        assert losses == pytest.approx(ref_losses, abs=1e-5), rank
        if rank == 0:
            assert weights.keys() == ref_weights.keys()
            for name, ref in ref_weights.items():
                assert torch.allclose(weights[name], ref, atol=1e-5, rtol=0), name
