import itertools

import pytest
import torch
import torch.distributed as dist

from meshlm.config import Config, ConfigError
from meshlm.mesh import AXES, Layout, ParallelContext, check_layout, normalize_axes
from meshlm.testing import run_ranks

ALL_AXIS_SETS = [c for k in range(1, 5) for c in itertools.combinations(AXES, k)]


def brute_force_groups(layout: Layout, axes) -> list[tuple[int, ...]]:
    """Number every coordinate tuple in order, tp fastest, and group the ranks whose coordinates
    agree outside `axes`. Shares nothing with Layout's stride arithmetic."""
    axes = normalize_axes(axes)
    sizes = [getattr(layout, a) for a in AXES]
    by_key: dict[tuple, list[int]] = {}
    # itertools.product varies its last factor fastest, so pass the axes slowest first.
    for rank, rev in enumerate(itertools.product(*(range(s) for s in reversed(sizes)))):
        coords = dict(zip(reversed(AXES), rev))
        by_key.setdefault(tuple(coords[a] for a in AXES if a not in axes), []).append(rank)
    return sorted(tuple(g) for g in by_key.values())


def brute_force_coords(layout: Layout) -> list[dict]:
    sizes = [getattr(layout, a) for a in AXES]
    return [dict(zip(reversed(AXES), rev)) for rev in itertools.product(*(range(s) for s in reversed(sizes)))]


SHAPES = [Layout(*s) for s in itertools.product((1, 2, 3, 4), repeat=4)] + [
    Layout(tp=8, cp=1, dp=16, pp=4), Layout(tp=8, cp=2, dp=4, pp=8), Layout(tp=1, cp=1, dp=128, pp=1),
    Layout(tp=5, cp=3, dp=2, pp=7), Layout(tp=2, cp=8, dp=1, pp=16),
]


def test_rank_arithmetic_matches_brute_force_for_hundreds_of_shapes():
    assert len(SHAPES) > 250
    for layout in SHAPES:
        expected_coords = brute_force_coords(layout)
        assert [layout.coords(r) for r in range(layout.world_size)] == expected_coords, layout
        assert [layout.rank_of(c) for c in expected_coords] == list(range(layout.world_size))
        # an axis left out counts as coordinate 0 (as rank_of's docstring says)
        assert [layout.rank_of({a: v for a, v in c.items() if v}) for c in expected_coords] == \
            list(range(layout.world_size))
        for axes in ALL_AXIS_SETS:
            groups = layout.groups(axes)
            assert groups == brute_force_groups(layout, axes), (layout, axes)
            assert len(groups) * layout.size(axes) == layout.world_size
            for rank in range(0, layout.world_size, max(1, layout.world_size // 7)):
                assert layout.group_of(rank, axes) == next(g for g in groups if rank in g)


def test_pipeline_neighbours_and_embedding_groups_for_hundreds_of_shapes():
    for layout in SHAPES:
        coords = brute_force_coords(layout)
        for rank, c in enumerate(coords):
            nxt, prv = coords[layout.pp_neighbour(rank, +1)], coords[layout.pp_neighbour(rank, -1)]
            for axis in ("tp", "cp", "dp"):
                assert nxt[axis] == prv[axis] == c[axis]
            assert nxt["pp"] == (c["pp"] + 1) % layout.pp and prv["pp"] == (c["pp"] - 1) % layout.pp
        emb = layout.embedding_groups()
        for group, pipeline in zip(emb, layout.groups("pp")):
            assert group == tuple(sorted({pipeline[0], pipeline[-1]}))
            assert {coords[r]["pp"] for r in group} == {0, layout.pp - 1}


def test_tp_is_the_fastest_axis_and_pp_the_slowest():
    layout = Layout(tp=2, cp=1, dp=2, pp=2)
    assert layout.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout.groups(("dp", "cp")) == layout.groups("cp+dp") == layout.groups("dp")
    assert layout.groups("world") == [tuple(range(8))]


def test_axis_and_layout_errors_are_clear():
    with pytest.raises(ValueError, match="unknown axes"):
        normalize_axes("ep")
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        Layout(tp=0)
    with pytest.raises(ValueError, match="outside a world of 4"):
        Layout(dp=4).coords(4)


# --------------------------------------------------------------------------- validation


def _cfg(**parallel) -> Config:
    cfg = Config()  # preset "tiny": 6 heads, 2 kv heads, 4 layers, ffn 512, vocab 4096
    for key, value in parallel.items():
        section, _, name = key.partition("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.mark.parametrize("overrides, message", [
    (dict(parallel__tp=4), "parallel.tp: model.n_heads=6 is not divisible by tp=4"),
    (dict(parallel__tp=3), "parallel.tp: model.n_kv_heads=2 neither divides nor is divisible by tp=3"),
    (dict(parallel__tp=2, model__ffn_dim=513), "parallel.tp: model.ffn_dim=513 is not divisible by tp=2"),
    (dict(parallel__tp=6, model__ffn_dim=516, model__vocab_size=9),  # rows 0-1, ..., 8-9: rank 5 has none
     "parallel.tp: model.vocab_size=9 in slices of 2 rows leaves the last of tp=6 ranks no vocabulary"),
    (dict(parallel__pp=3), "parallel.pp: model.n_layers=4 is not divisible into pp*pp_virtual = 3*1 = 3 stages"),
    (dict(parallel__pp=2, parallel__pp_virtual=3, parallel__pp_schedule="interleaved"),
     "parallel.pp: model.n_layers=4 is not divisible into pp*pp_virtual = 2*3 = 6 stages"),
    (dict(parallel__pp=2, parallel__pp_virtual=2), "parallel.pp_virtual: 2 virtual stages need parallel.pp_schedule=interleaved"),
    (dict(parallel__cp=3), "parallel.cp: train.seq_len=128 is not divisible by 2*cp = 6"),
    (dict(parallel__cp=2, train__seq_len=102), "parallel.cp: train.seq_len=102 is not divisible by 2*cp = 4"),
    (dict(parallel__tp=2, parallel__sp=True, train__seq_len=127), "parallel.sp: the per-rank sequence"),
])
def test_check_layout_names_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        check_layout(_cfg(**overrides), 8)
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides", [
    dict(), dict(parallel__tp=2), dict(parallel__pp=2, parallel__pp_virtual=2, parallel__pp_schedule="interleaved"),
    dict(parallel__pp=4), dict(parallel__cp=4), dict(parallel__tp=2, parallel__sp=True, parallel__cp=2),
    dict(parallel__tp=2, model__n_heads=8, model__n_kv_heads=4, model__dim=256),
    dict(parallel__tp=6, model__ffn_dim=516, model__vocab_size=31),  # the last rank: row 30 alone
])
def test_check_layout_accepts_valid_layouts(overrides):
    check_layout(_cfg(**overrides), 8)


