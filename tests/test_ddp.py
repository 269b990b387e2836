"""meshlm's DDP (and the ZeRO-1/2 engines built on its reducer) against PyTorch's own
DistributedDataParallel on the same weights and data, and its internals: buckets launched in
order during backward, no_sync, unused parameters, bytes on the wire (the flat layout itself:
test_flat_buffer.py)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshlm.config import TrainConfig
from meshlm.model.llama import TransformerBlock
from meshlm.parallel.ddp import DDP
from meshlm.parallel.fsdp import FullyShardedDataParallel, by_class
from meshlm.parallel.mixed_precision import BF16, FP32, storage_bytes
from meshlm.parallel.zero import ZeroDataParallel
from meshlm.testing import run_ranks
from meshlm.train.optim import build_optimizer
from meshlm.model.loss import token_loss_sum

from helpers import comm_here, debug_model, host_memory_tuning_recorder, local_batch, poisoned_empty

torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # import dynamo once, before forking ranks

TRAIN = TrainConfig(lr=1e-3, weight_decay=0.1)
SMALL_BUCKETS = 64 * 1024  # the debug model (~0.6 MB fp32) then spans ~10 buckets


# --------------------------------------------------------------------------- against torch DDP


def _train(engine_kind, steps, **options):
    rank, n = dist.get_rank(), dist.get_world_size()
    model = debug_model()
    if engine_kind == "torch":
        engine = nn.parallel.DistributedDataParallel(model)
        optimizer = build_optimizer(model, TRAIN)
    else:
        comm = comm_here()
        engine = (DDP(model, comm, TRAIN, **options) if engine_kind == "ddp"
                  else ZeroDataParallel(model, comm, TRAIN, stage=int(engine_kind[-1]), **options))
    grads = None
    for step in range(steps):
        inputs, targets, tokens = local_batch(step, rank, n)
        module = engine if engine_kind == "torch" else engine.module
        loss = token_loss_sum(module(inputs), targets) / tokens
        if engine_kind == "torch":
            (loss * n).backward()  # torch DDP averages over ranks; meshlm sums a globally normalised loss
            if grads is None:
                grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        else:
            loss.backward()
            engine.finish_backward()
            if grads is None:
                grads = engine.full_grads()
            engine.clip_and_step(TRAIN.lr, 1.0)
            engine.zero_grad()
    params = engine.full_state_dict() if engine_kind != "torch" else model.state_dict()
    return grads, {k: v.detach().clone() for k, v in params.items()}


def _poisoned_train(engine_kind, steps, **options):
    with poisoned_empty():
        return _train(engine_kind, steps, **options)


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2"])
def test_equals_torch_distributed_data_parallel(kind):
    reference = run_ranks(_train, 2, "torch", 5, timeout=120)[0]
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
    reference = run_ranks(_train, 1, "torch", 5, timeout=60)[0]
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
    fp32_grads = run_ranks(_train, 2, "ddp", 1, timeout=60)[0][0]
    params, reduced, grads, master = run_ranks(_bf16_rank, 2, timeout=60)[0]
    assert params == {torch.bfloat16} and reduced == {torch.float32} and master == {torch.float32}
    for name, g in fp32_grads.items():  # bf16 gradients of the same step, up to bf16 rounding
        assert (grads[name] - g).abs().max() <= 0.02 * g.abs().max() + 1e-6, name


# --------------------------------------------------------------------------- the benchmark's contract


def test_bench_dp_json_follows_the_design_schema(capsys, monkeypatch, tmp_path):
    import json

    from meshlm.bench.dp import main

    tuned = host_memory_tuning_recorder(monkeypatch, tmp_path)

    assert main(["--zero", "0,3", "--steps", "1", "--warmup", "0", "--dim", "32", "--layers", "2", "--heads", "2",
                 "--ffn", "64", "--vocab", "300", "--seq", "16", "--batch", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    required = {"name", "world_size", "meshlm_tokens_per_s", "reference", "reference_tokens_per_s",
                "tokens_per_s_ratio", "meshlm_peak_bytes", "reference_peak_bytes", "memory_ratio",
                "meshlm_exposed_comm_share", "reference_exposed_comm_share"}
    assert [r["name"] for r in report["rows"]] == ["zero0", "zero3"]
    for row in report["rows"]:
        assert required <= set(row) and row["world_size"] == 2
        assert row["meshlm_tokens_per_s"] > 0 and row["reference_tokens_per_s"] > 0
        assert row["meshlm_peak_bytes"] > 0 and row["reference_peak_bytes"] > 0
        assert 0 <= row["meshlm_exposed_comm_share"] < 1
    assert [r["reference"] for r in report["rows"]] == ["torch DDP", "fully_shard"]
    assert len(tuned()) == 2  # both ranks allocate as `meshlm train`'s do (train/host_memory.py)
    assert main(["--zero", "5"]) == 2  # bad usage: exit 2


def _reference_models_rank(zero):
    from meshlm.bench import dp as bench
    from meshlm.train.checkpoint.hf import hf_name

    class Opts:
        dim, layers, heads, ffn, vocab, seq, batch = 32, 2, 2, 64, 300, 16, 2

    cfg = bench.model_config(Opts)
    comm = comm_here()
    engines = [bench.Engine("reference", zero, cfg, comm, torch.device("cpu"), reference_model=m)
               for m in ("meshlm", "transformers")]
    for step in range(2):
        batch = bench._batch(step, Opts, torch.device("cpu"))
        for engine in engines:
            engine.step(*batch)
    ours, theirs = ({n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                     for n, p in e.model.named_parameters()} for e in engines)
    import transformers

    hf = isinstance(engines[1].model, transformers.LlamaForCausalLM)  # (fully_shard subclasses it)
    return hf, max((ours[n] - theirs[hf_name(n)]).abs().max().item() for n in ours)


@pytest.mark.parametrize("zero", [0, 3])
def test_bench_reference_on_transformers_llama_trains_the_same_model(zero, capsys):
    """--reference-model transformers: torch DDP / fully_shard on LlamaForCausalLM with meshlm's
    weights take the same steps as on meshlm's Llama, so the bench compares like with like."""
    from meshlm.bench.dp import main

    for hf, difference in run_ranks(_reference_models_rank, 2, zero, timeout=120):
        assert hf and difference <= 1e-5
    assert main(["--zero", "0", "--steps", "1", "--warmup", "0", "--dim", "32", "--layers", "2", "--heads", "2",
                 "--ffn", "64", "--vocab", "300", "--seq", "16", "--batch", "2", "--reference-model", "transformers"]) == 0
    assert "torch DDP + HF Llama" in capsys.readouterr().out


