"""The trainer against a plain PyTorch loop (accumulation, data parallelism, the global token
normalisation, with uneven target counts), and against itself for activation checkpointing,
bf16 and evaluation; the save after a stop signal."""

import pytest
import torch

from meshlm.testing import run_ranks

from helpers import GLOBAL_BATCH, UnevenlyMaskedLoader, build_trainer, plain_pytorch_reference, small_cfg, target_counts


def make_cfg(corpus, run_dir, world_size=1, *extra):
    return small_cfg(corpus, run_dir, world_size, *extra, steps=4)


def grads_then_steps(cfg, n_steps=3, loader_cls=None):
    """(gradients of step 0, losses of n_steps, parameters after them)."""
    torch.manual_seed(123)  # must not matter: init and data depend only on run.seed
    trainer = build_trainer(cfg, loader_cls)
    trainer.forward_backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.dp.zero_grad()
    losses = [trainer.train_step().loss for _ in range(n_steps)]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return grads, losses, params


def assert_close(ref, got, grad_tol=1e-6, param_tol=1e-5):
    (g0, l0, p0), (g1, l1, p1) = ref, got
    for name in g0:
        assert (g0[name] - g1[name]).abs().max() <= grad_tol, name
    assert l0 == pytest.approx(l1, abs=1e-5)
    for name in p0:
        assert (p0[name] - p1[name]).abs().max() <= param_tol, name


@pytest.fixture(scope="module")
def plain_loop(corpus, tmp_path_factory):
    """torch alone on the whole global batch, every micro-batch and rank with its own target count."""
    cfg = make_cfg(corpus, tmp_path_factory.mktemp("plain"), 1)
    counts = target_counts(cfg, UnevenlyMaskedLoader, 2)
    assert len({c for rank in counts for c in rank}) == 4 and sum(counts[0]) != sum(counts[1]), counts
    return plain_pytorch_reference(cfg, UnevenlyMaskedLoader, n_steps=3)


@pytest.mark.parametrize("micro", [2, GLOBAL_BATCH])
def test_accumulation_equals_a_plain_pytorch_loop(corpus, tmp_path, plain_loop, micro):
    """4 micro-batches of different target counts accumulate to the global mean's gradient."""
    cfg = make_cfg(corpus, tmp_path, 1, f"train.micro_batch_size={micro}")
    assert_close(plain_loop, grads_then_steps(cfg, loader_cls=UnevenlyMaskedLoader))
    assert plain_loop[1][-1] < plain_loop[1][0]  # and it learns


def test_grad_clip_zero_is_clipping_off_in_the_trainer_and_its_reference(corpus, tmp_path):
    cfg = make_cfg(corpus, tmp_path, 1, "train.grad_clip=0")
    reference = plain_pytorch_reference(cfg, UnevenlyMaskedLoader, n_steps=3)
    assert reference[1][-1] < reference[1][0]  # it trains: no gradient was zeroed
    assert_close(reference, grads_then_steps(cfg, loader_cls=UnevenlyMaskedLoader))


def _dp_rank(corpus, run_dir, world_size, loader_cls=None):
    return grads_then_steps(make_cfg(corpus, run_dir, world_size), loader_cls=loader_cls)


@pytest.mark.parametrize("world_size", [2, 4])
def test_data_parallel_equals_a_plain_pytorch_loop(corpus, tmp_path, plain_loop, world_size):
    """Ranks with different target counts (and, at 2, accumulation within each): the loss is
    normalised by the global count, not each rank's or micro-batch's own."""
    results = run_ranks(_dp_rank, world_size, corpus, tmp_path / "dp", world_size, UnevenlyMaskedLoader, timeout=120)
    for rank_result in results:
        assert_close(plain_loop, rank_result)


def _reductions_in_flight_when_backward_ends(corpus, run_dir):
    trainer = build_trainer(make_cfg(corpus, run_dir, 2))  # 2 micro-batches a rank
    in_flight, finish = [], trainer.dp.finish_backward

    def recorded():
        in_flight.append(len(trainer.dp._pending))
        finish()

    trainer.dp.finish_backward = recorded
    trainer.train_step()
    return in_flight, trainer.dp.unused_parameters


