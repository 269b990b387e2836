"""What the pipeline tests share: the small deep model, a run of a few steps on any layout (step
0's gradients, losses, parameters, evaluation, the gathered weights), the single-process
reference it is compared with (computed once per model), and the comparison itself."""

import pytest
import torch

from meshlm.config import load_config, resolve
from meshlm.mesh import ParallelContext
from meshlm.train.data import prepare_data
from meshlm.train.trainer import Trainer

from helpers import poisoned_empty


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
