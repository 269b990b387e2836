"""What ranks check while they train: a non-finite step skipped or stopped on every rank, the
desync fingerprint (unequal evaluation work is not a desync; only ranks of one pipeline stage are
compared), stragglers within a stage, and the OOM report with the changes that fit."""

import pytest
import torch
import torch.distributed as dist

from helpers import build_trainer, small_cfg
from meshlm.comm import Comm
from meshlm.debug.fingerprint import DesyncError, check, odd_ranks
from meshlm.debug.nonfinite import NonFiniteError
from meshlm.debug.oom import candidate_changes, is_out_of_memory, oom_report
from meshlm.debug.stragglers import StragglerDetector
from meshlm.mesh import Layout, ParallelContext
from meshlm.testing import run_ranks


# ---------------------------------------------------------------- non-finite steps

def _nan_step(corpus, run_dir, policy):
    cfg = small_cfg(corpus, run_dir, 2, "parallel.dp=2", "debug.fault=nan", "debug.fault_rank=1",
                    "debug.fault_step=2", f"train.on_nonfinite={policy}", steps=3)
    trainer = build_trainer(cfg)
    trainer.train_step()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    try:
        second = trainer.train_step()
    except NonFiniteError as e:
        return "stopped", e.ranks, str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    third = trainer.train_step()
    return second.grad_norm, unchanged, trainer.nonfinite_skipped, third.loss, second.nonfinite


def test_skip_drops_the_nonfinite_update_and_training_goes_on(corpus, tmp_path):
    for norm, unchanged, skipped, next_loss, report in run_ranks(_nan_step, 2, corpus, tmp_path, "skip"):
        assert norm != norm and unchanged and skipped == 1 and next_loss == next_loss  # nan, then finite
        assert "the loss of rank 1 is not finite" in report and "tok_embeddings.weight" in report


def test_stop_raises_on_every_rank_naming_the_rank_whose_loss_went_bad(corpus, tmp_path):
    for kind, ranks, message in run_ranks(_nan_step, 2, corpus, tmp_path, "stop"):
        assert kind == "stopped" and ranks == [1] and "at step 2" in message


# ---------------------------------------------------------------- fingerprints, stragglers, OOM

def _evaluate_then_step(corpus, run_dir):
    cfg = small_cfg(corpus, run_dir, 4, "parallel.tp=2", "parallel.dp=2", "train.eval_batches=3", steps=2)
    trainer = build_trainer(cfg)
    trainer.evaluate()  # dp rank 0 runs 2 held-out batches, rank 1 one: their tp collectives differ
    return trainer.train_step().loss


def test_unequal_evaluation_work_is_not_a_desync(corpus, tmp_path):
    losses = run_ranks(_evaluate_then_step, 4, corpus, tmp_path)
    assert len(set(losses)) == 1


def _desync_at_step_2(corpus, run_dir, layout):
    # on_nonfinite=skip: under dp the desynced all-reduce is the token count, garbage as int64,
    # which can make the step's gradient NaN before its fingerprints are compared
    trainer = build_trainer(small_cfg(corpus, run_dir, 2, layout, "debug.fault=desync", "debug.fault_rank=1",
                                      "debug.fault_step=2", "train.on_nonfinite=skip", steps=3))
    try:
        for _ in range(3):
            trainer.train_step()
    except DesyncError as e:
        return trainer.step, str(e)
    return trainer.step, None


@pytest.mark.parametrize("layout", ["parallel.pp=2", "parallel.dp=2"])
def test_a_desync_raises_at_its_step_on_every_rank(corpus, tmp_path, layout):
    """Rank 1's first all-reduce of step 2 as another dtype (same bytes: gloo completes it): the
    fingerprints of the ranks doing the same work (dp 2) or of the pipeline's collectives (pp 2)
    differ, and both ranks raise after that step, naming it."""
    for done, message in run_ranks(_desync_at_step_2, 2, corpus, tmp_path, layout):
        assert done == 1 and message is not None, message
        assert message.startswith("desync at step 2: rank"), message


def test_fingerprints_disagree_only_within_a_pipeline_stage():
    stages = Layout(dp=2, pp=2).groups(("tp", "cp", "dp"))  # [(0, 1), (2, 3)]
    assert odd_ranks([5.0, 5.0, 7.0, 7.0], stages) is None  # stages differ from each other: fine
    assert odd_ranks([5.0, 5.0, 7.0, 8.0], stages) == ((2, 3), [2, 3])  # a tie: both named
    three = Layout(dp=3).groups(("tp", "cp", "dp"))
    with pytest.raises(DesyncError) as e:
        check([1.0, 2.0, 1.0], three, step=4)
    assert e.value.ranks == [1] and "step 4" in str(e.value)


