"""Every data-parallel stage (zero = 0 DDP, 1, 2, 3 FSDP) inside the Trainer against a plain
single-process PyTorch loop (helpers.plain_pytorch_reference: no meshlm trainer code in it): same
seed, same global batch with a different number of target tokens in every micro-batch and rank,
gradients within 1e-6 and parameters after 5 AdamW steps within 1e-5; and the per-rank
model-state bytes against the formulas of docs/zero-fsdp.md."""

import gc

import pytest
import torch

from meshlm.config import TrainConfig, load_config, resolve
from meshlm.model import Llama, init_weights
from meshlm.testing import run_ranks
from meshlm.model.loss import token_loss_sum

from helpers import (UnevenlyMaskedLoader, build_trainer, comm_here, plain_pytorch_reference, poisoned_empty,
                     small_cfg, target_counts)

STEPS = 5
# The first optimizer a process builds imports torch._dynamo (seconds); do it once here, so the
# forked ranks inherit it instead of each paying for it.
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def make_cfg(corpus, run_dir, world_size=1, *extra):
    return small_cfg(corpus, run_dir, world_size, *extra, steps=STEPS)


def trainer_run(cfg, loader_cls=None, n_steps=STEPS):
    """(gradients of step 0, full; losses of n_steps; full parameters after them) on this rank."""
    trainer = build_trainer(cfg, loader_cls)
    trainer.forward_backward()
    grads = trainer.dp.full_grads()
    trainer.dp.zero_grad()
    losses = [trainer.train_step().loss for _ in range(n_steps)]
    return grads, losses, trainer.full_state_dict()


def _rank(corpus, run_dir, world_size, zero, loader_cls=UnevenlyMaskedLoader, n_steps=STEPS, extra=()):
    cfg = make_cfg(corpus, run_dir, world_size, f"parallel.zero={zero}", *extra)
    with poisoned_empty():  # the engines' buffers are torch.empty: nothing may read them unwritten
        return trainer_run(cfg, loader_cls, n_steps)


def assert_matches(reference, got, grad_tol=1e-6, param_tol=1e-5):
    (g0, l0, p0), (g1, l1, p1) = reference, got
    assert set(g0) == set(g1)
    for name in g0:
        assert (g0[name] - g1[name]).abs().max() <= grad_tol, f"gradient of {name}"
    assert l1 == pytest.approx(l0, abs=1e-5)
    for name in p0:
        assert (p0[name] - p1[name]).abs().max() <= param_tol, f"parameter {name}"
    # Not a comparison of two untouched models: 5 steps of AdamW moved every matrix.
    assert l0[-1] < l0[0]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    cfg = make_cfg(corpus, tmp_path_factory.mktemp("ref"))
    # Uneven target counts, or a mean of per-rank / per-micro-batch means would pass too.
    for world_size, micro in ((2, 2), (4, 2), (2, 1)):
        cfg.train.micro_batch_size = micro
        counts = [c for rank in target_counts(cfg, UnevenlyMaskedLoader, world_size) for c in rank]
        assert len(set(counts)) == len(counts), counts
    return plain_pytorch_reference(cfg, UnevenlyMaskedLoader, n_steps=STEPS)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_every_stage_equals_the_single_process_reference(corpus, tmp_path, reference, zero, world_size):
    # world 2: micro 2 x accumulation 2 x dp 2; world 4: micro 2 x dp 4 (no accumulation).
    results = run_ranks(_rank, world_size, corpus, tmp_path, world_size, zero, timeout=180)
    for rank_result in results:
        assert_matches(reference, rank_result)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_accumulation_equals_one_large_batch(corpus, tmp_path, reference, zero):
    # 4 micro-batches of 2 on each of 2 ranks against the reference's single batch of 8.
    results = run_ranks(_rank, 2, corpus, tmp_path, 2, zero, UnevenlyMaskedLoader, 2, ("train.micro_batch_size=1",),
                        timeout=180)
    g0, l0, _ = reference
    for grads, losses, _ in results:
        for name in g0:
            assert (g0[name] - grads[name]).abs().max() <= 1e-6, name
        assert losses == pytest.approx(l0[:2], abs=1e-5)