def test_the_last_micro_batch_reduces_its_gradients_during_its_backward(corpus, tmp_path):
    """A rank's micro-batches but the last accumulate under no_sync; the last one's backward
    launches DDP's bucket all-reduces as their gradients become ready (overlapped with the rest of
    backward), so none is left for finish_backward to launch and no parameter is called unused."""
    for in_flight, unused in run_ranks(_reductions_in_flight_when_backward_ends, 2, corpus, tmp_path):
        assert in_flight[0] > 0 and unused == []


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_gradients(corpus, tmp_path, mode):
    reference = grads_then_steps(make_cfg(corpus, tmp_path / "a", 1), n_steps=1)
    recomputed = grads_then_steps(make_cfg(corpus, tmp_path / "b", 1, f"train.recompute={mode}"), n_steps=1)
    assert_close(reference, recomputed)


@pytest.mark.parametrize("mode", ["block", "partial", "sequential"])  # sorting before "full", around "selective"
def test_an_unknown_recompute_mode_is_refused_by_name(mode):
    from helpers import debug_model
    from meshlm.parallel.recompute import apply_activation_checkpointing

    with pytest.raises(ValueError, match=f"unknown recompute mode '{mode}'"):
        apply_activation_checkpointing(debug_model(), mode)


def test_bf16_autocast_trains_close_to_fp32(corpus, tmp_path):
    _, fp32_losses, _ = grads_then_steps(make_cfg(corpus, tmp_path / "a", 1), n_steps=3)
    _, bf16_losses, params = grads_then_steps(make_cfg(corpus, tmp_path / "b", 1, "train.dtype=bfloat16"), n_steps=3)
    assert all(p.dtype == torch.float32 for p in params.values())  # fp32 master weights
    assert bf16_losses == pytest.approx(fp32_losses, abs=0.05)
    assert bf16_losses != fp32_losses  # autocast really ran in bf16


@pytest.mark.parametrize("world,extra", [(2, ("parallel.zero=3",)), (3, ("parallel.zero=3", "train.global_batch_size=6")),
                                         (4, ("parallel.zero=3", "parallel.pp=2", "parallel.dp=2"))],
                         ids=["zero3-dp2", "zero3-dp3", "zero3-dp2-pp2"])
def test_held_out_batches_that_dp_does_not_divide_evaluate_without_a_hang(corpus, tmp_path, world, extra):
    """5 global batches of held-out windows over 2 or 3 dp ranks under ZeRO-3, which gathers every
    unit over dp in each forward: every rank runs as many forwards, and the loss is one process's
    (with the same global batch: it sets the number of windows). The micro-batch count is now a
    multiple of dp by construction; eval_share's padding for other counts is tested in test_data."""
    same_batch = [e for e in extra if e.startswith("train.")]
    single = build_trainer(make_cfg(corpus, tmp_path / "a", 1, "train.eval_batches=5", *same_batch)).evaluate()
    cfg = make_cfg(corpus, tmp_path / "b", world, "train.eval_batches=5", *extra)
    assert run_ranks(lambda: build_trainer(cfg).evaluate(), world, timeout=120) == pytest.approx([single] * world,
                                                                                                  abs=1e-6)


def test_eval_loss_is_the_same_for_every_micro_batch_size(corpus, tmp_path):
    """The held-out windows are train.eval_batches global batches whatever the micro-batch split
    (they were micro_batch_size x eval_batches: mbs 8 measured 4x the windows of mbs 2)."""
    losses, windows = [], []
    for mbs in (2, 4, 8):  # the same initial weights (one seed), GLOBAL_BATCH = 8
        trainer = build_trainer(make_cfg(corpus, tmp_path / f"mbs{mbs}", 1, f"train.micro_batch_size={mbs}"))
        windows.append(torch.cat([x for x, _ in trainer.eval_set]))
        losses.append(trainer.evaluate())
    assert all(torch.equal(w, windows[0]) for w in windows)
    assert losses == pytest.approx([losses[0]] * 3, rel=1e-6)
    assert trainer.eval_losses().keys() == {"eval_loss"}  # one corpus: no per-corpus loss beside it


def test_eval_loss_is_the_same_for_every_dp_layout(corpus, tmp_path):
    single = build_trainer(make_cfg(corpus, tmp_path / "a", 1)).evaluate()
    ranks = run_ranks(lambda: build_trainer(make_cfg(corpus, tmp_path / "b", 2)).evaluate(), 2)
    assert ranks == pytest.approx([single, single], abs=1e-6)


