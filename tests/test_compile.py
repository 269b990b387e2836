"""train.compile: every transformer block compiled (parallel/compile.py) trains as in eager mode, on
one process and on layouts whose hooks, collectives and checkpoints surround the compiled code.

The tests compile with aot_eager: dynamo captures the graphs and AOTAutograd traces forward and
backward as inductor would receive them, without inductor's C++ code generation (~15 s for the
first step of the debug model on a 2-core VM). A counting backend proves the compiled code ran (a
no-op train.compile fails here) and that the blocks share their graphs rather than compiling one
each."""

import collections
from unittest import mock

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend
from torch.utils._python_dispatch import TorchDispatchMode

from meshlm.testing import run_ranks

from helpers import build_trainer, small_cfg

STEPS = 4
LAYERS = 4
FIRST_COMPILED_STEP = 3  # on a CPU, the memory tracker's steps (1 and 2) run the blocks eagerly
COMPILED = ("train.compile=true", "train.compile_backend=aot_eager")


class CountingBackend:
    """Stands in for torch.compile while the model is built: the backend the config named, wrapped
    to count, per compiled function (a block's `forward`, the loss's two chunk kernels), the graphs
    dynamo hands it and the calls of those graphs."""

    def __init__(self):
        self.graphs, self.calls = collections.Counter(), collections.Counter()
        self.compile = torch.compile
        self.backends = {}  # one per function name: dynamo shares graphs only within one backend

    def torch_compile(self, fn, *, backend, **options):
        name = fn.__name__
        if name not in self.backends:
            self.backends[name] = self._counting(name, backend)
        return self.compile(fn, backend=self.backends[name], **options)

    def _counting(self, name, backend):
        def counting(gm, example_inputs):
            self.graphs[name] += 1
            compiled = lookup_backend(backend)(gm, example_inputs)

            def run(*args):
                self.calls[name] += 1
                return compiled(*args)

            return run

        return counting