def _bench_optimizers_rank():
    from meshlm.bench import dp as bench
    from meshlm.parallel.mixed_precision import decays

    class Opts:
        dim, layers, heads, ffn, vocab, seq, batch = 32, 2, 2, 64, 300, 16, 2

    cfg, comm = bench.model_config(Opts), comm_here()
    flags, groups = {}, {}
    for zero in (0, 3):
        for kind in ("meshlm", "reference", "compute"):
            engine = bench.Engine(kind, zero, cfg, comm, torch.device("cpu"))
            optimizer = engine.dp.optim.optimizer if kind == "meshlm" else engine.optimizer
            flags[zero, kind] = {k: optimizer.defaults[k] for k in ("foreach", "fused")}
            if kind != "meshlm":  # meshlm's groups hold flat master segments: decays() decided them
                groups[zero, kind] = [(g["weight_decay"], all(decays(p) == (g["weight_decay"] > 0) for p in g["params"]))
                                      for g in optimizer.param_groups]
    return flags, groups


def test_bench_dp_gives_its_reference_and_compute_only_steps_meshlms_adamw(monkeypatch):
    """On CUDA meshlm's engines step a fused AdamW (adamw_implementation); the reference and the
    compute-only step once had train/optim.py's per-tensor one, a slower optimizer than meshlm's.
    The chooser is made to answer its CUDA flags on this CPU (fused AdamW runs on CPU too)."""
    from meshlm.parallel import mixed_precision

    cuda_flags = mixed_precision.adamw_implementation(True)
    assert cuda_flags["fused"] is True
    monkeypatch.setattr(mixed_precision, "adamw_implementation", lambda on_cuda: dict(cuda_flags))
    flags, groups = run_ranks(_bench_optimizers_rank, 1, timeout=60)[0]
    for (zero, kind), got in flags.items():
        assert got == cuda_flags, (zero, kind)
    for key, got in groups.items():
        assert got == [(TrainConfig().weight_decay, True), (0.0, True)], key