class _SecondStepAllIgnored(UnevenlyMaskedLoader):
    """Step 1's global batch has no target token (every target IGNORE_INDEX), as a masked loader
    (instruction tuning, packed prompts) can give."""

    def _rows(self, step, start, count):
        inputs, targets = super()._rows(step, start, count)
        return (inputs, torch.full_like(targets, -100)) if step == 1 else (inputs, targets)


def _empty_step_rank(corpus, run_dir, world_size, extra):
    trainer = build_trainer(make_cfg(corpus, run_dir, world_size, *extra), _SecondStepAllIgnored)
    results, params = [], []
    for _ in range(3):
        results.append(trainer.train_step())
        params.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    adam_steps = {int(state["step"]) for state in trainer.dp.optim.optimizer.state.values()}
    return [(r.loss, r.grad_norm, r.target_tokens) for r in results], params, adam_steps, trainer.empty_skipped


@pytest.mark.parametrize("world_size,extra", [(1, ()), (2, ("parallel.dp=2", "parallel.zero=1")),
                                              (2, ("parallel.pp=2",))])
def test_a_step_without_target_tokens_changes_nothing_and_the_run_goes_on(corpus, tmp_path, world_size, extra):
    """No target token anywhere in the global batch: the loss is 0/0, and zero gradients would still
    move the weights through AdamW's momentum and decay. No rank runs a forward, no update is
    applied (AdamW counts two steps of three), the loss is reported NaN, and the next step trains."""
    args = (corpus, tmp_path, world_size, extra)
    for rows, params, adam_steps, skipped in (run_ranks(_empty_step_rank, world_size, *args, timeout=120)
                                              if world_size > 1 else [_empty_step_rank(*args)]):
        (loss0, _, tokens0), (loss1, norm1, tokens1), (loss2, _, tokens2) = rows
        assert tokens0 > 0 and tokens2 > 0 and loss0 > 0 and loss2 > 0
        assert tokens1 == 0 and loss1 != loss1 and norm1 == 0.0 and skipped == 1
        assert all(torch.equal(params[0][n], params[1][n]) for n in params[0])
        assert any(not torch.equal(params[1][n], params[2][n]) for n in params[1])
        assert adam_steps in ({2}, set())  # set(): a pipeline stage's optimizer may hold no parameter


def _graph_left_after_steps(world, extra, corpus, run_dir):
    """Tensors still carrying an autograd graph once two training steps have ended, and the live
    bytes after each step (the tracker's)."""
    import gc

    def with_graph():
        gc.collect()
        return {id(t): t for t in gc.get_objects() if issubclass(type(t), torch.Tensor) and t.grad_fn is not None}

    before = with_graph()  # the test process's own (earlier tests', inherited by forked ranks)
    trainer = build_trainer(small_cfg(corpus, run_dir, world, "train.track_memory=true", *extra))
    live = []
    for _ in range(2):
        trainer.train_step()
        live.append(trainer.memory._cpu_tracker.live)
    left = [tuple(t.shape) for key, t in with_graph().items() if key not in before]
    return left, live


@pytest.mark.parametrize("world,extra", [
    # full recompute stops the rebuild early (torch.utils.checkpoint raises inside the block's
    # forward): SP's region kept its input, and through it the whole rebuilt block, to the next step
    (2, ("parallel.tp=2", "parallel.sp=true", "train.recompute=full")),
    (2, ("parallel.tp=2", "parallel.sp=true", "train.recompute=selective")),
    (2, ("parallel.pp=2", "train.recompute=full")),
    (2, ("parallel.zero=3", "train.recompute=full")),
    (1, ("train.recompute=full",)),
], ids=["tp-sp-full", "tp-sp-selective", "pp-full", "zero3-full", "one-full"])
def test_a_training_step_leaves_no_autograd_graph_alive(corpus, tmp_path, world, extra):
    """Whatever a step builds for backward is gone when it ends: nothing of it lives into the next
    step's forward, where it would add to that step's peak."""
    if world == 1:
        results = [_graph_left_after_steps(1, extra, corpus, tmp_path)]
    else:
        results = run_ranks(_graph_left_after_steps, world, world, extra, corpus, tmp_path)
    for left, live in results:
        assert not left, left
        assert live[0] == live[1]


