"""The pipeline's point-to-point layer on its own (parallel/pipeline/p2p.py): which connection each
message travels on gloo, the spec two neighbours swap before any activation, and its clear error.
The schedules' numbers against one process are test_pipeline.py's."""

import pytest
import torch

from meshlm.testing import RankFailure, run_ranks
from tests.helpers import pp2_engine, pp2_microbatches


def _connections_rank():
    """Two 1F1B steps at pp=2 on this rank: each batch the engine posts, as its messages' directions
    (toward a lower or a higher rank) and the process group carrying it; and how many times the
    neighbours swapped their specs."""
    import torch.distributed as dist

    from meshlm.model.loss import token_loss_sum
    from meshlm.parallel.pipeline.schedules import build_schedule

    rank = dist.get_rank()
    engine, _ = pp2_engine()
    comm, post = engine.p2p.comm, engine.p2p.post
    batches, posting, exchanges = [], [], []
    issue = comm.batch_isend_irecv

    def recorded_issue(ops, axis="world", group=None):
        if not posting:  # the spec agreement's exchange
            exchanges.append(len(ops))
        else:
            directions = {"down" if (o.peer < rank if o.kind == "send" else o.peer > rank) else "up" for o in ops}
            ranks = None if group is None else dist.get_process_group_ranks(group)
            batches.append((sorted(directions), group is None, group is dist.group.WORLD, ranks))
        return issue(ops, axis, group=group)

    def recorded_post(ops):
        posting.append(1)
        try:
            return post(ops)
        finally:
            posting.pop()

    comm.batch_isend_irecv, engine.p2p.post = recorded_issue, recorded_post
    for _ in range(2):  # two steps
        engine.run(build_schedule("1f1b", 2, 4, 1)[rank], pp2_microbatches(4), loss_fn=token_loss_sum)
    dist.barrier()
    return batches, exchanges


def test_on_gloo_messages_toward_the_lower_rank_travel_a_connection_of_their_own():
    """gloo shares one connection per pair of ranks, locked while a message moves: a receive posted
    while a message moves the other way waits for it. So every message toward the lower rank (a
    send down, a receive from above) goes through a second group over the whole world, never in a
    batch with the other direction; the rest use the default (world) connection. The neighbours
    swap their spec once (a send and a receive) for the run's one activation shape, not once per
    step."""
    for rank, (batches, exchanges) in enumerate(run_ranks(_connections_rank, 2, timeout=60)):
        assert {tuple(d) for d, *_ in batches} == {("down",), ("up",)}, (rank, batches)  # both, never mixed
        for directions, default, world, ranks in batches:
            if directions == ["up"]:
                assert default, (rank, batches)
            else:  # a group of its own, spanning the world (peers stay global ranks)
                assert not default and not world and ranks == [0, 1], (rank, batches)
        assert exchanges == [2], rank


def _post_rank(backend):
    """Post a send and a receive both ways between the two stages, as if on `backend` (the world
    is gloo's either way), then an empty post: the batches issued, and what arrived."""
    import torch.distributed as dist

    from meshlm.comm import Comm
    from meshlm.mesh import Layout, ParallelContext
    from meshlm.parallel.pipeline.p2p import PipelineP2P

    ctx = ParallelContext(Layout(pp=2))
    ctx.backend = backend
    p2p = PipelineP2P(Comm(ctx))
    rank, issued = ctx.rank, []
    issue = p2p.comm.batch_isend_irecv

    def recorded_issue(ops, axis="world", group=None):
        issued.append((sorted((o.kind, o.peer) for o in ops), group is None))
        return issue(ops, axis, group=group)

    p2p.comm.batch_isend_irecv = recorded_issue
    received = torch.empty(3)
    p2p.post([("send", torch.full((3,), float(rank)), 1 - rank), ("recv", received, 1 - rank)]).wait()
    p2p.post([]).wait()  # nothing to move: a handle all the same
    dist.barrier()
    return issued, received.tolist()


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_only_gloo_splits_a_post_by_direction_and_an_empty_post_is_a_handle(backend):
    """NCCL has no per-connection lock: one batch on the default connection, both directions."""
    for rank, (issued, received) in enumerate(run_ranks(_post_rank, 2, backend, timeout=60)):
        assert received == [float(1 - rank)] * 3
        both = [("recv", 1 - rank), ("send", 1 - rank)]
        if backend == "nccl":
            assert issued[:1] == [(both, True)], (rank, issued)
        else:
            assert sorted(kinds for batch, _ in issued[:2] for kinds in batch) == both, (rank, issued)
            assert len(issued) >= 2 and all(len(batch) == 1 for batch, _ in issued[:2]), (rank, issued)


def test_every_spec_encodes_to_one_length_and_decodes_to_itself():
    """A neighbour receives the spec into a buffer of its own spec's size, so every spec, of any
    number of dims, must encode to the same length; and decode to the same shape and dtype."""
    from meshlm.parallel.pipeline.p2p import _DTYPES, _MAX_DIMS, TensorSpec

    lengths = set()
    for dims in range(_MAX_DIMS + 1):
        for dtype in _DTYPES:
            spec = TensorSpec(tuple(range(3, 3 + dims)), dtype)
            encoded = spec.encode(torch.device("cpu"))
            lengths.add(encoded.numel())
            assert TensorSpec.decode(encoded) == spec
    assert len(lengths) == 1
    for shape, dtype in (((1,) * (_MAX_DIMS + 1), torch.float32), ((2, 3), torch.int64)):
        with pytest.raises(ValueError, match="cannot send tensors of shape"):
            TensorSpec(shape, dtype).encode(torch.device("cpu"))


def _disagreeing_rank(shapes):
    import torch.distributed as dist

    from meshlm.comm import Comm
    from meshlm.mesh import Layout, ParallelContext
    from meshlm.parallel.pipeline.p2p import P2PMismatch, PipelineP2P, TensorSpec

    p2p = PipelineP2P(Comm(ParallelContext(Layout(pp=2))))
    try:
        p2p.agree(TensorSpec(shapes[dist.get_rank()], torch.float32))
    except P2PMismatch as e:
        return str(e)
    return None


def test_stages_that_disagree_on_the_number_of_dims_fail_as_clearly_as_on_a_size():
    """Both sides raise, each naming both specs (test_pipeline.py checks one side, same dims)."""
    first, second = run_ranks(_disagreeing_rank, 2, [(2, 16, 32), (32, 32)], timeout=60)
    assert first.startswith("pipeline rank 0 expects activations of [2, 16, 32] float32 but pipeline rank 1 "
                            "expects [32, 32] float32")
    assert second.startswith("pipeline rank 1 expects activations of [32, 32] float32 but pipeline rank 0 "
                             "expects [2, 16, 32] float32")
