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


def test_lr_scaling_rules():
    assert scale_lr(1e-3, 256, 1024, "linear") == pytest.approx(4e-3)
    assert scale_lr(1e-3, 256, 1024, "sqrt") == pytest.approx(2e-3)
    with pytest.raises(ValueError):
        scale_lr(1e-3, 1, 2, "cubic")


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