def test_traced_collectives_fingerprint_op_shape_and_dtype_and_count_blocked_time():
    def fingerprints():
        comm = Comm(ParallelContext(Layout(dp=3)))
        comm.desync_next = dist.get_rank() == 2  # same bytes, another dtype: gloo does not notice
        comm.all_reduce(torch.ones(4, dtype=torch.float64), "dp")
        comm.all_reduce(torch.ones(2), "dp")
        return comm.recorder.fingerprint, comm.recorder.blocked_s > 0

    (a, blocked0), (b, _), (c, _) = run_ranks(fingerprints, 3)
    assert a == b != c and blocked0


def test_a_rank_slower_for_three_steps_is_named_once():
    warnings = []
    detector = StragglerDetector(0.2, patience=3, warn=warnings.append)
    fields = [detector.observe(s, [0.10, 0.30, 0.11]) for s in range(1, 6)]
    assert fields[0] == {"slowest_rank": 1, "slowest_rank_s": 0.30, "fastest_rank": 0, "fastest_rank_s": 0.10}
    assert len(warnings) == 1 and "rank 1" in warnings[0] and "step 3" in warnings[0]
    quiet = StragglerDetector(0.2, patience=3, warn=warnings.append)
    for s in range(5):  # 15% slower, or slow but not three steps in a row: no warning
        quiet.observe(s, [0.10, 0.115, 0.10])
        quiet.observe(s, [0.10, 0.30 if s % 2 else 0.10, 0.10])
    assert len(warnings) == 1
    pair = StragglerDetector(0.5, patience=3, warn=warnings.append)
    for s in range(3):  # twice the other rank's time: a straggler against the others, not the mean
        pair.observe(s, [0.10, 0.20])
    assert len(warnings) == 2 and "rank 1" in warnings[1]


def test_a_straggler_is_slower_than_the_ranks_doing_its_work_not_than_other_stages():
    """dp2 x pp2: the last stage (head and loss) works twice as long as the first by design. Only a
    rank slower than its own stage's other ranks is named; a stage of one rank is compared with none."""
    warnings = []
    stages = [[0, 1], [2, 3]]
    by_design = StragglerDetector(0.2, patience=3, warn=warnings.append)
    for s in range(5):
        fields = by_design.observe(s, [0.10, 0.10, 0.20, 0.21], stages)
    assert warnings == [] and fields["slowest_rank"] == 3  # the row still names the slowest of all
    slow = StragglerDetector(0.2, patience=3, warn=warnings.append)
    for s in range(3):
        slow.observe(s, [0.10, 0.10, 0.20, 0.30], stages)
    assert len(warnings) == 1 and "rank 3 worked 50% longer" in warnings[0]
    alone = StragglerDetector(0.2, patience=3, warn=warnings.append)
    for s in range(5):  # pp2 alone
        alone.observe(s, [0.10, 0.30], [[0], [1]])
    assert len(warnings) == 1


def test_oom_report_names_rank_phase_categories_and_changes_that_fit(corpus, tmp_path):
    cfg = small_cfg(corpus, tmp_path, 2, "parallel.dp=2", "train.micro_batch_size=4")
    assert [c for c, _ in candidate_changes(cfg)][:3] == ["parallel.zero=1", "train.recompute=full",
                                                         "train.micro_batch_size=2"]
    lines = oom_report(cfg, 1, 7, "backward", None, torch.device("cpu"))
    assert lines[0].startswith("out of memory on rank 1 in the backward of step 7")
    assert {"params", "grads", "optimizer", "activations", "peak"} <= {line.split()[0] for line in lines[1:-1]}
    # this tiny model's predicted peak fits the host: the advice looks elsewhere (test_debug_verdicts.py)
    assert lines[-1].startswith("  the predicted peak (")
    # a pipeline: each rank's report holds its own stage's prediction (the stages differ: the
    # first holds the embedding, the last the head and its logits)
    from meshlm.analysis.memory import predict
    from meshlm.train.metrics import format_bytes

    piped = small_cfg(corpus, tmp_path, 4, "parallel.pp=4", "model.n_layers=4", "model.vocab_size=4096")
    stages = predict(piped, backend="shm").ranks
    for rank in range(4):
        params = next(line for line in oom_report(piped, rank, 1, "forward", None, torch.device("cpu"))
                      if line.split()[0] == "params")
        assert params.split()[-2:] == format_bytes(stages[rank].params_bytes).split(), rank
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ..."))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