def test_bf16_trains_close_to_fp32_for_every_stage(corpus, tmp_path, reference):
    _, fp32_losses, _ = reference

    def rank(zero):
        cfg = make_cfg(corpus, tmp_path / f"z{zero}", 2, f"parallel.zero={zero}", "train.dtype=bfloat16")
        grads, losses, params = trainer_run(cfg, UnevenlyMaskedLoader, n_steps=3)
        return losses, {n: p.dtype for n, p in params.items()}

    for zero in (1, 2, 3):
        for losses, dtypes in run_ranks(rank, 2, zero, timeout=180):
            assert losses == pytest.approx(fp32_losses[:3], abs=0.05)
            assert losses != pytest.approx(fp32_losses[:3], abs=1e-6)  # it really ran in bf16
            assert set(dtypes.values()) == {torch.float32}  # full_state_dict: the fp32 masters


# --------------------------------------------------------------------------- model-state memory

# Bytes per parameter held by each rank, N = data-parallel size (docs/zero-fsdp.md derives them).
FORMULAS = {  # (bytes per param replicated, bytes per param sharded 1/N)
    ("float32", 0): (16, 0),   # fp32 param 4 + grad 4 + Adam m, v 8
    ("float32", 1): (8, 8),    # param 4 + grad 4 replicated; m, v sharded (the param shard is the master)
    ("float32", 2): (4, 12),   # param 4 replicated; grad 4 + m, v 8 sharded
    ("float32", 3): (0, 16),   # fp32 param shard 4 + grad shard 4 + m, v 8
    ("bfloat16", 0): (16, 0),  # bf16 param 2 + bf16 grad 2 + fp32 master 4 + m, v 8
    ("bfloat16", 1): (4, 12),  # bf16 param 2 + grad 2; master 4 + m, v 8 sharded
    ("bfloat16", 2): (2, 14),  # bf16 param 2; bf16 grad 2 + master 4 + m, v 8 sharded
    ("bfloat16", 3): (0, 16),  # fp32 shard (the master) 4 + fp32 grad shard 4 + m, v 8
}


