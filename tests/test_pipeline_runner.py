"""The pipeline runner's own rules. Its step metrics, the numbers a user reads to judge a
schedule: the measured bubble (1 - the ranks' summed busy time over pp x the slowest rank's wall
time) and the simulator's prediction fed with the op costs this step measured, each written out
here from its definition and compared with what the runner reports, on made-up timings that
differ per rank (steps shorter than a second, as real ones are). And: a loader that gives another
number of micro-batches than the schedule has is refused; only the pipeline holding global rank 0
gathers the full weights."""

from types import SimpleNamespace

import pytest
import torch

from meshlm.analysis.pipeline_sim import OpCosts, simulate
from meshlm.parallel.pipeline.engine import RunStats
from meshlm.parallel.pipeline.runner import PipelineRunner
from meshlm.parallel.pipeline.schedules import PipelineShape, build_schedule
from meshlm.testing import run_ranks


def _timings(rank: int, pp: int, weights: list[float]) -> RunStats:
    """Made-up timings of `rank`; at pp = 2 the first rank waited for nothing."""
    waits = [0.02 + rank / 1000, 0.004 + rank / 1000] if rank else [] if pp == 2 else [0.05]
    return RunStats(torch.zeros((), dtype=torch.float64), wall_s=0.1 + 0.025 * rank, busy_s=0.05 + 0.01 * rank,
                    forward_s=[0.01 * (rank + 1), 0.03 * (rank + 1)], backward_s=[0.05 + rank / 100, 0.07],
                    recv_wait_s=waits, weight_s=weights)


def _metrics(kind: str, virtual: int, weights: dict[int, list[float]]):
    import torch.distributed as dist

    from meshlm.comm import Comm
    from meshlm.mesh import Layout, ParallelContext

    pp, rank = dist.get_world_size(), dist.get_rank()
    ctx = ParallelContext(Layout(pp=pp))
    runner = SimpleNamespace(last_stats=_timings(rank, pp, weights.get(rank, [])), comm=Comm(ctx), ctx=ctx, pp=pp,
                             kind=kind, schedules=build_schedule(kind, pp, 4, virtual),
                             shape=PipelineShape(pp, 4, virtual))
    return PipelineRunner.step_metrics(runner)


@pytest.mark.parametrize("pp,kind,virtual,weights", [
    (2, "1f1b", 1, {}),
    (3, "gpipe", 1, {1: [0.02, 0.04]}),  # one rank deferred weight gradients: 0.03 / 0.065 of a backward
    (3, "interleaved", 2, {1: [0.1], 2: [0.2, 0.2]}),  # shares 1.54 and 2.9: their mean clipped to 0.9
])
def test_the_bubble_and_its_prediction_are_their_definitions(pp, kind, virtual, weights):
    stats = [_timings(r, pp, weights.get(r, [])) for r in range(pp)]
    step = max(s.wall_s for s in stats)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    shares = [mean(s.weight_s) / mean(s.backward_s) for s in stats if s.weight_s]
    costs = OpCosts(forward=[mean(s.forward_s) for s in stats], backward=[mean(s.backward_s) for s in stats],
                    p2p=min(min(s.recv_wait_s, default=0.0) for s in stats),
                    weight_fraction=min(0.9, mean(shares)) if shares else 0.0)
    predicted = simulate(build_schedule(kind, pp, 4, virtual), PipelineShape(pp, 4, virtual), costs, kind=kind)
    for got in run_ranks(_metrics, pp, kind, virtual, weights, timeout=60):
        assert got["pp_step_s"] == step
        assert got["pp_bubble_measured"] == pytest.approx(1 - sum(s.busy_s for s in stats) / (pp * step), rel=1e-12)
        reported = got["pp_op_costs_s"]
        assert reported["forward"] == pytest.approx(costs.forward)
        assert reported["backward"] == pytest.approx(costs.backward)
        assert reported["p2p"] == costs.p2p and reported["weight_fraction"] == pytest.approx(costs.weight_fraction)
        assert got["pp_bubble_predicted"] == pytest.approx(predicted.bubble_fraction, rel=1e-12)
        assert got["pp_step_predicted_s"] == pytest.approx(predicted.step_time, rel=1e-12)
    assert costs.p2p == (0.0 if pp == 2 else 0.005)  # a rank that waited for nothing: the shortest wait is none


def test_no_step_yet_reports_nothing():
    assert PipelineRunner.step_metrics(SimpleNamespace(last_stats=None)) == {}


@pytest.mark.parametrize("given", [3, 5])
def test_another_number_of_micro_batches_than_the_schedule_has_is_refused(given):
    runner = SimpleNamespace(microbatches=4)
    with pytest.raises(ValueError, match=f"the schedule has 4 micro-batches, the loader gave {given}"):
        PipelineRunner.forward_backward(runner, [None] * given, 1.0, None, None, None)


@pytest.mark.parametrize("coords", [{"tp": 1, "cp": 0, "dp": 0}, {"tp": 0, "cp": 1, "dp": 0},
                                    {"tp": 0, "cp": 0, "dp": 1}])
def test_only_the_pipeline_of_global_rank_0_gathers_the_weights(coords):
    state = {"w": torch.ones(2)}
    runner = SimpleNamespace(ctx=SimpleNamespace(coords={**coords, "pp": 1}))
    assert PipelineRunner.gather_full_state(runner, state) is state  # untouched, nothing sent


def _eval_sends_held(corpus, run_dir, extra):
    """The most send batches this rank holds unwaited at once during an evaluation, and its loss."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import build_trainer, small_cfg

    from meshlm.parallel.pipeline import engine

    held = [0]
    add = engine._SendsInFlight.add

    def counting_add(self, handle, keys):
        add(self, handle, keys)
        held[0] = max(held[0], len(self.batches))

    engine._SendsInFlight.add = counting_add
    loss = build_trainer(small_cfg(corpus, run_dir, 2, *extra)).evaluate()
    return held[0], loss


@pytest.mark.parametrize("kind,virtual", [("1f1b", 1), ("interleaved", 2)])
def test_an_evaluation_holds_at_most_two_send_batches_unwaited(tmp_path, kind, virtual):
    """Forward-only over 8 held-out batches a rank sends 8 activations (16 for interleaved's rank 0).
    On gloo a send is only known received when a later message from its receiver says so
    (schedules.send_receipts), and the last chunk's sends get none: beyond two batches in flight
    the oldest is waited, or every activation sent stays held to the end of the pass."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import write_offline_corpus

    corpus = write_offline_corpus(tmp_path / "corpus")
    extra = ("parallel.pp=2", f"parallel.pp_schedule={kind}", f"parallel.pp_virtual={virtual}", "model.n_layers=4",
             "train.eval_batches=8")
    results = run_ranks(_eval_sends_held, 2, corpus, tmp_path / "run", extra, timeout=120)
    assert all(held <= 2 for held, _ in results), results
    assert results[0][1] == results[1][1]
