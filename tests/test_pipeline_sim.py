"""The pipeline simulator: textbook bubbles on uniform costs, what P2P latency and uneven stages do
to them, and `meshlm simulate pipeline` (text, --json, PNG/SVG timelines, usage errors)."""

import json
import random
import sys

import pytest

from meshlm.analysis.pipeline_sim import OpCosts, ideal_bubble, main, simulate_schedule
from meshlm.cli import main as cli_main


@pytest.mark.parametrize("kind,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_uniform_costs_give_the_textbook_bubble(kind, v, pp):
    for m in (pp, 2 * pp, 3 * pp, 4 * pp):  # interleaved: the formula assumes whole rounds of pp
        result = simulate_schedule(kind, pp, m, v)
        assert result.bubble_fraction == pytest.approx((pp - 1) / ((v if kind == "interleaved" else 1) * m + pp - 1))
        # step = busy + bubble: m*(F+B) per rank, here F = 1 and B = 2 per chunk, v chunks
        busy = m * v * 3
        assert result.step_time == pytest.approx(busy / (1 - result.bubble_fraction))
        assert result.bubble_fraction == pytest.approx(ideal_bubble(kind, pp, m, v))
        assert result.busy == [busy] * pp and result.idle == [result.step_time - busy] * pp


def test_gpipe_and_1f1b_share_the_bubble_but_not_the_memory():
    gpipe, one_f_one_b = simulate_schedule("gpipe", 4, 8), simulate_schedule("1f1b", 4, 8)
    assert gpipe.step_time == one_f_one_b.step_time
    assert gpipe.peak_inflight == [8, 8, 8, 8] and one_f_one_b.peak_inflight == [4, 3, 2, 1]


def test_p2p_latency_and_a_slow_stage_grow_the_bubble():
    base = simulate_schedule("1f1b", 4, 8)
    with_latency = simulate_schedule("1f1b", 4, 8, costs=OpCosts(1.0, 2.0, 0.25))
    assert with_latency.step_time > base.step_time and with_latency.bubble_fraction > base.bubble_fraction
    # The last stage also runs the head and the loss: everyone else waits for it.
    uneven = simulate_schedule("1f1b", 4, 8, costs=OpCosts([1, 1, 1, 1.5], [2, 2, 2, 3]))
    assert uneven.bubble_fraction > base.bubble_fraction
    assert max(uneven.busy) == uneven.busy[3]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_deferred_weight_gradients_shorten_the_drain_by_the_last_weight_half(kind):
    # The last stage is twice as slow (it carries the head), so rank 0 waits on its gradients.
    slow_last = dict(forward=[1.0, 2.0], backward=[2.0, 4.0])
    plain = simulate_schedule(kind, 2, 8, costs=OpCosts(**slow_last))
    deferred = simulate_schedule(kind, 2, 8, costs=OpCosts(**slow_last, weight_fraction=0.5))
    # Rank 1's last backward sends after its dgrad half: rank 0 starts its last backward half a
    # backward (2 ticks) earlier, while rank 1 computes the weight half. Same work, 2 ticks less.
    assert deferred.step_time == plain.step_time - 2
    assert deferred.busy == plain.busy
    weights = [s for s in deferred.spans if s.op == "weight"]
    assert [(s.rank, s.microbatch, s.end - s.start) for s in weights] == [(1, 7, 2.0)]  # rank 0 sends nothing
    assert not [s for s in plain.spans if s.op == "weight"]
    # With uniform costs GPipe's rank 0 never waits in the drain: deferral changes nothing there.
    uniform = simulate_schedule(kind, 2, 8, costs=OpCosts(weight_fraction=0.5)).step_time
    assert uniform == simulate_schedule(kind, 2, 8).step_time - (1 if kind == "1f1b" else 0)


@pytest.mark.parametrize("pp,v", [(2, 2), (4, 2), (2, 3)])
def test_owed_weight_gradients_run_before_the_ranks_last_backward(pp, v):
    """Interleaved, rank 0's last backward is chunk 0's, which defers nothing and syncs the
    data-parallel reduction: the engine flushes what later chunks owe before it, and so does the
    simulator, even where no input is late (rank 0 is the slow one: its gradients arrive early)."""
    slow_first = OpCosts(forward=[2.0] + [1.0] * (pp - 1), backward=[4.0] + [1.0] * (pp - 1), weight_fraction=0.5)
    result = simulate_schedule("interleaved", pp, 2 * pp, v, costs=slow_first)
    spans = [s for s in result.spans if s.rank == 0]
    last_backward = max((s for s in spans if s.op == "backward"), key=lambda s: s.start)
    weights = [s for s in spans if s.op == "weight"]
    assert weights and all(s.end <= last_backward.start for s in weights)


def test_a_flush_fills_a_wait_in_simulated_time_not_in_the_order_ranks_are_simulated():
    """Interleaved pp=2, m=2, v=2, F=1, B=2 (dgrad 1 + wgrad 1 where deferred). Rank 0 ends its
    chunk-1 backwards at 9 (the last deferred, owing 1 tick); its next op, chunk 0's backward of
    micro-batch 0, needs rank 1's gradient, made 8-10: the flush fills 9-10 and the drain ends at
    14, a tick before the plain backward's 15. (The simulator once flushed wherever the sender had
    not been simulated that far yet, whatever the simulated times: 15, deferral gained nothing.)"""
    result = simulate_schedule("interleaved", 2, 2, 2, costs=OpCosts(weight_fraction=0.5))
    assert simulate_schedule("interleaved", 2, 2, 2).step_time == 15
    assert result.step_time == 14
    assert [(s.start, s.end) for s in result.spans if s.rank == 0 and s.op == "weight"] == [(9, 10)]


def test_cli_prints_bubble_step_time_and_peak_in_flight(capsys):
    assert main(["--schedule", "1f1b", "--pp", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "bubble 0.2727" in out and "peak in flight" in out


def test_cli_json_has_the_contract_keys(capsys):
    assert cli_main(["simulate", "pipeline", "--schedule", "interleaved", "--pp", "4", "--microbatches", "8",
                     "--virtual", "2", "--forward-cost", "2", "--p2p-cost", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bubble_fraction"] == pytest.approx(ideal_bubble("interleaved", 4, 8, 2))
    assert data["step_time"] == pytest.approx(2 * 3 * 8 * 2 / (1 - data["bubble_fraction"]))
    assert len(data["peak_inflight"]) == 4 and data["costs"]["backward"] == 4.0


@pytest.mark.parametrize("suffix,magic", [("png", b"\x89PNG"), ("svg", b"<svg")])
def test_cli_draws_the_timeline(tmp_path, capsys, suffix, magic):
    pytest.importorskip("matplotlib")
    out = tmp_path / f"timeline.{suffix}"
    assert main(["--schedule", "gpipe", "--pp", "2", "--microbatches", "4", "--out", str(out)]) == 0
    assert magic in out.read_bytes()[:400]


def test_cli_works_without_matplotlib_unless_asked_to_draw(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["--schedule", "gpipe", "--pp", "2", "--microbatches", "4"]) == 0
    assert main(["--schedule", "gpipe", "--pp", "2", "--microbatches", "4", "--out", str(tmp_path / "t.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["--schedule", "interleaved", "--pp", "2", "--microbatches", "5", "--virtual", "2"],
    ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--virtual", "2"],
    ["--schedule", "1f1b", "--pp", "0", "--microbatches", "4"],
    ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--forward-cost", "-1"],
    ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--out", "timeline.jpg"],
    ["--schedule", "zigzag", "--pp", "2", "--microbatches", "4"],
    ["--pp", "2", "--microbatches", "4"],
    ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--forward-cost", "0"],
    ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--weight-fraction", "1"],
    ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--weight-fraction", "nan"],
    ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--forward-cost", "nan"],
    ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--backward-cost", "inf"],
    ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--p2p-cost", "nan"],
    ["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--out", "/no/such/dir/t.png"],
])
def test_cli_bad_usage_exits_2_with_one_line(args, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "error" in err[-1]


@pytest.mark.parametrize("kind,pp,v", [("1f1b", 3, 1), ("gpipe", 3, 1), ("interleaved", 2, 2), ("interleaved", 3, 2),
                                       ("interleaved", 2, 3)])
def test_deferring_weight_gradients_never_lengthens_a_step(kind, pp, v):
    """The deferred weight gradients run only where the rank would wait (or at the end): never in
    front of an op whose input is there, so no schedule gets slower, whatever the stages and
    messages cost (a sample of random costs; flushing when the input *has* arrived instead makes
    interleaved steps longer, e.g. pp 2, m 4, forwards 2 and 1.5: 40 -> 40.75 at half the backward)."""
    rng = random.Random(f"{kind}{pp}{v}")
    for _ in range(60):
        forward = [rng.choice([1.0, 1.5, 2.0, 3.0]) for _ in range(pp)]
        backward = [rng.choice([1.5, 2.0, 2.5]) * f for f in forward]
        m, p2p, weight = rng.choice([pp, 2 * pp]), rng.choice([0.0, 0.3, 1.0]), rng.choice([0.3, 0.5, 0.7])
        plain = simulate_schedule(kind, pp, m, v, costs=OpCosts(forward, backward, p2p)).step_time
        deferred = simulate_schedule(kind, pp, m, v, costs=OpCosts(forward, backward, p2p, weight)).step_time
        assert deferred <= plain + 1e-9, (forward, backward, m, p2p, weight)


def _drawn(monkeypatch, tmp_path, result, **kwargs):
    """The figure draw_timeline saves, captured instead of written."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from meshlm.analysis.pipeline_sim import draw_timeline

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: saved.append(fig))
    draw_timeline(result, str(tmp_path / "t.png"), **kwargs)
    return saved[0]


@pytest.mark.parametrize("kind,v,weight", [("interleaved", 2, 0.5), ("interleaved", 3, 0.0), ("gpipe", 1, 0.0)])
def test_the_timeline_draws_every_span_where_it_ran_in_its_colour(monkeypatch, tmp_path, kind, v, weight):
    result = simulate_schedule(kind, 2, 4, v, costs=OpCosts(forward=[1.0, 2.0], weight_fraction=weight))
    fig = _drawn(monkeypatch, tmp_path, result, measured_bubble=0.25)
    ax = fig.axes[0]
    assert ax.get_title() == (f"{kind} pp=2 m=4{f' v={v}' if v > 1 else ''} — bubble {result.bubble_fraction:.1%} "
                              f"(measured 25.0%)")
    assert ax.get_ylim() == (1.5, -0.5) and ax.get_xlim() == (0, result.step_time)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert 6.0 <= fig.get_size_inches()[0] <= 18.0 and fig.get_size_inches()[1] == pytest.approx(0.55 * 2 + 1.3)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["forward", "backward", *(["deferred weight gradients"] if weight else []),
                      *(["lighter: later chunk"] if v > 1 else [])]
    base = {"forward": (0.20, 0.45, 0.80), "backward": (0.20, 0.62, 0.30), "weight": (0.55, 0.40, 0.70)}
    assert len(ax.collections) == len(ax.texts) == len(result.spans)
    for span, bar, label in zip(result.spans, ax.collections, ax.texts):
        shade = 0.45 * span.chunk / (v - 1) if v > 1 else 0.0  # later chunks lighter
        assert tuple(bar.get_facecolor()[0][:3]) == pytest.approx([c + (1 - c) * shade for c in base[span.op]])
        (x0, y0), (x1, y1) = bar.get_paths()[0].vertices.min(0), bar.get_paths()[0].vertices.max(0)
        assert (x0, x1, y0, y1) == pytest.approx((span.start, span.end, span.rank - 0.4, span.rank + 0.4))
        assert label.get_text() == str(span.microbatch)
        assert label.get_position() == pytest.approx(((span.start + span.end) / 2, span.rank))


def test_the_json_has_the_spans_only_when_asked():
    result = simulate_schedule("1f1b", 2, 2)
    assert "spans" not in result.to_dict() and len(result.to_dict(spans=True)["spans"]) == len(result.spans) == 8


def test_the_text_report_has_a_row_per_rank(capsys):
    assert main(["--schedule", "interleaved", "--pp", "2", "--microbatches", "4", "--virtual", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("interleaved pp=2 m=4 v=2: step time")
    result = simulate_schedule("interleaved", 2, 4, 2)
    assert [line.split() for line in lines[2:]] == [[str(r), f"{result.busy[r]:.3f}", f"{result.idle[r]:.3f}",
                                                     str(result.peak_inflight[r])] for r in range(2)]