def test_a_save_after_a_stop_signal_is_not_cut_short_by_the_stop_deadline(corpus, tmp_path, monkeypatch):
    """checkpoint.stop_timeout_s bounds the wait for a step boundary after SIGTERM. Its timer ran
    on through the save after the boundary: a save longer than it was killed half-written, saying
    'no step boundary within N s'. Here the save takes twice the deadline (the exit is recorded,
    not made)."""
    import os
    import signal
    import time

    from meshlm.train.preemption import StopSignals
    from meshlm.train.trainer import Trainer

    gave_up = []
    monkeypatch.setattr(StopSignals, "_give_up", lambda self: gave_up.append(time.monotonic()))
    real_fb, real_save = Trainer.forward_backward, Trainer.save_checkpoint

    def forward_backward(self, *args, **kwargs):  # SIGTERM late in step 1: its boundary comes at once
        result = real_fb(self, *args, **kwargs)
        if self.step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)
    monkeypatch.setattr(Trainer, "save_checkpoint", lambda self, **kw: time.sleep(3.0) or real_save(self, **kw))
    trainer = build_trainer(make_cfg(corpus, tmp_path, 1, "checkpoint.stop_timeout_s=1.5"))
    with StopSignals(trainer.cfg.checkpoint.stop_timeout_s) as signals:
        trainer.stop_signals = signals
        rows = trainer.fit()
    assert [r["step"] for r in rows] == [1] and trainer.stopped_by == "SIGTERM"
    assert gave_up == [] and trainer.last_checkpoint.path.name == "step_0000001"


def test_a_signal_during_a_periodic_save_lets_it_finish_then_stops_at_the_next_boundary(corpus, tmp_path, monkeypatch):
    """A preemption's SIGTERM that lands in a periodic save (after step 1's boundary) started the
    stop deadline there: a save longer than it was killed half-written on every rank, which said
    'no step boundary within N s' and exited 1, losing that checkpoint and the stop's. The
    deadline now starts when the save ends: the save finishes, step 2 runs, and the run stops
    after it with its checkpoint. The save takes three times the deadline (the exit is recorded,
    not made)."""
    import os
    import signal
    import time

    import meshlm.train.checkpoint as checkpoint
    from meshlm.train.preemption import StopSignals

    gave_up = []
    monkeypatch.setattr(StopSignals, "_give_up", lambda self: gave_up.append(self.received))
    real_save = checkpoint.save_checkpoint

    def slow_save(trainer, *args, **kwargs):
        if trainer.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.5)
        return real_save(trainer, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", slow_save)
    trainer = build_trainer(make_cfg(corpus, tmp_path, 1, "checkpoint.interval=1", "checkpoint.stop_timeout_s=0.5"))
    with StopSignals(trainer.cfg.checkpoint.stop_timeout_s) as signals:
        trainer.stop_signals = signals
        rows = trainer.fit()
    assert gave_up == []
    assert [r["step"] for r in rows] == [1, 2] and trainer.stopped_by == "SIGTERM"
    assert trainer.last_checkpoint.path.name == "step_0000002"


def test_a_signal_after_steps_without_one_still_starts_the_stop_deadline(corpus, tmp_path, monkeypatch):
    """A SIGTERM in step 3 whose boundary then comes three times checkpoint.stop_timeout_s late (a
    rank stuck in a collective with a dead peer): the deadline fires (recorded, not made). The
    steps before it ended without a stop and must not have told the signals that the boundary was
    reached: that disarms the deadline for the rest of the run."""
    import os
    import signal
    import time

    from meshlm.train.preemption import StopSignals
    from meshlm.train.trainer import Trainer

    gave_up = []
    monkeypatch.setattr(StopSignals, "_give_up", lambda self: gave_up.append(self.received))
    real_fb = Trainer.forward_backward

    def forward_backward(self, *args, **kwargs):
        result = real_fb(self, *args, **kwargs)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.5)
        return result

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)
    trainer = build_trainer(make_cfg(corpus, tmp_path, 1, "checkpoint.stop_timeout_s=0.5"))
    with StopSignals(trainer.cfg.checkpoint.stop_timeout_s) as signals:
        trainer.stop_signals = signals
        rows = trainer.fit()
    assert gave_up == [signal.SIGTERM]
    assert [r["step"] for r in rows] == [1, 2, 3] and trainer.stopped_by == "SIGTERM"


