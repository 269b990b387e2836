"""meshlm's DDP (and the ZeRO-1/2 engines built on its reducer) against PyTorch's own
DistributedDataParallel on the same weights and data, and its internals: buckets launched in
order during backward, no_sync, unused parameters, bytes on the wire, the state it accounts for,
a second backward refused (the flat layout itself: test_flat_buffer.py; bf16: test_ddp_bf16.py;
`bench dp`: test_ddp_bench.py)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshlm.model.llama import TransformerBlock
from meshlm.parallel.ddp import DDP
from meshlm.parallel.fsdp import FullyShardedDataParallel, by_class
from meshlm.parallel.mixed_precision import BF16, FP32, storage_bytes
from meshlm.parallel.zero import ZeroDataParallel
from meshlm.testing import run_ranks
from meshlm.model.loss import token_loss_sum

from dp_engines import SMALL_BUCKETS, TRAIN, train_engine
from helpers import comm_here, debug_model, local_batch, poisoned_empty


# --------------------------------------------------------------------------- against torch DDP


def _poisoned_train(engine_kind, steps, **options):
    with poisoned_empty():
        return train_engine(engine_kind, steps, **options)


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2"])
def test_equals_torch_distributed_data_parallel(kind):
    reference = run_ranks(train_engine, 2, "torch", 5, timeout=120)[0]
    for grads, params in run_ranks(_poisoned_train, 2, kind, 5, bucket_bytes=SMALL_BUCKETS, timeout=120):
        for name, g in reference[0].items():
            assert (grads[name] - g).abs().max() <= 1e-6, name
        for name, p in reference[1].items():
            assert (params[name] - p).abs().max() <= 1e-5, name


def _one_rank(steps):
    grads, params = _poisoned_train("ddp", steps, bucket_bytes=SMALL_BUCKETS)
    model = debug_model()
    dp = DDP(model, comm_here(), TRAIN, bucket_bytes=SMALL_BUCKETS)
    for micro in range(2):
        inputs, targets, _ = local_batch(micro, 0, 1)
        with dp.no_sync() if micro == 0 else torch.enable_grad():  # accumulating needs nothing either
            token_loss_sum(dp.module(inputs), targets).backward()
        if micro == 0:
            autograds_own = {id(p): p.grad for p in model.parameters()}
    dp.finish_backward()
    kept = all(p.grad is autograds_own[id(p)] for p in model.parameters())
    hooks = sum(len(p._post_accumulate_grad_hooks or ()) for p in model.parameters())
    return grads, params, hooks, dp.grad_buffer is None, kept


def test_at_one_rank_the_gradients_stay_autograds_own_and_equal_torch_ddp():
    """Nothing to reduce: no hooks, no buffer, autograd's .grad is what AdamW reads; same result."""
    reference = run_ranks(train_engine, 1, "torch", 5, timeout=60)[0]
    grads, params, hooks, no_buffer, kept = run_ranks(_one_rank, 1, 5, timeout=60)[0]
    assert (hooks, no_buffer, kept) == (0, True, True)
    for name, g in reference[0].items():
        assert (grads[name] - g).abs().max() <= 1e-6, name
    for name, p in reference[1].items():
        assert (params[name] - p).abs().max() <= 1e-5, name


# --------------------------------------------------------------------------- overlap, no_sync, bytes


def _overlap_rank():
    model = debug_model()
    comm = comm_here()
    seen_at_last_grad, engine = [], []
    # The embedding is registered first, so its gradient is produced last in backward; this hook
    # is registered before DDP's, so it runs just before DDP marks the embedding ready.
    model.tok_embeddings.weight.register_post_accumulate_grad_hook(
        lambda p: seen_at_last_grad.append(len(engine[0]._pending)))
    dp = DDP(model, comm, TRAIN, bucket_bytes=SMALL_BUCKETS)
    engine.append(dp)
    inputs, targets, tokens = local_batch(0, dist.get_rank(), dist.get_world_size())
    for micro in range(2):  # the first micro-batch under no_sync: no communication at all
        with dp.no_sync() if micro == 0 else torch.enable_grad():
            (token_loss_sum(dp.module(inputs), targets) / tokens).backward()
        if micro == 0:
            assert not dp._pending and not comm.summary()
    launched_in_backward = len(dp._pending)
    dp.finish_backward()
    ops = [(r["op"], r["count"]) for r in comm.summary()]
    return len(dp.layout.buckets), seen_at_last_grad, launched_in_backward, ops


