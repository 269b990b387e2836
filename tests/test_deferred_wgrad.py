"""Deferred weight gradients (the B/W split): against the plain backward of the same model, with
and without autocast and recomputation; DP hooks fire; unarmed layers take the plain path; and the
pipeline engine posts a stage's input gradient before it computes the deferred weight gradients."""

import pytest
import torch
from torch import nn

from meshlm.parallel.pipeline.deferred_wgrad import DeferredWeightGradLinear, WeightGradStore, defer_weight_grads
from meshlm.testing import run_ranks
from tests.helpers import debug_model, pp2_engine, pp2_microbatches


def _grads(model, tokens, store=None, autocast=False, arm=True):
    model.zero_grad(set_to_none=True)
    def armed():
        return store.armed_for(arm) if store is not None else torch.enable_grad()

    with armed(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    with armed():  # recomputation runs inside backward and must take the same path
        loss.backward()
    owed = len(store) if store is not None else 0
    if store is not None:
        store.flush()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, owed


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("autocast", [False, True])
def test_deferred_weight_gradients_equal_the_plain_backward(recompute, autocast):
    tokens = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    plain, deferred = debug_model(recompute=recompute), debug_model(recompute=recompute)
    store = WeightGradStore()
    switched = defer_weight_grads(deferred, store)
    assert switched == 2 * 7 + 1  # per layer q k v o + gate up down, and the head
    assert deferred.state_dict().keys() == plain.state_dict().keys()
    want, _ = _grads(plain, tokens, autocast=autocast)
    got, owed = _grads(deferred, tokens, store, autocast=autocast)
    assert owed == switched  # every linear's weight gradient waited for the flush
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] - want[name]).abs().max() <= 1e-6, name


def test_flush_accumulates_through_autograd_so_post_accumulate_hooks_fire_once_per_weight():
    layer = nn.Linear(8, 4, bias=False)
    store = WeightGradStore()
    defer_weight_grads(layer, store)
    fired = []
    layer.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    x = torch.randn(3, 8, requires_grad=True)
    with store.armed_for():
        y = layer(x) + layer(2 * x)  # the weight is used twice: one gradient, one hook call
    y.sum().backward()
    assert layer.weight.grad is None and fired == [] and len(store) == 2
    store.flush()
    assert len(fired) == 1 and len(store) == 0
    expected = torch.ones(3, 4).t() @ (3 * x)
    assert torch.allclose(layer.weight.grad, expected.detach(), atol=1e-6)
    store.flush()  # nothing owed: a no-op
    assert len(fired) == 1


def test_flush_holds_one_weight_gradient_at_a_time():
    """A flush makes each weight's gradient, accumulates it and drops it before the next: its
    peak above the gradients already kept is the largest weight's gradient, not their sum (which
    doubled a pipeline stage's gradient memory at the flush)."""
    from meshlm.train.memtrack import LiveTensorBytes

    layers = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(6)))
    store = WeightGradStore()
    defer_weight_grads(layers, store)
    x = torch.randn(32, 64, requires_grad=True)
    with store.armed_for():
        layers(x).sum().backward()
    for layer in layers:  # the gradients' storage exists already, as in every step after the first
        layer.weight.grad = torch.zeros_like(layer.weight)
    tracker = LiveTensorBytes()
    tracker.track(layer.weight.grad for layer in layers)
    tracker.reset_peak()
    with tracker:
        store.flush()
    weight_bytes = 64 * 64 * 4
    assert weight_bytes <= tracker.peak - tracker.live <= 2 * weight_bytes, (tracker.peak, tracker.live)


def test_unarmed_and_no_grad_forwards_take_the_plain_path():
    layer = nn.Linear(8, 4, bias=False)
    store = WeightGradStore()
    defer_weight_grads(layer, store)
    assert type(layer) is DeferredWeightGradLinear
    layer(torch.randn(2, 8)).sum().backward()  # not armed: the weight gets its gradient at once
    assert layer.weight.grad is not None and len(store) == 0
    with store.armed_for(), torch.no_grad():
        layer(torch.randn(2, 8, requires_grad=True))
    layer.weight.grad = None
    with store.armed_for():  # an input without gradient: the function would fall out of the graph
        layer(torch.randn(2, 8)).sum().backward()
    assert layer.weight.grad is not None and len(store) == 0
    # Subclasses (tensor-parallel layers) and biased layers keep their own backward.
    class Custom(nn.Linear):
        pass
    assert defer_weight_grads(nn.Sequential(Custom(2, 2, bias=False), nn.Linear(2, 2)), store) == 0


def _engine_order():
    """Rank 1 (last stage) of a pp=2 1F1B run: the order of P2P posts and weight-gradient flushes."""
    import torch.distributed as dist

    from meshlm.model.loss import token_loss_sum
    from meshlm.parallel.pipeline.schedules import build_schedule

    engine, _ = pp2_engine(defer=True)
    events = []
    post = engine.p2p.post
    engine.p2p.post = lambda ops: events.append(("post", [kind for kind, _, _ in ops])) or post(ops)
    if engine.weight_grads is not None:  # stage 0 has none: nothing of it defers
        flush = engine.weight_grads.flush
        engine.weight_grads.flush = lambda: events.append(("flush", len(engine.weight_grads))) or flush()
    stats = engine.run(build_schedule("1f1b", 2, 4, 1)[dist.get_rank()], pp2_microbatches(4), loss_fn=token_loss_sum)
    dist.barrier()
    return events, len(stats.backward_s)


def test_the_engine_sends_the_input_gradient_before_computing_the_deferred_weight_gradients():
    (first, _), (last, n_backward) = run_ranks(_engine_order, 2, timeout=60)
    assert not [e for e in first if e[0] == "flush"]  # stage 0 sends no gradient: no store, no flush
    flushes = [i for i, e in enumerate(last) if e[0] == "flush"]
    assert len(flushes) == 1 and last[flushes[0]][1] == 7 + 1  # the last backward's: its layer's 7 and the head
    sends_before = [e for e in last[:flushes[0]] if e[0] == "post" and "send" in e[1]]
    assert len(sends_before) == 4  # all four micro-batches' gradients, the last one included
    assert n_backward == 4  # the flush counts toward its backward, not as a fifth one
