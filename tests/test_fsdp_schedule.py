"""FSDP's memory schedule, each part against what it promises: which units are unsharded when
(forward, backward, evaluation, prefetches in flight), the root's embedding cut off after forward
unless the forward saved it, modules whose root holds nothing, and unused parameters. Values are
checked against one process where the schedule could change them."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshlm.config import TrainConfig
from meshlm.model.llama import TransformerBlock
from meshlm.model.loss import token_loss_sum
from meshlm.parallel.fsdp import FullyShardedDataParallel, by_class, by_size
from meshlm.testing import run_ranks
from meshlm.train.optim import build_optimizer

from helpers import comm_here, debug_model, local_batch, train_any_module

torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # import dynamo once, before forking ranks

TRAIN = TrainConfig(lr=1e-3, weight_decay=0.1)


def _root_after_forward_rank(tie):
    """The root unit's storage after a training forward, and whether saved-tensor hooks were
    active while a block ran (they would override a user's own, e.g. activation offloading)."""
    model = debug_model(tie_embeddings=str(tie).lower())
    comm = comm_here()
    fsdp = FullyShardedDataParallel(model, comm, TRAIN, policy=by_class(TransformerBlock))
    hooks_in_blocks = []
    model.layers[0].register_forward_pre_hook(
        lambda *_: hooks_in_blocks.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None))
    inputs, targets, tokens = local_batch(0, dist.get_rank(), dist.get_world_size())
    loss = token_loss_sum(fsdp.module(inputs), targets) / tokens
    root = fsdp.root
    after_forward = root.full.untyped_storage().nbytes() // root.itemsize
    slots = {s.name: (s.start, s.end) for s in root.slots}
    loss.backward()
    return after_forward, root.tail, root.padded, slots, hooks_in_blocks


def test_the_root_cuts_off_an_untied_embedding_after_forward_and_keeps_a_tied_one():
    """Untied: the embedding's weight is laid out last in the root's buffer and cut off after
    forward (its backward needs only the indices), so the loss and the head's backward run
    without it; everything before it (the head's weight, which the head's backward reads: it
    ends exactly where the tail starts) stays. Tied: nothing is cut, and no saved-tensor hooks
    are left installed for nothing."""
    for after_forward, tail, padded, slots, hooks_in_blocks in run_ranks(_root_after_forward_rank, 2, False):
        assert tail == slots["tok_embeddings.weight"][0] == max(start for start, _ in slots.values())
        assert slots["output.weight"][1] == tail  # the head's weight ends where the tail starts
        assert after_forward == tail < padded
        assert hooks_in_blocks == [True]  # watching what the forward saves, until the root's forward ends
    # Tied, at 2 ranks and at 5, where the root's 32,832 elements are padded to 32,835.
    for world, pad in ((2, 0), (5, 3)):
        for after_forward, tail, padded, slots, hooks_in_blocks in run_ranks(_root_after_forward_rank, world, True):
            assert "output.weight" not in slots and tail == padded - pad == slots["norm.weight"][1]
            assert after_forward == padded
            assert hooks_in_blocks == [False]


class FunctionalTie(nn.Module):
    """An embedding whose weight the forward may also use outside the embedding, through the
    functional API: it is the root's tail (one owning module), but then the forward saves it
    for backward. `use`: "head" (after the blocks, as the output projection), "scale" (before the
    first block only, the tail's first element alone as a learned scale: the root's own forward
    saves it). Or the weight is not reused, and the root's forward saves tensors without a
    plain storage, which the check must pass over: "jagged" (a nested tensor of variable-length
    rows, as for packed sequences) or "sparse" (a sparse matrix)."""

    def __init__(self, use):
        super().__init__()
        self.use = use
        self.embedding = nn.Embedding(40, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 24), nn.GELU(), nn.Linear(24, 8)) for _ in range(2))
        self.head = nn.Linear(8, 40, bias=False) if use != "head" else None

    def forward(self, ids):
        h = self.embedding(ids)
        if self.use == "scale":
            h = h * (1 + self.embedding.weight[0, 0].abs())
        elif self.use == "jagged":
            h = torch.stack(torch.nested.as_nested_tensor(list(h), layout=torch.jagged).sin().unbind())
        elif self.use == "sparse":
            mix = torch.eye(h.shape[1]).roll(1, 0).add(torch.eye(h.shape[1])).to_sparse()
            h = torch.stack([torch.sparse.mm(mix, row) for row in h])
        for block in self.blocks:
            h = h + block(h)
        return self.head(h) if self.head is not None else h @ self.embedding.weight.t()