def live_tensor_bytes() -> int:
    """Every tensor storage alive in this process, counted once: a measurement, not the engine's
    own account (an unsharded buffer the engine forgot to free would show up here)."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor) or obj.device.type == "meta":
                continue
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()  # raises for a FakeTensor (torch.compile's, from earlier tests)
        except Exception:  # noqa: BLE001 - objects that misbehave under isinstance, tensors without memory
            continue
        if pointer not in seen and storage.nbytes():
            seen.add(pointer)
            total += storage.nbytes()
    return total


def _build_and_step(zero, dtype, comm):
    from meshlm.parallel.data_parallel import build_data_parallel

    cfg = resolve(load_config(None, ["model.preset=debug", f"parallel.zero={zero}", f"train.dtype={dtype}",
                                     "train.micro_batch_size=1", "train.global_batch_size=4"]),
                  world_size=torch.distributed.get_world_size())
    model = Llama(cfg.model)
    init_weights(model, 1)
    dp = build_data_parallel(model, cfg, comm)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=(zero == 0 and dtype == "bfloat16")):
        logits = dp.module(tokens)
    token_loss_sum(logits, tokens).backward()
    del logits
    dp.finish_backward()
    dp.clip_and_step(1e-3, 1.0)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return dp, sum(p.numel() for p in model.parameters()), buffers


def _state_bytes_rank(configs):
    """For each (zero, dtype): (parameter count, live bytes after one step, the engine's account)."""
    comm = comm_here()
    baseline = live_tensor_bytes()
    out = []
    for zero, dtype in configs:
        dp, n_params, buffers = _build_and_step(zero, dtype, comm)
        measured = live_tensor_bytes() - baseline - buffers
        out.append((zero, dtype, n_params, measured, dp.model_state_bytes()))
        del dp  # and everything it holds: the next configuration starts from the baseline again
    return out


@pytest.mark.parametrize("world_size, dtypes", [(2, ["float32"]), (4, ["bfloat16"])])
def test_model_state_bytes_per_rank_match_the_formulas(world_size, dtypes):
    configs = [(zero, dtype) for dtype in dtypes for zero in range(4)]
    for rank_result in run_ranks(_state_bytes_rank, world_size, configs, timeout=180):
        for zero, dtype, n_params, measured, by_kind in rank_result:
            replicated, sharded = FORMULAS[(dtype, zero)]
            expected = n_params * (replicated + sharded / world_size)
            assert measured == pytest.approx(expected, rel=0.05), (zero, dtype, measured, by_kind)
            assert sum(by_kind.values()) == pytest.approx(expected, rel=0.05), (zero, dtype, by_kind)


def test_the_engine_and_its_precision_follow_parallel_zero_and_train_dtype():
    """bf16 with ZeRO 1-3: bf16 parameters and gradients over fp32 masters; with DDP, fp32
    parameters under autocast (the same 16 bytes/parameter, and the model stays fp32)."""
    from meshlm.parallel.data_parallel import build_data_parallel, precision_for
    from meshlm.parallel.mixed_precision import BF16, FP32

    def cfg(zero, dtype):
        return resolve(load_config(None, [f"parallel.zero={zero}", f"train.dtype={dtype}"]))

    assert [precision_for(cfg(z, "bfloat16")) for z in range(4)] == [FP32, BF16, BF16, BF16]
    assert [precision_for(cfg(z, "float32")) for z in range(4)] == [FP32] * 4
    beyond = cfg(3, "float32")
    beyond.parallel.zero = 4  # past validation: the engine table itself must refuse it
    with pytest.raises(ValueError, match="parallel.zero must be 0, 1, 2 or 3"):
        build_data_parallel(torch.nn.Linear(2, 2), beyond, comm=None)


def test_gradient_upcast_is_one_cast_per_run_of_adjacent_segments():
    from meshlm.parallel.mixed_precision import upcast_runs

    flat = torch.randn(20).bfloat16()
    other = torch.randn(6).bfloat16()
    grads = [flat[0:3], flat[3:7], flat[9:12], flat[12:13], flat[13:16], torch.randn(4), other[::2], other[1:3],
             flat[18:20], flat[16:18]]  # adjacent, but in reverse order: no run
    dtypes = [torch.float32] * len(grads)
    out = upcast_runs(grads, dtypes)
    for g, o in zip(grads, out):
        assert o.dtype == torch.float32 and torch.equal(o, g.float())
    storage = [o.untyped_storage().data_ptr() for o in out]
    assert storage[0] == storage[1] != storage[2] == storage[3] == storage[4]  # a gap at 7:9 starts a new run
    assert out[5] is grads[5]  # already fp32: passed as is
    assert len(set(storage)) == 7  # runs {0,1}, {2,3,4}, the fp32 one, the strided one, other's, 8 and 9


def test_clip_scale_is_clip_grad_norm_s_factor_and_off_at_zero():
    from meshlm.parallel.mixed_precision import clip_scale

    assert clip_scale(torch.tensor(5.0), 0.0) is None  # train.grad_clip=0: no clipping
    assert clip_scale(torch.tensor(0.5), 1.0).item() == 1.0  # below the bound: unchanged
    # torch.nn.utils.clip_grad_norm_'s max_norm / (norm + 1e-6), visible at a small norm
    assert clip_scale(torch.tensor(1e-3), 1e-4).item() == pytest.approx(1e-4 / (1e-3 + 1e-6), rel=1e-6)


def test_adamw_is_fused_on_cuda_and_per_tensor_on_cpu():
    from meshlm.parallel.mixed_precision import SegmentAdamW, adamw_implementation

    assert adamw_implementation(True) == {"foreach": False, "fused": True}
    assert adamw_implementation(False) == {"foreach": False, "fused": None}  # as train/optim.py's reference
    cpu = SegmentAdamW([], TrainConfig()).optimizer.defaults
    assert (cpu["foreach"], cpu["fused"]) == (False, None)


def test_segment_adamw_with_nothing_to_optimise_steps_as_a_no_op():
    """A ZeRO rank whose shard holds only bucket padding has no segment at all."""
    from meshlm.parallel.mixed_precision import SegmentAdamW

    optim = SegmentAdamW([], TrainConfig())
    optim.step(1e-3, None)
    assert list(optim.state_tensors()) == []


def test_storage_bytes_counts_each_storage_once_exactly():
    from meshlm.parallel.mixed_precision import storage_bytes

    flat, other = torch.zeros(10), torch.zeros(3, dtype=torch.bfloat16)
    assert storage_bytes([flat[:4], None, flat[4:], other, torch.zeros(0), flat]) == 10 * 4 + 3 * 2
    assert storage_bytes([]) == 0


class _OneOfEach(torch.nn.Module):
    """One 3-D weight (it decays, as every tensor of two or more dims) and one vector (it does
    not): each of AdamW's two groups holds a single tensor."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 3, 4))
        self.b = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        return (self.w.sum(0) @ x + self.b).square().sum()


def _segment_adamw_and_twin(train):
    """(a _OneOfEach stepped by SegmentAdamW over one segment per parameter, its twin with the same
    weights for a reference optimizer, that SegmentAdamW)."""
    from meshlm.parallel.flat_buffer import FlatLayout, Segment
    from meshlm.parallel.mixed_precision import MasterSegment, SegmentAdamW

    ours, theirs = _OneOfEach(), _OneOfEach()
    theirs.load_state_dict(ours.state_dict())
    layout = FlatLayout(list(ours.named_parameters()), 2**20, align=1, itemsize=4)
    optim = SegmentAdamW([MasterSegment(Segment(s, s.start, s.end), s.param.data.view(-1),
                                        lambda s=s: s.param.grad.view(-1)) for s in layout.slots], train)
    return ours, theirs, optim


def test_segment_adamw_equals_torch_adamw_with_the_decay_groups_of_build_optimizer():
    from meshlm.parallel.mixed_precision import decays
    from meshlm.train.optim import build_optimizer

    train = TrainConfig(lr=0.1, weight_decay=0.5)
    ours, theirs, optim = _segment_adamw_and_twin(train)
    reference = build_optimizer(theirs, train)
    assert [decays(p) for p in ours.parameters()] == [True, False]
    x = torch.randn(4)
    for _ in range(3):
        for model in (ours, theirs):
            model.zero_grad()
            model(x).backward()
        optim.step(train.lr, None)
        reference.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("max_norm", [0.05, 100.0], ids=["clip-binds", "clip-idle"])
def test_fused_segment_adamw_folds_the_clip_into_the_kernel_as_clip_grad_norm_then_fused_adamw(monkeypatch, max_norm):
    """On CUDA (the fused kernel; fused AdamW runs on CPU too, so the flags are forced here) the
    clip is the kernel's grad_scale, not a pass of its own: the weights after each step are
    clip_grad_norm_ then torch's fused AdamW's within a rounding, exactly so where the clip is idle."""
    from meshlm.parallel import mixed_precision
    from meshlm.parallel.mixed_precision import clip_scale, decays

    monkeypatch.setattr(mixed_precision, "adamw_implementation", lambda on_cuda: {"foreach": False, "fused": True})
    train = TrainConfig(lr=0.1, weight_decay=0.5)
    ours, theirs, optim = _segment_adamw_and_twin(train)
    assert optim.optimizer.defaults["fused"] is True
    params = list(theirs.parameters())
    reference = torch.optim.AdamW([{"params": [p for p in params if decays(p)], "weight_decay": 0.5},
                                   {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}],
                                  lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, fused=True)
    x = torch.randn(4)
    for _ in range(3):
        for model in (ours, theirs):
            model.zero_grad()
            model(x).backward()
        norm = torch.stack([p.grad.norm() for p in ours.parameters()]).norm()
        assert (norm > max_norm) == (max_norm < 1)  # the clip binds in one case only
        optim.step(train.lr, clip_scale(norm, max_norm))
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
        reference.step()
        assert optim.optimizer.grad_scale is None  # no later step inherits this one's scale
    for a, b in zip(ours.parameters(), theirs.parameters()):
        if max_norm > 1:
            assert torch.equal(a, b)
        else:
            assert torch.allclose(a, b, rtol=1e-6, atol=0)
