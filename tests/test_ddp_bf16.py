"""The data-parallel engines in bf16: gradients reduced in fp32 (bucket by bucket, one widened
copy alive at a time, the bucket size changing no bit), fp32 masters that start at the fp32
initial values, frozen weights cast too, against the fp32 run's gradients."""

import pytest
import torch
import torch.distributed as dist

from meshlm.model.llama import TransformerBlock
from meshlm.parallel.ddp import DDP
from meshlm.parallel.fsdp import FullyShardedDataParallel, by_class
from meshlm.parallel.mixed_precision import BF16
from meshlm.parallel.zero import ZeroDataParallel
from meshlm.testing import run_ranks
from meshlm.model.loss import token_loss_sum

from dp_engines import SMALL_BUCKETS, TRAIN, train_engine
from helpers import comm_here, debug_model, local_batch


def _zero_bf16_rank(stage, bucket_bytes):
    model = debug_model()
    comm = comm_here()
    dp = ZeroDataParallel(model, comm, TRAIN, stage=stage, bucket_bytes=bucket_bytes, precision=BF16)
    for step in range(2):
        inputs, targets, tokens = local_batch(step, dist.get_rank(), dist.get_world_size())
        (token_loss_sum(dp.module(inputs), targets) / tokens).backward()
        dp.finish_backward()
        if step == 0:
            grads = dp.full_grads()
        dp.clip_and_step(1e-3, 0.0)  # no clipping: a norm summed over other segments rounds otherwise
        dp.zero_grad()
    dtypes = {r.dtype for r in comm.recorder.records if r.op == "reduce_scatter"}
    return grads, dp.full_state_dict(), dtypes, len(dp.layout.buckets)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_bf16_reduces_in_fp32_and_its_bucket_size_changes_no_bit(stage):
    """bf16 gradients are upcast and reduce-scattered in fp32 bucket by bucket; where the buckets
    end changes no bit of the gradients or the weights after two steps (a sum of two ranks does
    not depend on it, nor does AdamW's per-element update)."""
    large = run_ranks(_zero_bf16_rank, 2, stage, 2**30, timeout=60)[0]
    small = run_ranks(_zero_bf16_rank, 2, stage, 8 * 1024, timeout=60)[0]  # below stage 2's own cap
    assert small[3] > large[3] and large[2] == small[2] == {torch.float32}
    for a, b in ((large[0], small[0]), (large[1], small[1])):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _widened_copies_rank(kind):
    """The most fp32 copies of whole gradient buckets alive at once during a bf16 backward (the
    copies a bf16 buffer is reduced in fp32 through)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    model = debug_model()
    comm = comm_here()
    dp = (DDP(model, comm, TRAIN, bucket_bytes=16 * 1024, precision=BF16) if kind == "ddp"
          else ZeroDataParallel(model, comm, TRAIN, stage=1, bucket_bytes=16 * 1024, precision=BF16))
    bucket_sizes = {b.numel for b in dp.layout.buckets}
    count = {"alive": 0, "most": 0}

    class WidenedBuckets(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (func is torch.ops.aten._to_copy.default and out.dtype == torch.float32
                    and args[0].dtype == torch.bfloat16 and out.numel() in bucket_sizes):
                count["alive"] += 1
                count["most"] = max(count["most"], count["alive"])
                weakref.finalize(out.untyped_storage(), lambda: count.update(alive=count["alive"] - 1))
            return out

    inputs, targets, tokens = local_batch(0, dist.get_rank(), dist.get_world_size())
    with WidenedBuckets():
        (token_loss_sum(dp.module(inputs), targets) / tokens).backward()
        dp.finish_backward()
    return len(dp.layout.buckets), count["most"], count["alive"]


@pytest.mark.parametrize("kind", ["ddp", "zero1"])
def test_a_bf16_buffer_is_reduced_through_one_fp32_bucket_copy_at_a_time(kind):
    """Each bucket is widened to fp32 for its reduction; the copy is dropped once its sum is copied
    back, before the next bucket is widened. Kept to the end of backward, every bucket's copy would
    live at once: 4 bytes a parameter (the memory model counts one bucket's)."""
    for buckets, most, left in run_ranks(_widened_copies_rank, 2, kind, timeout=60):
        assert buckets >= 5 and most == 1 and left == 0


# --------------------------------------------------------------------------- mixed precision


def _bf16_rank():
    model = debug_model()
    comm = comm_here()
    dp = DDP(model, comm, TRAIN, bucket_bytes=SMALL_BUCKETS, precision=BF16)
    inputs, targets, tokens = local_batch(0, dist.get_rank(), dist.get_world_size())
    (token_loss_sum(dp.module(inputs), targets) / tokens).backward()
    dp.finish_backward()
    param_dtypes = {p.dtype for p in model.parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dp.clip_and_step(1e-3, 1.0)
    reduce_dtypes = {r.dtype for r in comm.recorder.records if r.op == "all_reduce" and r.numel > 1}
    masters = dp.full_state_dict()
    # the bf16 parameters are the updated fp32 masters, rounded
    assert all(torch.equal(p.detach(), masters[n].to(torch.bfloat16)) for n, p in model.named_parameters())
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    # one AdamW step of lr 1e-3 from the masters the parameters started as (plus bf16 rounding)
    assert all((p.detach().float() - before[n].float()).abs().max() <= 1e-2 for n, p in model.named_parameters())
    return param_dtypes, reduce_dtypes, dp.full_grads(), {v.dtype for v in masters.values()}


def _initial_masters_rank(kind):
    model = debug_model()
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    comm = comm_here()
    if kind == "ddp":
        dp = DDP(model, comm, TRAIN, bucket_bytes=16 * 1024, precision=BF16)
    elif kind == "zero3":
        dp = FullyShardedDataParallel(model, comm, TRAIN, policy=by_class(TransformerBlock), precision=BF16)
    else:
        dp = ZeroDataParallel(model, comm, TRAIN, stage=int(kind[-1]), bucket_bytes=16 * 1024, precision=BF16)
    masters = dp.full_state_dict()
    return [name for name, value in initial.items() if not torch.equal(masters[name], value)]


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2", "zero3"])
def test_bf16_masters_start_at_the_fp32_initial_values_not_their_rounding(kind):
    """The fp32 masters take the initial weights before the parameters are cast to bf16, in every
    engine, so every layout starts from the same values (and from the fp32 run's)."""
    for differing in run_ranks(_initial_masters_rank, 3, kind, timeout=60):
        assert differing == []


def _frozen_bf16_rank(kind):
    model = debug_model()
    frozen = model.layers[0].attention.wq.weight
    frozen.requires_grad_(False)
    initial = frozen.detach().clone()
    comm = comm_here()
    dp = (DDP(model, comm, TRAIN, precision=BF16) if kind == "ddp"
          else ZeroDataParallel(model, comm, TRAIN, stage=int(kind[-1]), precision=BF16))
    inputs, targets, tokens = local_batch(0, dist.get_rank(), dist.get_world_size())
    (token_loss_sum(dp.module(inputs), targets) / tokens).backward()  # no autocast: bf16 throughout
    dp.finish_backward()
    dp.clip_and_step(1e-3, 1.0)
    return frozen.dtype, torch.equal(frozen.float(), initial.to(torch.bfloat16).float()), frozen.grad is None


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2"])
def test_bf16_engines_cast_frozen_weights_too(kind):
    """A frozen weight left fp32 beside bf16 ones failed the first matmul without autocast."""
    for dtype, unchanged, no_grad in run_ranks(_frozen_bf16_rank, 2, kind, timeout=60):
        assert dtype == torch.bfloat16 and unchanged and no_grad


def test_bf16_parameters_fp32_reduction_and_fp32_master():
    fp32_grads = run_ranks(train_engine, 2, "ddp", 1, timeout=60)[0][0]
    params, reduced, grads, master = run_ranks(_bf16_rank, 2, timeout=60)[0]
    assert params == {torch.bfloat16} and reduced == {torch.float32} and master == {torch.float32}
    for name, g in fp32_grads.items():  # bf16 gradients of the same step, up to bf16 rounding
        assert (grads[name] - g).abs().max() <= 0.02 * g.abs().max() + 1e-6, name
