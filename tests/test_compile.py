"""train.compile: every transformer block compiled (parallel/compile.py) trains as in eager mode, on
one process and on layouts whose hooks, collectives and checkpoints surround the compiled code.

The tests compile with aot_eager: dynamo captures the graphs and AOTAutograd traces forward and
backward as inductor would receive them, without inductor's C++ code generation (~15 s for the
first step of the debug model on a 2-core VM). A counting backend proves the compiled code ran (a
no-op train.compile fails here) and that the blocks share their graphs rather than compiling one
each."""

from unittest import mock

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend

from meshlm.testing import run_ranks

from helpers import build_trainer, small_cfg

STEPS = 4
LAYERS = 4
FIRST_COMPILED_STEP = 3  # on a CPU, the memory tracker's steps (1 and 2) run the blocks eagerly
COMPILED = ("train.compile=true", "train.compile_backend=aot_eager")


class CountingBackend:
    """Stands in for torch.compile while the model is built: the backend the config named, wrapped
    to count the graphs dynamo hands it and the calls of each compiled graph."""

    def __init__(self):
        self.graphs = self.calls = 0
        self.backend = None  # the name the config passed
        self.compile = torch.compile

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        compiled = lookup_backend(self.backend)(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run

    def torch_compile(self, fn, *, backend, **options):
        self.backend = backend
        return self.compile(fn, backend=self, **options)


def train(corpus, run_dir, world_size, *extra):
    """STEPS steps: (losses, gradient norms, step FIRST_COMPILED_STEP's gradients on one process,
    full weights on global rank 0, graphs compiled, compiled-graph calls, rank). A rank starts
    without the parent's compiled graphs, and fails if any function recompiles past dynamo's limit."""
    torch._dynamo.reset()
    counter = CountingBackend()
    cfg = small_cfg(corpus, run_dir, world_size, f"model.n_layers={LAYERS}", *extra, steps=STEPS)
    with mock.patch.object(torch, "compile", counter.torch_compile):
        trainer = build_trainer(cfg)
    grads = {}
    if world_size == 1:  # DDP's .grad views, read before that step's update
        clip_and_step = trainer.dp.clip_and_step

        def snapshot(*args):
            if trainer.step + 1 == FIRST_COMPILED_STEP:
                grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()})
            return clip_and_step(*args)

        trainer.dp.clip_and_step = snapshot
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        results = [trainer.train_step() for _ in range(STEPS)]
    weights = {name: t.detach().clone() for name, t in trainer.full_state_dict().items()}
    torch._dynamo.reset()
    return ([r.loss for r in results], [r.grad_norm for r in results], grads, weights, counter.graphs,
            counter.calls, trainer.ctx.rank)


@pytest.fixture(scope="module")
def eager(corpus, tmp_path_factory):
    return train(corpus, tmp_path_factory.mktemp("eager"), 1)


def test_compiled_blocks_train_as_eager_on_one_process(corpus, tmp_path, eager):
    # Selective recompute puts a checkpoint of each block's attention core inside the graph. The
    # memory tracker (a dispatch mode, under which dynamo does not run) measures steps 1 and 2.
    losses, norms, grads, weights, graphs, calls, _ = train(corpus, tmp_path, 1, *COMPILED, "train.recompute=selective",
                                                            "train.track_memory=true")
    ref_losses, ref_norms, ref_grads, ref_weights = eager[:4]
    assert graphs == 1  # one graph for the 4 blocks: no recompilation per block
    micro_batches = 4  # global batch 8 / micro-batch 2
    assert calls == (STEPS - FIRST_COMPILED_STEP + 1) * micro_batches * LAYERS
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert torch.allclose(grads[name], ref, atol=1e-6, rtol=0), name
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert norms == pytest.approx(ref_norms, abs=1e-6)
    for name, ref in ref_weights.items():
        assert torch.allclose(weights[name], ref, atol=1e-5, rtol=0), name


@pytest.mark.parametrize("world,layout", [
    # FSDP's gather/reshard hooks around each compiled block.
    (2, ["parallel.dp=2", "parallel.zero=3"]),
    # TP's collectives inside the block (graph breaks), inside the recompute checkpoint.
    (2, ["parallel.tp=2", "train.recompute=full"]),
    # A stage of blocks whose linears defer their weight gradients (run eagerly, in the store).
    (2, ["parallel.pp=2"]),
], ids=["dp2-zero3", "tp2-recompute", "pp2"])
def test_compiled_blocks_train_as_one_eager_process_on_layouts(corpus, tmp_path, eager, world, layout):
    ref_losses, ref_norms, _, ref_weights = eager[:4]
    results = run_ranks(train, world, corpus, tmp_path, world, *COMPILED, *layout, timeout=300)
    for losses, norms, _, weights, graphs, calls, rank in results:
        assert graphs > 0 and calls > 0, rank
        assert losses == pytest.approx(ref_losses, abs=1e-5), rank
        assert norms == pytest.approx(ref_norms, abs=1e-6), rank
        if rank == 0:  # the gathered full weights live on global rank 0
            assert weights.keys() == ref_weights.keys()
            for name, ref in ref_weights.items():
                assert torch.allclose(weights[name], ref, atol=1e-5, rtol=0), name
