"""ZeRO-3 / FSDP against PyTorch's fully_shard (FSDP2) on the same weights and data; units
gathered just in time and freed; bytes on the wire; any nn.Module; activation checkpointing;
and one end-to-end `meshlm train --nproc 2 parallel.zero=3` through torchrun."""


import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshlm.config import TrainConfig
from meshlm.model.llama import TransformerBlock
from meshlm.parallel.fsdp import FullyShardedDataParallel, by_class, by_size
from meshlm.testing import run_ranks
from meshlm.train.optim import build_optimizer
from meshlm.model.loss import token_loss_sum

from helpers import cli_train_args, comm_here, debug_model, local_batch, read_metrics, run_meshlm, train_any_module

torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # import dynamo once, before forking ranks

TRAIN = TrainConfig(lr=1e-3, weight_decay=0.1)


def _torch_fsdp(steps, reshard_after_forward):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = debug_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    optimizer = build_optimizer(model, TRAIN)
    for step in range(steps):
        inputs, targets, tokens = local_batch(step, dist.get_rank(), dist.get_world_size())
        (token_loss_sum(model(inputs), targets) / tokens * dist.get_world_size()).backward()  # FSDP averages
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def _meshlm_fsdp(steps, recompute="none", **options):
    model = debug_model(recompute=recompute)
    comm = comm_here()
    fsdp = FullyShardedDataParallel(model, comm, TRAIN, policy=by_class(TransformerBlock), **options)
    grads, most_gathered = None, 0

    def count(*_):
        nonlocal most_gathered
        most_gathered = max(most_gathered, sum(u.full.untyped_storage().nbytes() > 0 for u in fsdp.units))

    for block in model.layers:  # sample how many units are unsharded at once, forward and backward
        block.register_forward_hook(count)
        block.attention.wq.weight.register_hook(count)
    for step in range(steps):
        inputs, targets, tokens = local_batch(step, dist.get_rank(), dist.get_world_size())
        (token_loss_sum(fsdp.module(inputs), targets) / tokens).backward()
        fsdp.finish_backward()
        if grads is None:  # the first step's traffic, before full_grads() gathers for the test
            sent = {r["op"]: r["bytes_sent"] for r in comm.summary()}
            grads = fsdp.full_grads()
        fsdp.clip_and_step(TRAIN.lr, 1.0)
        fsdp.zero_grad()
    freed = all(u.full.untyped_storage().nbytes() == 0 for u in fsdp.units)
    return grads, fsdp.full_state_dict(), most_gathered, freed, sent, [u.padded for u in fsdp.units]


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_equals_torch_fully_shard(reshard_after_forward):
    reference = run_ranks(_torch_fsdp, 2, 5, reshard_after_forward, timeout=120)[0]
    for _, params, most_gathered, freed, _, _ in run_ranks(
            _meshlm_fsdp, 2, 5, reshard_after_forward=reshard_after_forward, timeout=120):
        for name, p in reference.items():
            assert (params[name] - p).abs().max() <= 1e-5, name
        assert freed  # after the step nothing is left unsharded
        # Just in time: resharding after forward, at most the root, the unit in use and a prefetch.
        assert most_gathered <= 3
        if not reshard_after_forward:
            assert most_gathered == 3  # root + both blocks kept from forward to backward


def _first_forward_under_inference_mode_rank():
    model = debug_model()
    comm = comm_here()
    fsdp = FullyShardedDataParallel(model, comm, TRAIN, policy=by_class(TransformerBlock))
    inputs, targets, tokens = local_batch(0, dist.get_rank(), dist.get_world_size())
    with torch.inference_mode():  # a sample or an evaluation before the first step
        before = token_loss_sum(fsdp.module(inputs), targets).item()
    (token_loss_sum(fsdp.module(inputs), targets) / tokens).backward()
    fsdp.finish_backward()
    grads = fsdp.full_grads()
    fsdp.clip_and_step(TRAIN.lr, 1.0)  # the step's all-gather writes the buffers again
    return before, grads, fsdp.full_state_dict()


def test_a_first_forward_under_inference_mode_leaves_training_possible():
    """The unsharded buffers are made by the first forward; made under inference mode they were
    inference tensors, which no later training gather may write."""
    reference = run_ranks(_meshlm_fsdp, 2, 1, timeout=120)[0]
    for before, grads, params in run_ranks(_first_forward_under_inference_mode_rank, 2, timeout=120):
        assert before > 0 and all((grads[name] - g).abs().max() <= 1e-6 for name, g in reference[0].items())
        assert all((params[name] - p).abs().max() <= 1e-6 for name, p in reference[1].items())