class Passthrough(TorchDispatchMode):
    """A dispatch mode that changes nothing, as the memory tracker's is to the compiled code."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


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
    assert graphs["forward"] == 1  # one graph for the 4 blocks: no recompilation per block
    micro_batches = 4  # global batch 8 / micro-batch 2
    compiled_micro_batches = (STEPS - FIRST_COMPILED_STEP + 1) * micro_batches
    assert calls["forward"] == compiled_micro_batches * LAYERS
    # the loss's chunk maths, compiled too: at this vocabulary a micro-batch is MIN_CHUNKS equal
    # chunks (a quarter of its rows each), one graph for all
    from meshlm.model.loss import MIN_CHUNKS

    assert graphs["exp_sum_and_target"] == graphs["grad_in_logits_dtype"] == 1
    assert calls["exp_sum_and_target"] == calls["grad_in_logits_dtype"] == compiled_micro_batches * MIN_CHUNKS
    assert_trains_as_eager((losses, norms, grads, weights), eager)


def test_one_process_compiles_the_whole_forward_as_one_graph(corpus, tmp_path, eager):
    # Nothing runs between the blocks on one process without recompute (compiles_whole_model): the
    # model's forward is one graph, called once per micro-batch instead of once per block.
    losses, norms, grads, weights, graphs, calls, _ = train(corpus, tmp_path, 1, *COMPILED)
    assert graphs["forward"] == 1
    assert calls["forward"] == STEPS * 4  # 4 micro-batches a step, no memory tracker: every step compiled
    assert_trains_as_eager((losses, norms, grads, weights), eager)


def test_the_whole_forward_is_compiled_only_where_nothing_runs_between_the_blocks():
    from meshlm.config import load_config, resolve
    from meshlm.parallel.compile import compiles_whole_model

    def whole(*overrides, world=1):
        return compiles_whole_model(resolve(load_config(None, ["model.preset=debug", *overrides]), world))

    assert whole() and whole("parallel.zero=1")
    assert not whole("train.recompute=selective") and not whole("train.recompute=full")
    assert not whole("parallel.zero=3")  # FSDP's gathers around each block, even at one rank
    assert not whole(world=2) and not whole("parallel.tp=2", world=2) and not whole("parallel.pp=2", world=2)
    assert not whole("parallel.cp=2", world=2)
    # two axes of 2, whose quotient is 1: the world, not a ratio of its axes, must be one
    assert not whole("parallel.tp=2", world=4) and not whole("parallel.cp=2", world=4)  # dp 2 beside them
    assert not whole("parallel.tp=2", "parallel.pp=2", world=4) and not whole("parallel.pp=2", "parallel.cp=2", world=4)


def assert_trains_as_eager(compiled, eager):
    """(losses, gradient norms, step FIRST_COMPILED_STEP's gradients, final weights) against the
    eager run's: gradients to 1e-6, losses and weights after four AdamW steps to 1e-5."""
    losses, norms, grads, weights = compiled
    ref_losses, ref_norms, ref_grads, ref_weights = eager[:4]
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
        assert graphs["forward"] > 0 and calls["forward"] > 0, rank
        if layout == ["parallel.pp=2"] and rank == 1:
            # The last stage's linears defer their weight gradients and run eagerly: a block compiles
            # as the 8 pieces around its 7 linears, once for every block, micro-batch and step.
            # (A traced deferred linear recompiled per weight shape and armed state: 22 graphs.)
            assert graphs["forward"] == 8, graphs
        if not (layout == ["parallel.pp=2"] and rank == 0):  # the first stage computes no loss
            assert calls["exp_sum_and_target"] > 0 and calls["grad_in_logits_dtype"] > 0, rank
        assert losses == pytest.approx(ref_losses, abs=1e-5), rank
        assert norms == pytest.approx(ref_norms, abs=1e-6), rank
        if rank == 0:  # the gathered full weights live on global rank 0
            assert weights.keys() == ref_weights.keys()
            for name, ref in ref_weights.items():
                assert torch.allclose(weights[name], ref, atol=1e-5, rtol=0), name


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("consume", [False, True])
def test_compiled_loss_chunks_equal_the_eager_loss(monkeypatch, backend, dtype, consume):
    """The loss's chunk maths compiled (train.compile): the same loss and gradient as eagerly, with
    the gradient in the logits' dtype, over full chunks and a ragged last one (a second shape),
    ignored targets, and more rows than vocabulary entries."""
    from meshlm.model import loss as loss_module
    from meshlm.parallel.compile import compile_loss_kernels

    torch._dynamo.reset()
    vocab, n = 24, 29
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 8 * 4 * vocab)  # 8 rows a chunk: 3 full, then 5
    monkeypatch.setattr(loss_module, "FUSED_CHUNK_BYTES", 8 * 4 * vocab)  # the compiled kernels' too
    gen = torch.Generator().manual_seed(5)
    base = (torch.randn(n, vocab, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[[1, 9, 28]] = loss_module.IGNORE_INDEX
    kernels = compile_loss_kernels(backend)
    row_max = torch.zeros(8)
    assert kernels.grad(base[:8], targets[:8], row_max, row_max + 1, targets[:8] >= 0, consume).dtype == dtype
    # compiled code never writes into an input, even for consumed logits (the compile cache bug
    # in compile_loss_kernels' docstring): the caller copies the gradient
    assert torch.equal(base, (torch.randn(n, vocab, generator=torch.Generator().manual_seed(5)) * 4).to(dtype))
    results = []
    for k in (None, kernels, kernels):  # eager, then compiled twice (the second call reuses the graphs)
        logits = base.clone().requires_grad_()
        loss = loss_module.token_loss_sum(logits, targets, consume_logits=consume, kernels=k)
        (loss * 0.5).backward()
        results.append((loss.item(), logits.grad.clone(), logits.detach().clone()))
    torch._dynamo.reset()
    (eager_loss, eager_grad, _), *compiled = results
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -8  # bf16: at most one rounding apart
    for loss, grad, after in compiled:
        assert grad.dtype == dtype
        assert abs(loss - eager_loss) <= 1e-6 * abs(eager_loss)
        assert (grad.float() - eager_grad.float()).abs().max() <= tolerance
        assert grad[[1, 9, 28]].abs().max() == 0
        assert consume or torch.equal(after, base)


def test_compiled_loss_kernels_take_larger_chunks_except_where_the_eager_ones_run():
    """Inductor's fused chunk maths make no fp32 chunk, so they take MIN_CHUNKS chunks of a
    GPU-sized micro-batch instead of 32 MiB fp32 ones (each chunk costs host time); under a
    dispatch mode (the memory tracker) the eager kernels run in their place, with the eager
    chunks, and backends that do not fuse keep the eager chunks too."""
    from meshlm.model import loss as loss_module
    from meshlm.parallel.compile import compile_loss_kernels

    kernels = compile_loss_kernels("inductor")  # compiles nothing until called
    vocab, tokens = 32000, 8192  # the 125m preset's micro-batch of 8 x 1,024
    eager_rows = loss_module.CHUNK_BYTES // (4 * vocab)
    assert loss_module.EAGER_KERNELS.chunk_rows(vocab, tokens) == eager_rows == 262
    assert kernels.chunk_rows(vocab, tokens) == tokens // loss_module.MIN_CHUNKS
    assert kernels.chunk_rows(vocab, 16 * tokens) == loss_module.FUSED_CHUNK_BYTES // (4 * vocab)
    with Passthrough():
        assert kernels.chunk_rows(vocab, tokens) == eager_rows
    with torch._dynamo.config.patch(disable=True):  # TORCHDYNAMO_DISABLE=1: nothing is fused
        assert kernels.chunk_rows(vocab, tokens) == eager_rows
    # Backends that do not fuse run the chunk maths as written, fp32 intermediates and all.
    for backend in ("aot_eager", "eager"):
        assert compile_loss_kernels(backend).chunk_rows(vocab, tokens) == eager_rows, backend


def test_a_measured_step_measures_the_eager_runs_memory(corpus, tmp_path):
    """The memory tracker's steps run eagerly (dynamo cannot run under its dispatch mode): the
    eager loss kernels too, not the fused one run eagerly, whose [rows, V] masks the eager run
    never makes. Peaks byte for byte, every step measured."""
    peaks = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        cfg = small_cfg(corpus, tmp_path / str(compiled), 1, "train.track_memory=true", "train.memory_interval=1",
                        f"train.compile={str(compiled).lower()}", "train.compile_backend=aot_eager", steps=3)
        trainer = build_trainer(cfg)
        peaks[compiled] = [trainer.train_step().mem_peak_bytes for _ in range(3)]
    torch._dynamo.reset()
    assert peaks[True] == peaks[False] and None not in peaks[True]


def test_an_older_torchs_dispatch_mode_check_sees_a_mode_exactly_when_one_is_on(monkeypatch):
    """Where torch lacks `any_torch_dispatch_mode_on_stack` (a GPU machine's older torch),
    compile.py counts the dispatch stack itself: that check decides whether the compiled code runs
    or the eager one (under the memory tracker). compile.py loaded afresh without the function."""
    import importlib.util

    import torch.utils._python_dispatch as dispatch

    monkeypatch.delattr(dispatch, "any_torch_dispatch_mode_on_stack")
    spec = importlib.util.find_spec("meshlm.parallel.compile")
    older = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(older)
    check = older.any_torch_dispatch_mode_on_stack
    assert check.__module__ == "meshlm.parallel.compile"  # the fallback, not torch's
    assert check() is False
    with Passthrough():
        assert check() is True
        with Passthrough():
            assert check() is True
    assert check() is False