def test_buckets_launch_during_backward_and_no_sync_defers_communication():
    n_buckets, seen, launched, ops = run_ranks(_overlap_rank, 2, timeout=60)[0]
    assert n_buckets >= 5
    # When the last gradient arrived, all other buckets were already on the wire.
    assert seen == [0, n_buckets - 1]
    assert launched == n_buckets  # every bucket launched by the hooks, not by finish_backward
    assert ops == [("all_reduce", n_buckets)]  # one all-reduce per bucket, only for the last micro-batch


def _bytes_rank(kind):
    model = debug_model()
    comm = comm_here()
    engine = (DDP(model, comm, TRAIN, bucket_bytes=SMALL_BUCKETS) if kind == "ddp"
              else ZeroDataParallel(model, comm, TRAIN, stage=int(kind[-1]), bucket_bytes=SMALL_BUCKETS))
    inputs, targets, tokens = local_batch(0, dist.get_rank(), dist.get_world_size())
    (token_loss_sum(engine.module(inputs), targets) / tokens).backward()
    engine.finish_backward()
    engine.clip_and_step(1e-3, 1.0)
    sent = {r["op"]: r["bytes_sent"] for r in comm.summary()}
    return sum(p.numel() for p in model.parameters()), sent


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_on_the_wire_per_step_match_the_formula(world_size):
    """DDP: 2(N-1)/N x Phi elements per rank; ZeRO-1/2 the same, as reduce-scatter + all-gather
    (a real reduce-scatter: an all-reduce-then-slice would send twice the gradient bytes)."""
    n = world_size
    for kind in ("ddp", "zero1", "zero2"):
        for phi, sent in run_ranks(_bytes_rank, n, kind, timeout=60):
            expected = 2 * (n - 1) / n * phi * 4
            norm_bytes = sent.pop("all_reduce", 0) if kind != "ddp" else 0  # the 4-byte norm all-reduce
            assert norm_bytes <= 8 * n
            total = sum(sent.values())
            assert total == pytest.approx(expected, rel=2e-3), (kind, sent)  # padding: a few elements
            if kind != "ddp":
                assert sent["reduce_scatter"] == pytest.approx(sent["all_gather"], rel=1e-9)


# --------------------------------------------------------------------------- unused parameters