def test_checkpoints_come_every_interval_and_after_the_last_step(corpus, tmp_path):
    rows = build_trainer(make_cfg(corpus, tmp_path, 1, "checkpoint.interval=3")).fit()  # 4 steps
    assert [r["step"] for r in rows if "checkpoint_s" in r] == [3, 4]


def test_async_saves_write_in_the_background_but_the_last_one(corpus, tmp_path):
    """checkpoint.async_save: every save but the run's last returns while its files are written;
    the last is in the foreground, the run ending with it."""
    trainer = build_trainer(make_cfg(corpus, tmp_path, 1, "checkpoint.interval=1", "checkpoint.async_save=true"))
    background, save = [], trainer.save_checkpoint

    def recorded(**kwargs):
        background.append(kwargs["background"])
        return save(**kwargs)

    trainer.save_checkpoint = recorded
    trainer.fit()
    assert background == [True, True, True, False]


def test_a_rows_throughput_is_its_tokens_over_its_time(corpus, tmp_path):
    from meshlm.analysis.flops import mfu

    trainer = build_trainer(make_cfg(corpus, tmp_path, 1, "checkpoint.interval=0", "train.peak_tflops=2"))
    for row in trainer.fit():
        assert row["tokens"] == GLOBAL_BATCH * 32 and row["tokens_per_s"] == row["tokens"] / row["step_time_s"]
        assert row["tflops"] == pytest.approx(trainer.flops_per_token * row["tokens_per_s"] / 1e12, rel=1e-12)
        assert row["mfu"] == pytest.approx(mfu(row["tokens_per_s"], trainer.flops_per_token, 2, 1), rel=1e-12)


def _fit_with_a_slow_rank(corpus, run_dir):
    """fit()'s rows, each step's wall time around train_step, and the blocked time each step
    passed to the all-gather of the rank fields."""
    import time

    cfg = make_cfg(corpus, run_dir, 2, "debug.fault=slow", "debug.fault_rank=1", "debug.fault_slow_s=0.3",
                   "checkpoint.interval=0")
    trainer = build_trainer(cfg)
    walls, blocked = [], []
    step, gather = trainer.train_step, trainer._gather_over_ranks

    def timed_step():
        t0 = time.perf_counter()
        result = step()
        walls.append(time.perf_counter() - t0)
        return result

    def recorded_gather(peak, stop, busy_s, blocked_s):
        blocked.append(blocked_s)
        return gather(peak, stop, busy_s, blocked_s)

    trainer.train_step, trainer._gather_over_ranks = timed_step, recorded_gather
    return trainer.fit(), walls, blocked


def test_every_step_names_the_slow_rank_and_the_communication_it_exposes(corpus, tmp_path):
    """Rank 1 sleeps 0.3 s at the start of every step (debug.fault=slow): it is the slowest, working
    that much longer than rank 0, which waits for it in the step's first collective. That wait is
    exposed communication, the ranks' mean, and its share is of the step's time, which is within
    the wall time of the step."""
    (rows, walls, blocked0), (rows1, _, blocked1) = run_ranks(_fit_with_a_slow_rank, 2, corpus, tmp_path, timeout=120)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row, wall, b0, b1 in zip(rows, walls, blocked0, blocked1):
        assert row["slowest_rank"] == 1 and row["fastest_rank"] == 0, row
        assert 0 < row["fastest_rank_s"] < row["slowest_rank_s"] - 0.15, row
        assert row["slowest_rank_s"] < 2 * row["step_time_s"], row  # a time within the step
        assert 0 < row["step_time_s"] <= wall, (row, wall)
        assert row["comm_exposed_s"] == pytest.approx((b0 + b1) / 2) and b0 > 0.1, row
        assert row["comm_exposed_share"] == pytest.approx(row["comm_exposed_s"] / row["step_time_s"])
    assert [r["comm_exposed_s"] for r in rows1] == [r["comm_exposed_s"] for r in rows]  # every rank's row alike