def test_activation_checkpointing_gives_the_same_result():
    plain = run_ranks(_meshlm_fsdp, 2, 2, timeout=120)
    recomputed = run_ranks(_meshlm_fsdp, 2, 2, "full", timeout=120)
    for (g0, p0, *_), (g1, p1, *_) in zip(plain, recomputed):
        for name in g0:
            assert (g0[name] - g1[name]).abs().max() <= 1e-6, name
            assert (p0[name] - p1[name]).abs().max() <= 1e-6, name


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_on_the_wire_are_one_and_a_half_times_ddp(world_size):
    n = world_size
    for grads, _, _, _, sent, padded in run_ranks(_meshlm_fsdp, n, 1, timeout=120):
        phi = sum(g.numel() for g in grads.values())
        root, blocks = padded[0], sum(padded[1:])
        # forward all-gathers every unit, backward re-gathers the blocks (the root stays unsharded
        # from forward to backward), every unit's gradients are reduce-scattered once.
        assert sent["all_gather"] == (n - 1) * (root + 2 * blocks) // n * 4
        assert sent["reduce_scatter"] == (n - 1) * (root + blocks) // n * 4
        ddp = 2 * (n - 1) / n * phi * 4
        total = sent["all_gather"] + sent["reduce_scatter"]
        assert 1.2 < total / ddp <= 1.5 + 1e-3  # 1.5x DDP, less the root's skipped re-gather


class Tower(nn.Module):
    """Any module: a stack of MLP blocks with a shared input projection."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = self.proj(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _tower_rank(sharded):
    torch.manual_seed(0)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    params, fsdp = train_any_module(Tower(), x, sharded, by_size(800), TRAIN)
    return params, fsdp and ([u.name for u in fsdp.units], fsdp.root.tail)


def test_any_module_with_a_size_policy_equals_the_single_process_reference():
    reference, _ = run_ranks(_tower_rank, 1, False)[0]
    for params, (units, root_tail) in run_ranks(_tower_rank, 2, True, timeout=60):
        assert units == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
        assert root_tail == 6 * 16 + 16 + 16 + 1  # no embedding: the tail is empty, at the root's end
        for name, p in reference.items():
            assert (params[name] - p).abs().max() <= 1e-5, name


class TiedTower(Tower):
    """The tower with an embedding for its input projection, tied to its head: the embedding is
    large enough for a unit of its own."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Embedding(11, 16)
        self.blocks = self.blocks[:2]
        self.head = nn.Linear(16, 11, bias=False)
        self.head.weight = self.proj.weight


def _tied_tower_rank(sharded):
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(3))
    params, fsdp = train_any_module(TiedTower(), ids, sharded, by_size(100), TRAIN)
    return params, fsdp and [u.name for u in fsdp.units]


def test_a_weight_tied_across_a_units_boundary_stays_in_the_common_ancestor():
    """by_size(100) would make the 176-element embedding a unit, freed after its forward, while the
    head (outside it) still reads the tied weight: it stays in the root, which holds both users."""
    reference, _ = run_ranks(_tied_tower_rank, 1, False)[0]
    for params, units in run_ranks(_tied_tower_rank, 2, True, timeout=60):
        assert units == ["<root>", "blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]  # no embedding unit
        for name, p in reference.items():
            assert (params[name] - p).abs().max() <= 1e-5, name


def test_a_size_policy_takes_a_module_holding_exactly_its_minimum():
    """by_size(n): "at least n" parameters outside the units below, as torch's
    size_based_auto_wrap_policy (`>= min_num_params`); decided bottom-up, so a parent holding
    only what its children left is no unit."""
    from meshlm.parallel.fsdp_units import choose_units

    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Sequential(nn.Linear(4, 4, bias=False), nn.LayerNorm(4)))
    names = lambda policy: [name for name, _ in choose_units(model, policy)]  # noqa: E731
    assert names(by_size(16)) == ["<root>", "0", "1.0"]  # 16 each; the LayerNorm's 8, left to "1", too few: root
    assert names(by_size(17)) == ["<root>", "1"]  # no linear alone; "1" with 16 + 8
    assert names(by_size(8)) == ["<root>", "0", "1.0", "1.1"]  # the LayerNorm's 8 too
    assert [len(params) for _, params in choose_units(model, by_size(16))] == [2, 1, 1]


# --------------------------------------------------------------------------- end to end


def test_meshlm_train_zero3_on_two_ranks_follows_the_single_process_loss_curve(corpus, single_cli_run, tmp_path):
    single = read_metrics(single_cli_run[0])
    run_meshlm(*cli_train_args(corpus, tmp_path / "two", "parallel.dp=2", "parallel.zero=3", nproc=2))
    sharded = read_metrics(tmp_path / "two")
    assert [r["loss"] for r in sharded] == pytest.approx([r["loss"] for r in single], abs=1e-5)
    assert [r["eval_loss"] for r in sharded if "eval_loss" in r] == pytest.approx(
        [r["eval_loss"] for r in single if "eval_loss" in r], abs=1e-5)
    assert (tmp_path / "two" / "final" / "model.safetensors").exists()