# --------------------------------------------------------------------------- process groups


def test_single_process_context_needs_no_process_group():
    assert not dist.is_initialized()
    ctx = ParallelContext(Layout())
    assert (ctx.rank, ctx.world_size, ctx.groups_created) == (0, 1, 0)
    assert ctx.group("dp") is None and ctx.group(("dp", "cp")) is None and ctx.group("world") is None
    assert ctx.ranks("tp") == (0,) and ctx.embedding_ranks == (0,)
    assert ctx.is_first_stage and ctx.is_last_stage and ctx.next_rank == ctx.prev_rank == 0
    assert ctx.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="does not match the world size 1"):
        ParallelContext(Layout(dp=2))


def _context_rank(layout_kwargs):
    ctx = ParallelContext(Layout(**layout_kwargs))
    out = {"coords": ctx.coords, "groups_created": ctx.groups_created, "sums": {}, "ranks": {}}
    # Every group sums its members' ranks: proves each rank holds the group it thinks it holds.
    for axes in ("tp", "cp", "dp", "pp", ("dp", "cp"), "world"):
        t = torch.tensor([float(ctx.rank)])
        if ctx.size(axes) > 1:
            dist.all_reduce(t, group=ctx.group(axes))
        out["sums"][str(axes)] = t.item()
        out["ranks"][str(axes)] = ctx.ranks(axes)
    t = torch.tensor([float(ctx.rank)])
    if ctx.embedding_group is not None:
        dist.all_reduce(t, group=ctx.embedding_group)
    out["embedding"] = (ctx.embedding_ranks, t.item())
    out["stage"] = (ctx.is_first_stage, ctx.is_last_stage)
    # Pipeline neighbours: everyone sends its rank to the next stage.
    if ctx.size("pp") > 1:
        got = torch.zeros(1)
        handles = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([float(ctx.rank)]), ctx.next_rank),
                                          dist.P2POp(dist.irecv, got, ctx.prev_rank)])
        for h in handles:
            h.wait()
        out["from_prev"] = (ctx.prev_rank, got.item())
    return out


@pytest.mark.parametrize("layout_kwargs, new_groups", [
    (dict(tp=2, cp=1, dp=2, pp=2), 4 + 4 + 4),  # tp, dp, pp; cp=1 costs nothing, dp+cp reuses dp
    (dict(tp=2, cp=2, dp=1, pp=2), 4 + 4 + 4),  # tp, cp, pp; dp+cp reuses cp
    (dict(tp=1, cp=1, dp=2, pp=4), 4 + 2 + 2),  # dp, pp, and the (first, last) embedding pairs
    (dict(tp=2, cp=1, dp=2, pp=1), 2 + 2),  # tp, dp; one stage holds both embeddings: no group
])
def test_every_rank_holds_the_right_groups(layout_kwargs, new_groups):
    layout = Layout(**layout_kwargs)
    results = run_ranks(_context_rank, layout.world_size, layout_kwargs, timeout=60)
    for rank, out in enumerate(results):
        assert out["coords"] == layout.coords(rank)
        assert out["groups_created"] == new_groups
        for axes in ("tp", "cp", "dp", "pp", ("dp", "cp"), "world"):
            members = layout.group_of(rank, axes)
            assert out["ranks"][str(axes)] == members
            assert out["sums"][str(axes)] == sum(members)
        pipeline = layout.group_of(rank, "pp")
        emb = tuple(sorted({pipeline[0], pipeline[-1]}))
        # Middle stages are not in their pipeline's embedding group: nothing is reduced there.
        assert out["embedding"] == (emb, float(sum(emb)) if rank in emb else float(rank))
        stage = layout.coords(rank)["pp"]
        assert out["stage"] == (stage == 0, stage == layout.pp - 1)
        if layout.pp > 1:
            prev = layout.pp_neighbour(rank, -1)
            assert out["from_prev"] == (prev, float(prev))