class Branchy(nn.Module):
    """`unused` gets no gradient unless `use_extra` is set."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)
        self.use_extra = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.use_extra:
            h = h + self.unused(h)
        return self.b(h)


def _unused_rank(use_on_step):
    with poisoned_empty():  # the unused parameters' slots are never written: they must be zeroed
        return _unused_steps(use_on_step)


def _unused_steps(use_on_step):
    torch.manual_seed(0)
    model = Branchy()
    dp = DDP(model, comm_here(), TRAIN, bucket_bytes=16)
    x = torch.randn(4, 4) + dist.get_rank()
    grads = []
    unused = model.unused.weight
    for step in range(3):
        model.use_extra = step == use_on_step
        dp.module(x).sum().backward()
        if step > 0 and not dp.autograd_grads:  # known unused: its slot is zero before its bucket is sent
            assert dp._grad_views[id(unused)].abs().sum() == 0
        dp.finish_backward()
        # every .grad exists after finish_backward: the buffer's view or autograd's, zeros if unused
        assert all(p.grad is not None for p in model.parameters())
        assert step == use_on_step or unused.grad.abs().sum() == 0
        grads.append({k: v.clone() for k, v in dp.full_grads().items()})
        assert step == 0 or dp.unused_parameters == first_unused  # decided by the first step, kept
        first_unused = list(dp.unused_parameters)
        dp.clip_and_step(1e-3, 0.0)
        dp.zero_grad()
    return dp.unused_parameters, grads


@pytest.mark.parametrize("world_size", [1, 2])
def test_unused_parameters_are_found_on_the_first_step(world_size):
    results = run_ranks(_unused_rank, world_size, None, timeout=60)
    unused, grads = results[0]
    assert sorted(unused) == ["unused.bias", "unused.weight"]
    assert grads[0]["a.weight"].abs().sum() > 0
    for step in range(3):  # the sum over the ranks, identical on each; unused ones stay zero
        assert torch.equal(grads[step]["a.weight"], results[-1][1][step]["a.weight"])
        assert grads[step]["unused.weight"].abs().sum() == 0


def test_a_parameter_unused_on_step_one_then_used_is_a_clear_error():
    with pytest.raises(AssertionError, match="unused.bias|unused.weight"):
        run_ranks(_unused_rank, 2, 1, timeout=60)


def test_at_one_rank_a_parameter_may_join_later_and_step_one_decides_the_unused_list():
    unused, grads = run_ranks(_unused_rank, 1, 1, timeout=60)[0]  # nothing to reduce: no error
    assert sorted(unused) == ["unused.bias", "unused.weight"]
    assert grads[1]["unused.weight"].abs().sum() > 0 and grads[2]["unused.weight"].abs().sum() == 0


def _state_rank(kind, precision):
    model = debug_model()
    comm = comm_here()
    if kind == "zero3":
        dp = FullyShardedDataParallel(model, comm, TRAIN, policy=by_class(TransformerBlock), precision=precision)
    else:
        dp = (DDP(model, comm, TRAIN, bucket_bytes=SMALL_BUCKETS, precision=precision) if kind == "ddp" else
              ZeroDataParallel(model, comm, TRAIN, stage=int(kind[-1]), bucket_bytes=SMALL_BUCKETS,
                               precision=precision))
    inputs, targets, tokens = local_batch(0, dist.get_rank(), dist.get_world_size())
    (token_loss_sum(dp.module(inputs), targets) / tokens).backward()
    dp.finish_backward()
    dp.clip_and_step(1e-3, 1.0)
    held = list(dp.state_tensors())
    return None in held, storage_bytes(held), sum(dp.model_state_bytes().values())


@pytest.mark.parametrize("kind,world_size", [("ddp", 1), ("ddp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_tensors_are_what_model_state_bytes_counts(kind, world_size, precision):
    """What the memory tracker reads as model state (state_tensors) is what the engine accounts
    for by kind: parameters, gradients (buffer, shard or autograd's), masters, AdamW moments.
    Compared after a step, where FSDP has freed every unsharded buffer: `model_state_bytes`
    also counts those while they are gathered, `state_tensors` never does."""
    for has_none, held, counted in run_ranks(_state_rank, world_size, kind, BF16 if precision == "bf16" else FP32,
                                             timeout=60):
        assert not has_none and held == counted > 0


def _second_backward_rank(kind):
    model = debug_model()
    comm = comm_here()
    dp = DDP(model, comm, TRAIN) if kind == "ddp" else ZeroDataParallel(model, comm, TRAIN, stage=1)
    rank, n = dist.get_rank(), dist.get_world_size()
    for step in range(2):  # a synced backward, then another without zero_grad between
        inputs, targets, tokens = local_batch(step, rank, n)
        try:
            (token_loss_sum(dp.module(inputs), targets) / tokens).backward()
        except RuntimeError as e:
            return step, str(e)
        dp.finish_backward()
    return None


@pytest.mark.parametrize("kind", ["ddp", "zero1"])
def test_a_backward_into_an_already_reduced_buffer_is_a_clear_error(kind):
    """After finish_backward the buffer holds the ranks' sum: a second synced backward added into
    it would send the first micro-batch's gradient n times (torch DDP averages, so there the same
    sequence works). Refused, naming no_sync and zero_grad."""
    for step, message in run_ranks(_second_backward_rank, 2, kind, timeout=60):
        assert step == 1 and "after finish_backward() and before zero_grad()" in message and "no_sync()" in message
