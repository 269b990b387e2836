"""The trainer against its single-process reference: accumulation, data parallelism, the global
token normalisation, activation checkpointing and bf16."""

import pytest
import torch

from meshlm.testing import run_ranks
from meshlm.train.trainer import IGNORE_INDEX

from helpers import GLOBAL_BATCH, UnevenlyMaskedLoader, build_trainer, small_cfg


def make_cfg(corpus, run_dir, world_size=1, *extra):
    return small_cfg(corpus, run_dir, world_size, *extra, steps=4)


def grads_then_steps(cfg, n_steps=3, loader_cls=None):
    """(gradients of step 0, losses of n_steps, parameters after them)."""
    torch.manual_seed(123)  # must not matter: init and data depend only on run.seed
    trainer = build_trainer(cfg, loader_cls)
    trainer.forward_backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.dp.zero_grad()
    losses = [trainer.train_step().loss for _ in range(n_steps)]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return grads, losses, params


def assert_close(ref, got, grad_tol=1e-6, param_tol=1e-5):
    (g0, l0, p0), (g1, l1, p1) = ref, got
    for name in g0:
        assert (g0[name] - g1[name]).abs().max() <= grad_tol, name
    assert l0 == pytest.approx(l1, abs=1e-5)
    for name in p0:
        assert (p0[name] - p1[name]).abs().max() <= param_tol, name


def test_accumulation_equals_one_large_batch(corpus, tmp_path):
    one_batch = grads_then_steps(make_cfg(corpus, tmp_path / "a", 1, f"train.micro_batch_size={GLOBAL_BATCH}"))
    accumulated = grads_then_steps(make_cfg(corpus, tmp_path / "b", 1, "train.micro_batch_size=2"))
    assert_close(one_batch, accumulated)
    assert one_batch[1][-1] < one_batch[1][0]  # and it learns


def _dp_rank(corpus, run_dir, world_size, loader_cls=None):
    return grads_then_steps(make_cfg(corpus, run_dir, world_size), loader_cls=loader_cls)


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_equals_single_process(corpus, tmp_path, world_size):
    reference = grads_then_steps(make_cfg(corpus, tmp_path / "ref", 1))
    results = run_ranks(_dp_rank, world_size, corpus, tmp_path / "dp", world_size, timeout=120)
    for rank_result in results:
        assert_close(reference, rank_result)


def test_loss_is_normalised_by_the_global_target_token_count(corpus, tmp_path):
    reference = grads_then_steps(make_cfg(corpus, tmp_path / "ref", 1), loader_cls=UnevenlyMaskedLoader)
    results = run_ranks(_dp_rank, 2, corpus, tmp_path / "dp", 2, UnevenlyMaskedLoader, timeout=120)
    for rank_result in results:
        assert_close(reference, rank_result)
    # The test only means something if the ranks really hold different numbers of targets.
    loader = build_trainer(make_cfg(corpus, tmp_path / "c", 1), UnevenlyMaskedLoader).loader
    counts = [int((targets != IGNORE_INDEX).sum()) for _, targets in (loader.local_batch(0, r, 2) for r in range(2))]
    assert counts[0] != counts[1]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_gradients(corpus, tmp_path, mode):
    reference = grads_then_steps(make_cfg(corpus, tmp_path / "a", 1), n_steps=1)
    recomputed = grads_then_steps(make_cfg(corpus, tmp_path / "b", 1, f"train.recompute={mode}"), n_steps=1)
    assert_close(reference, recomputed)


def test_bf16_autocast_trains_close_to_fp32(corpus, tmp_path):
    _, fp32_losses, _ = grads_then_steps(make_cfg(corpus, tmp_path / "a", 1), n_steps=3)
    _, bf16_losses, params = grads_then_steps(make_cfg(corpus, tmp_path / "b", 1, "train.dtype=bfloat16"), n_steps=3)
    assert all(p.dtype == torch.float32 for p in params.values())  # fp32 master weights
    assert bf16_losses == pytest.approx(fp32_losses, abs=0.05)
    assert bf16_losses != fp32_losses  # autocast really ran in bf16


def test_eval_loss_is_the_same_for_every_dp_layout(corpus, tmp_path):
    single = build_trainer(make_cfg(corpus, tmp_path / "a", 1)).evaluate()
    ranks = run_ranks(lambda: build_trainer(make_cfg(corpus, tmp_path / "b", 2)).evaluate(), 2)
    assert ranks == pytest.approx([single, single], abs=1e-6)
