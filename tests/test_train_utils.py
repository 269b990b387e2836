"""Learning-rate schedule, LR scaling rules and the CPU live-tensor memory tracker."""

import math

import pytest
import torch

from meshlm.config import TrainConfig
from meshlm.train.memtrack import LiveTensorBytes, PeakMemory
from meshlm.train.optim import lr_at, scale_lr


def test_warmup_is_linear_then_cosine_reaches_the_floor():
    """Updates 0..109 of a 110-step run: the last warmup update alone at the peak, the run's last
    update (109) at the floor."""
    cfg = TrainConfig(steps=110, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 100))) and lr_at(10, cfg) < 1.0
    assert lr_at(59, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert lr_at(109, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) > lr_at(s + 1, cfg) for s in range(9, 109))


@pytest.mark.parametrize("decay, remaining", [("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
                                              ("linear", lambda p: 1 - p), ("sqrt", lambda p: 1 - math.sqrt(p))])
def test_warmup_stable_decay_holds_the_peak_then_decays_over_its_fraction(decay, remaining):
    """decay_fraction 0.2 of the 100 post-warmup updates: 10..89 at the peak, the decay over the last
    20 (90..109) in the chosen shape, the run's last update at the floor. Written from the formulas
    (Megatron-LM's WSD, torchtitan's decay_ratio), not from the code."""
    cfg = TrainConfig(steps=110, lr=1.0, warmup_steps=10, min_lr_ratio=0.1, lr_decay=decay, decay_fraction=0.2)
    assert [lr_at(s, cfg) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert [lr_at(s, cfg) for s in range(10, 90)] == [1.0] * 80
    assert [lr_at(s, cfg) for s in range(90, 110)] == pytest.approx(
        [0.1 + 0.9 * remaining((s + 1 - 90) / 20) for s in range(90, 110)])
    assert lr_at(109, cfg) == pytest.approx(0.1) and lr_at(89, cfg) > lr_at(90, cfg)
    # the whole post-warmup span (the default fraction): the shape from the first update after warmup
    whole = TrainConfig(steps=110, lr=1.0, warmup_steps=10, min_lr_ratio=0.1, lr_decay=decay)
    assert [lr_at(s, whole) for s in range(10, 110)] == pytest.approx(
        [0.1 + 0.9 * remaining((s + 1 - 10) / 100) for s in range(10, 110)])


@pytest.mark.parametrize("decay", ["cosine", "linear", "sqrt"])
@pytest.mark.parametrize("fraction", [0.01, 0.05])
def test_a_decay_shorter_than_one_update_is_the_last_update_alone(decay, fraction):
    """decay_fraction times the 20 post-warmup updates rounds to 0 (0.01) or 1 (0.05) updates:
    the decay is then the run's last update alone, at the floor; every update after warmup
    before it holds the peak (the range allows any fraction above 0)."""
    cfg = TrainConfig(steps=24, lr=1.0, warmup_steps=4, min_lr_ratio=0.1, lr_decay=decay, decay_fraction=fraction)
    assert [lr_at(s, cfg) for s in range(24)] == pytest.approx([0.25, 0.5, 0.75, 1.0] + [1.0] * 19 + [0.1])


@pytest.mark.parametrize("decay", ["cosine", "linear", "sqrt"])
def test_past_the_last_update_the_rate_holds_at_the_floor(decay):
    """lr_at(steps) is the rate a finished run's last checkpoint records as its next (state.py's
    next_lr); a schedule's shape continued past progress 1 would climb back (cosine) or fall
    below the floor (linear, sqrt)."""
    cfg = TrainConfig(steps=30, lr=1.0, warmup_steps=5, min_lr_ratio=0.1, lr_decay=decay)
    assert [lr_at(s, cfg) for s in range(29, 34)] == pytest.approx([0.1] * 5, rel=1e-12)


def test_lr_scaling_rules():
    assert scale_lr(1e-3, 256, 1024, "linear") == pytest.approx(4e-3)
    assert scale_lr(1e-3, 256, 1024, "sqrt") == pytest.approx(2e-3)
    # ratios that are not whole numbers, up and down
    assert scale_lr(1e-3, 256, 384, "linear") == pytest.approx(1.5e-3)
    assert scale_lr(1e-3, 256, 384, "sqrt") == pytest.approx(1e-3 * math.sqrt(1.5))
    assert scale_lr(1e-3, 1024, 256, "linear") == pytest.approx(2.5e-4)
    assert scale_lr(1e-3, 1024, 256, "sqrt") == pytest.approx(5e-4)
    for rule in ("cubic", "square", "sqrt2", "zzz", "Linear", ""):  # names on both sides of the known ones
        with pytest.raises(ValueError, match=f"unknown LR scaling rule {rule!r} \\(linear or sqrt\\)"):
            scale_lr(1e-3, 1, 2, rule)


def test_live_tensor_bytes_counts_allocations_views_and_frees():
    tracker = LiveTensorBytes()
    with tracker:
        a = torch.zeros(1000)                     # 4000 B
        b = torch.ones(500, dtype=torch.float64)  # 4000 B
        view = a[:10]                             # shares a's storage: no new bytes
        del a                                     # still alive through `view`
        c = torch.empty(250)                      # 1000 B
    assert tracker.peak == 9000
    assert tracker.live == 9000
    del view
    assert tracker.live == 5000
    del b, c


def test_peak_memory_of_a_step_includes_state_and_transients():
    meter = PeakMemory(torch.device("cpu"))
    weight = torch.zeros(256, 256)       # 262144 B of "state"
    with meter.step([weight]):
        tmp = torch.ones(128, 256)       # 131072 B transient
        del tmp
        tmp2 = torch.ones(64, 256)       # 65536 B, after tmp was freed
        del tmp2
    assert meter.last_peak == 262144 + 131072


def test_the_console_shows_the_first_every_interval_th_evaluated_and_last_step(tmp_path):
    """The last step's loss is the run's result: shown even where log_interval does not divide
    the step count (`train.steps=3 train.log_interval=2` printed step 1 only; nothing of the end)."""
    import io

    from meshlm.train.metrics import MetricsWriter

    stream = io.StringIO()
    writer = MetricsWriter(tmp_path, total_steps=7, log_interval=3, active=True, stream=stream)
    for step in range(1, 8):
        writer.log_step({"step": step, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0,
                         "step_time_s": 1.0, "tflops": 1.0, **({"eval_loss": 2.0} if step == 5 else {})})
    shown = [int(line.split()[1]) for line in stream.getvalue().splitlines()]
    assert shown == [1, 3, 5, 6, 7]


def test_a_rank_whose_world_differs_from_the_config_exits_2_in_one_line(tmp_path, monkeypatch, capsys):
    """Nodes launched with different --nproc: torchrun's world is not the one the launcher resolved
    the config for. The rank says so in one line and exits 2 before any process group (it was a
    traceback outside the rank's error handling: exit 1, and no reason shown anywhere)."""
    from meshlm.train import worker

    config = tmp_path / "config.toml"
    config.write_text("[parallel]\ndp = 2\n")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    import meshlm.train.preemption as preemption

    monkeypatch.setattr(preemption, "die_with_parent", lambda: None)
    assert worker.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("meshlm: error: ") and "world size 3" in err and "--nproc" in err
