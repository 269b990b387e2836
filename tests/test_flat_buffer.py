"""The flat-buffer bookkeeping under DDP and ZeRO: buckets in reverse order, padded and sharded
exactly; segments that address each parameter's own elements; the ready tracker's launch order
and its unused-parameter list. Pure Python, no processes."""

import pytest
import torch
from torch import nn

from meshlm.parallel.flat_buffer import FlatLayout, ReadyTracker


def test_flat_layout_buckets_in_reverse_order_padded_and_sharded_exactly():
    params = [(f"p{i}", nn.Parameter(torch.zeros(k))) for i, k in enumerate([5, 7, 3, 11, 2])]
    layout = FlatLayout(list(reversed(params)), bucket_bytes=4 * 10, align=4)
    assert [s.name for s in layout.slots] == ["p4", "p3", "p2", "p1", "p0"]
    # p3 (11 elements) is over the cap: a bucket of its own, not appended to p4's
    assert [[s.name for s in b.slots] for b in layout.buckets] == [["p4"], ["p3"], ["p2", "p1"], ["p0"]]
    assert all(b.numel % 4 == 0 for b in layout.buckets) and layout.numel == 4 + 12 + 12 + 8
    for world in (2, 3, 4):  # ZeRO aligns to the world: each bucket's shards cover it exactly once
        layout = FlatLayout(list(reversed(params)), bucket_bytes=4 * 10, align=world)
        for b in layout.buckets:
            covered = [0] * layout.numel
            for r in range(world):
                for seg in layout.segments(*b.shard(r, world), b.slots):
                    for i in range(seg.lo, seg.hi):
                        covered[i] += 1
            assert all(covered[i] == 1 for s in b.slots for i in range(s.start, s.end)), (world, b)


def test_segments_address_the_parameters_own_elements():
    """flat[seg.lo:seg.hi] is param.view(-1)[seg.p_lo:seg.p_hi] (what checkpoints and ZeRO's
    optimizer address), every segment non-empty, at shard boundaries that cut parameters."""
    params = [(f"p{i}", nn.Parameter(torch.arange(k, dtype=torch.float32) + 100 * i)) for i, k in enumerate([5, 7, 4])]
    layout = FlatLayout(params, bucket_bytes=4 * 100, align=3)  # one bucket of 16 elements, padded to 18
    flat = torch.full((layout.numel,), -1.0)
    for s in layout.slots:
        flat[s.start: s.end] = s.param.detach()
    for lo, hi in [(0, 18), (0, 6), (6, 12), (12, 18), (5, 5), (4, 13)]:
        segments = layout.segments(lo, hi)
        assert all(seg.hi > seg.lo for seg in segments)
        assert sum(seg.hi - seg.lo for seg in segments) == max(0, min(hi, 16) - lo)
        for seg in segments:
            assert torch.equal(flat[seg.lo: seg.hi], seg.slot.param.detach().view(-1)[seg.p_lo: seg.p_hi])


def test_bucket_sizes_round_up_to_the_alignment_exactly():
    from meshlm.parallel.flat_buffer import round_up

    assert [round_up(x, 4) for x in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 12]
    params = [(f"p{i}", nn.Parameter(torch.zeros(k))) for i, k in enumerate([4, 4, 1, 1])]
    layout = FlatLayout(params, bucket_bytes=4 * 8, align=4)  # a bucket of exactly 8 needs no padding
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 8), (8, 12)]
    tiny = FlatLayout(params[2:], bucket_bytes=1, align=1)  # below one element: a bucket per parameter
    assert [(b.start, b.end) for b in tiny.buckets] == [(0, 1), (1, 2)]


def test_ready_tracker_launches_in_order_and_learns_unused_parameters():
    a, b, c, d = (nn.Parameter(torch.zeros(1)) for _ in range(4))
    launched = []
    tracker = ReadyTracker([[("a", a), ("b", b)], [("c", c)], [("d", d)]], launched.append)
    tracker.mark(c)  # bucket 1 is full, but bucket 0 is not: nothing may go before it
    assert launched == []
    tracker.mark(a)
    tracker.mark(b)
    assert launched == [0, 1]
    assert tracker.flush() == ["d"] and launched == [0, 1, 2]  # d got no gradient on step 1
    tracker.reset()
    launched.clear()
    for p in (a, b, c):
        tracker.mark(p)
    assert launched == [0, 1, 2]  # step 2 does not wait for d
    tracker.reset()
    for p in (a, b, c):
        tracker.mark(p)
    with pytest.raises(RuntimeError, match="'d'"):
        tracker.mark(d)  # unused on step 1, a gradient now, after its bucket was reduced


def test_ready_tracker_decides_what_is_unused_over_the_whole_first_step():
    """An engine that flushes after every backward (FSDP: under a pipeline a backward covers one
    chunk) says when the step ends: a parameter reached by any backward of step 1 is waited for
    later; only one no backward reached is unused. (Decided at the first flush, a chunk of no
    layers made every unit unused.)"""
    a, b, c = (nn.Parameter(torch.zeros(1)) for _ in range(3))
    launched = []
    tracker = ReadyTracker([[("a", a)], [("b", b)], [("c", c)]], launched.append)
    assert tracker.flush(end_of_step=False) == ["a", "b", "c"]  # a backward that reached none
    tracker.reset()
    tracker.mark(a)
    tracker.mark(b)
    assert tracker.flush(end_of_step=False) == ["c"] and tracker.first_step
    assert tracker.end_first_step() == ["c"] and not tracker.first_step
    tracker.reset()
    launched.clear()
    tracker.mark(a)
    assert launched == [0]  # b is waited for: it had a gradient in step 1
    tracker.mark(b)
    assert launched == [0, 1, 2]