def _functional_tie_rank(sharded, use):
    torch.manual_seed(0)
    model = FunctionalTie(use)
    ids = torch.randint(0, 40, (4, 6), generator=torch.Generator().manual_seed(1))
    if not sharded:
        optimizer = build_optimizer(model, TRAIN)
        for _ in range(3):
            torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten(), reduction="sum").backward()
            optimizer.step()
            optimizer.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, None
    comm = comm_here()
    fsdp = FullyShardedDataParallel(model, comm, TRAIN, policy=by_size(400))  # blocks 416, embedding 320, head 320
    rank, n = dist.get_rank(), dist.get_world_size()
    kept = []
    for _ in range(3):
        mine = ids[rank * 4 // n: (rank + 1) * 4 // n]
        logits = fsdp.module(mine)
        kept.append(fsdp.root.full.untyped_storage().nbytes() // fsdp.root.itemsize)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine.flatten(), reduction="sum").backward()
        fsdp.finish_backward()
        fsdp.clip_and_step(TRAIN.lr, 0.0)
        fsdp.zero_grad()
    return fsdp.full_state_dict(), (kept, fsdp.root.padded, fsdp.root.tail)


@pytest.mark.parametrize("use", ["head", "scale", "jagged", "sparse"])
def test_an_embedding_weight_the_forward_saves_is_kept_and_the_result_equals_one_process(use):
    reference, _ = run_ranks(_functional_tie_rank, 1, False, use)[0]
    for params, (kept, padded, tail) in run_ranks(_functional_tie_rank, 2, True, use, timeout=60):
        assert tail == (0 if use == "head" else 320)  # the root's buffer: [head,] embedding
        # The tail stays where the forward saved it, else it is cut off after every forward.
        assert kept == [padded if use in ("head", "scale") else tail] * 3
        for name, p in reference.items():
            assert (params[name] - p).abs().max() <= 1e-5, name


def _gather_order_rank(prefetch, forward_prefetch):
    """The order of the unit all-gathers launched, between the forward pre-hooks and the
    backward pre-hooks (the output-gradient hooks) that trigger them."""
    model = debug_model(n_layers=3)
    comm = comm_here()
    fsdp = FullyShardedDataParallel(model, comm, TRAIN, policy=by_class(TransformerBlock),
                                    prefetch=prefetch, forward_prefetch=forward_prefetch)
    events, in_flight = [], []
    gather, pre_forward, pre_backward = comm.all_gather, fsdp._pre_forward, fsdp._pre_backward

    def all_gather(out, *args, **kwargs):
        events.append(("gather", next(u.index for u in fsdp.units if u.full is out)))
        assert kwargs["async_op"]  # launched, waited only where needed: a prefetch overlaps compute
        return gather(out, *args, **kwargs)

    def wrap(kind, hook):
        def recorded(unit):
            events.append((kind, unit.index))
            hook(unit)
            in_flight.append((kind, unit.index, [u.index for u in fsdp.units if u.handle is not None]))
            # None: a forward pre-hook's value would replace the inputs
        return recorded

    comm.all_gather = all_gather
    fsdp._pre_forward, fsdp._pre_backward = wrap("forward", pre_forward), wrap("backward", pre_backward)
    for step in range(2):
        inputs, targets, tokens = local_batch(step, dist.get_rank(), dist.get_world_size())
        (token_loss_sum(fsdp.module(inputs), targets) / tokens).backward()
        fsdp.finish_backward()
        fsdp.clip_and_step(TRAIN.lr, 1.0)
        fsdp.zero_grad()
    return events, in_flight, [u.name for u in fsdp.units]


@pytest.mark.parametrize("prefetch, forward_prefetch", [(True, False), (False, False), (True, True)])
def test_each_unit_is_gathered_once_the_unit_before_it_starts(prefetch, forward_prefetch):
    """Units 0 (root) .. 3 (layers.2). Forward gathers each unit at its pre-hook, or, with
    forward_prefetch, the next one too as soon as a unit starts. Backward: the root stays
    gathered; each block is gathered when the block after it starts its backward (prefetch), or
    at its own backward's start."""
    forward = ([("forward", 0), ("gather", 0), ("gather", 1), ("forward", 1), ("gather", 2), ("forward", 2),
                ("gather", 3), ("forward", 3)] if forward_prefetch else
               [("forward", 0), ("gather", 0), ("forward", 1), ("gather", 1), ("forward", 2), ("gather", 2),
                ("forward", 3), ("gather", 3)])
    backward = ([("backward", 0), ("gather", 3), ("backward", 3), ("gather", 2), ("backward", 2), ("gather", 1),
                 ("backward", 1)] if prefetch else
                [("backward", 0), ("backward", 3), ("gather", 3), ("backward", 2), ("gather", 2), ("backward", 1),
                 ("gather", 1)])
    # After each hook: the prefetch it launched is still in flight (waited only by its own unit).
    forward_in_flight = [("forward", u, [u + 1] if forward_prefetch and u < 3 else []) for u in range(4)]
    backward_in_flight = [("backward", u, [{0: 3, 3: 2, 2: 1}[u]] if prefetch and u != 1 else []) for u in (0, 3, 2, 1)]
    for events, in_flight, names in run_ranks(_gather_order_rank, 2, prefetch, forward_prefetch, timeout=60):
        assert names == ["<root>", "layers.0", "layers.1", "layers.2"]
        assert events == (forward + backward) * 2
        assert in_flight == (forward_in_flight + backward_in_flight) * 2


def _evaluation_rank():
    model = debug_model()
    inputs, _, _ = local_batch(0, dist.get_rank(), dist.get_world_size())
    with torch.no_grad():
        reference = model(inputs)
    comm = comm_here()
    fsdp = FullyShardedDataParallel(model, comm, TRAIN, policy=by_class(TransformerBlock))
    gathered = []
    for block in model.layers:
        block.register_forward_pre_hook(lambda *_: gathered.append(  # after FSDP's own pre-hook
            [u.index for u in fsdp.units if u.full.untyped_storage().nbytes() > 0]))
    with torch.no_grad():
        logits = fsdp.module(inputs)
    left = [u.index for u in fsdp.units if u.full.untyped_storage().nbytes() > 0]
    return (logits - reference).abs().max().item(), gathered, left


def test_an_evaluation_forward_equals_one_process_and_frees_each_block_after_it():
    """No backward follows: each block is freed after its forward, the root (embedding, final
    norm, head) when the whole forward ends."""
    for error, gathered, left in run_ranks(_evaluation_rank, 2):
        assert error <= 1e-6
        assert gathered == [[0, 1], [0, 2]] and left == []


def _all_in_units_rank(sharded):
    """nn.Sequential(Linear, GELU, Linear) with every Linear a unit: the root holds nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    params, fsdp = train_any_module(model, x, sharded, by_class(nn.Linear), TRAIN)
    with torch.no_grad():
        evaluated = model(x)
    if fsdp is None:
        return params, evaluated, None
    left = [u.name for u in fsdp.units if u.full.untyped_storage().nbytes() > 0]
    return params, evaluated, ([u.name for u in fsdp.units], fsdp.root, left)


def test_a_module_whose_parameters_all_sit_in_units_equals_one_process():
    reference, logits, _ = run_ranks(_all_in_units_rank, 1, False)[0]
    for params, evaluated, (units, root, left) in run_ranks(_all_in_units_rank, 2, True, timeout=60):
        assert units == ["0", "2"] and root is None and left == []  # evaluation freed both
        for name, p in reference.items():
            assert (params[name] - p).abs().max() <= 1e-5, name
        assert (evaluated - logits).abs().max() <= 1e-5


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def _unused_rank():
    torch.manual_seed(0)
    comm = comm_here()
    fsdp = FullyShardedDataParallel(WithUnused(), comm, TRAIN, policy=by_class(nn.Linear))
    seen = []
    for _ in range(2):
        fsdp.module(torch.ones(2, 4)).sum().backward()
        fsdp.finish_backward()  # the step's backwards are done: the first step's decides what is unused
        seen.append(list(fsdp.unused_parameters))
        fsdp.clip_and_step(TRAIN.lr, 0.0)
        fsdp.zero_grad()
    return seen


def test_parameters_unused_on_the_first_step_are_named():
    for seen in run_ranks(_unused_rank, 2):
        assert seen == [["unused.weight", "unused.bias"]] * 2


class EarlyExit(nn.Module):
    """Two units and nothing at the root; evaluation may stop after the first."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, stop_early=False):
        h = self.first(x)
        return h if stop_early else self.second(h)


def _early_exit_rank():
    torch.manual_seed(0)
    comm = comm_here()
    fsdp = FullyShardedDataParallel(EarlyExit(), comm, TRAIN, policy=by_class(nn.Linear), forward_prefetch=True)
    with torch.no_grad():
        fsdp.module(torch.ones(2, 4), stop_early=True)
    return fsdp.root, [u.name for u in fsdp.units if u.full.untyped_storage().nbytes() > 0]


def test_the_end_of_an_evaluation_forward_frees_a_prefetched_unit_that_never_ran():
    """`first` prefetches `second`, which the forward then skips: with no root unit to end the
    forward, the module's own forward hook frees it."""
    for root, left in run_ranks(_early_exit_rank, 2):
        assert root is None and left == []


def _vocab_parallel_root_rank(corpus, run_dir):
    """The root unit's storage after the model's forward in a tensor-parallel ZeRO-3 trainer."""
    from helpers import build_trainer, small_cfg

    trainer = build_trainer(small_cfg(corpus, run_dir, 2, "parallel.tp=2", "parallel.zero=3"))
    fsdp = trainer.dp
    root, after_forward = fsdp.root, []
    fsdp.module.register_forward_hook(
        lambda *_: after_forward.append(root.full.untyped_storage().nbytes() // root.itemsize))
    trainer.train_step()
    slots = {s.name: s.start for s in root.slots}
    return after_forward, root.tail, root.padded, slots


def test_the_root_cuts_off_a_vocabulary_parallel_embedding_after_forward(corpus, tmp_path):
    """Under tensor parallelism the embedding is a VocabParallelEmbedding, whose lookup saves only
    indices, as nn.Embedding's does: its table is the root's tail, cut off after every forward of
    the step (it was kept, unsharded through the loss and the head's backward: 64 KiB of the debug
    model's loss window at 16 tokens, 16% of it; docs/memory.md). That the values are unchanged is
    the tensor-parallel ZeRO-3 runs against one process (test_tensor_parallel.py,
    test_sharded_init.py)."""
    for after_forward, tail, padded, slots in run_ranks(_vocab_parallel_root_rank, 2, corpus, tmp_path / "run",
                                                        timeout=120):
        assert tail == slots["tok_embeddings.weight"] == max(slots.values()) < padded
        assert after_forward == [tail] * 4  # four micro-batches, each forward cut off
