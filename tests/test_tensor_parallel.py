"""Tensor and sequence parallelism against the single-process model, against PyTorch's DTensor TP,
and against their own cost formulas (communication bytes, saved activation bytes)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from meshlm.comm import Comm
from meshlm.config import ConfigError, load_config, resolve
from meshlm.mesh import Layout, ParallelContext
from meshlm.model import Llama, init_weights
from meshlm.parallel.tensor import (TP_PLAN, _matches, activation_bytes_per_layer, apply_tensor_parallel, comm_per_microbatch,
                                    layer_comm_sent)
from meshlm.testing import run_ranks

BATCH, SEQ = 2, 16


def model_cfg(*extra):
    # GQA (8 query heads, 4 kv heads) so that kv heads are split too; tp=4 gets 2 heads, 1 kv head.
    return resolve(load_config(None, ["model.preset=debug", "model.n_heads=8", "model.n_kv_heads=4", *extra])).model


def batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :5] = -100  # ignored positions must stay ignored
    return inputs, targets


def reference(cfg, seed=0):
    """Single-process logits, mean token loss and gradients (the trainer's normalisation)."""
    model = Llama(cfg)
    init_weights(model, 7)
    inputs, targets = batch(cfg, seed)
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    loss = loss / (targets != -100).sum()
    loss.backward()
    # Every name, a tied head's too: the sharded model's gathered gradients must carry it as well.
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def tp_forward_backward(cfg, sequence_parallel, seed=0):
    ctx = ParallelContext(Layout(tp=torch.distributed.get_world_size()))
    comm = Comm(ctx)
    model = Llama(cfg)
    init_weights(model, 7)
    tp = apply_tensor_parallel(model, comm, sequence_parallel)
    inputs, targets = batch(cfg, seed)
    logits = model(inputs)
    full_logits = tp.gather_logits(logits.detach())  # before the loss, which consumes the logits
    loss = tp.loss_sum(logits, targets) / (targets != -100).sum()
    loss.backward()
    grads = tp.full_state_dict({n: p.grad for n, p in model.named_parameters(remove_duplicate=False)})
    return model, tp, full_logits, loss.detach(), grads


def _equal_to_single_process(cfg_args):
    cfg = model_cfg(*cfg_args)
    ref_logits, ref_loss, ref_grads = reference(cfg)
    out = {}
    for sp in (False, True):
        model, tp, logits, loss, grads = tp_forward_backward(cfg, sp)
        out[sp] = dict(
            logits=(logits - ref_logits).abs().max().item(), loss=(loss - ref_loss).abs().item(),
            grads={n: (grads[n] - g).abs().max().item() for n, g in ref_grads.items()},
            shapes_equal=all(grads[n].shape == g.shape for n, g in ref_grads.items()),
            tied=model.output.weight is model.tok_embeddings.weight,
            sharded=sorted(n for n, p in model.named_parameters() if getattr(p, "meshlm_tp_sharded", False)))
        out[sp]["_grads"] = grads
    out["sp_vs_tp"] = max((out[True]["_grads"][n] - out[False]["_grads"][n]).abs().max().item() for n in ref_grads)
    for sp in (False, True):
        del out[sp]["_grads"]
    return out


@pytest.mark.parametrize("tp,cfg_args", [
    (2, ["model.vocab_size=509", "model.tie_embeddings=true"]),  # padded vocabulary, tied head
    (4, ["model.vocab_size=510"]),  # padded to 512, untied head, one kv head per rank
])
def test_logits_loss_and_every_gradient_equal_the_single_process_model(tp, cfg_args):
    results = run_ranks(_equal_to_single_process, tp, cfg_args, timeout=120)
    for rank in results:
        for sp in (False, True):
            r = rank[sp]
            assert r["shapes_equal"]  # gathered gradients are the full, unpadded tensors
            assert r["logits"] <= 1e-6 and r["loss"] <= 1e-6, r
            assert max(r["grads"].values()) <= 1e-6, r["grads"]
            assert r["tied"] == ("model.tie_embeddings=true" in cfg_args)
            assert len(r["sharded"]) == 2 * 7 + 2 - r["tied"]  # 7 matrices per layer, embedding, head
        assert rank["sp_vs_tp"] <= 1e-6  # sequence parallelism on and off agree


def test_a_model_whose_heads_or_mlp_tp_does_not_divide_is_refused_naming_the_key():
    from types import SimpleNamespace

    from meshlm.parallel.tensor import check_divisible

    check_divisible(SimpleNamespace(n_heads=8, n_kv_heads=4, ffn_dim=160), 4)
    check_divisible(SimpleNamespace(n_heads=8, n_kv_heads=2, ffn_dim=160), 8)  # kv heads replicated 4 times
    for key, value, cfg, tp in (("n_heads", 6, dict(n_heads=6, n_kv_heads=2, ffn_dim=160), 4),
                                ("ffn_dim", 150, dict(n_heads=8, n_kv_heads=4, ffn_dim=150), 4),
                                ("n_kv_heads", 3, dict(n_heads=6, n_kv_heads=3, ffn_dim=160), 2),
                                ("n_kv_heads", 4, dict(n_heads=12, n_kv_heads=4, ffn_dim=168), 6)):
        with pytest.raises(ValueError, match=rf"model\.{key}={value} (is not divisible by|neither divides)"):
            check_divisible(SimpleNamespace(**cfg), tp)


def test_plan_covers_every_matrix_of_the_model():
    model = Llama(model_cfg())
    names = [n for n, _ in model.named_modules()]
    covered = {n for n in names for pattern in TP_PLAN if _matches(pattern, n)}
    linears = {n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    assert linears <= covered


# --------------------------------------------------------------------------- the trainer


def _trainer_steps(corpus, run_dir, world_size, extra, n_steps=3):
    from test_trainer import build_trainer, make_cfg

    trainer = build_trainer(make_cfg(corpus, run_dir, world_size, *extra))
    trainer.forward_backward()
    named = dict(trainer.model.named_parameters(remove_duplicate=False))
    if trainer.cfg.parallel.zero >= 2:  # sharded gradients: gathered over dp
        grads = {n: g.clone() for n, g in trainer.dp.full_grads().items()}
    else:
        grads = {n: p.grad.clone() for n, p in named.items()}  # DDP's .grad are views of a buffer zeroed below
    if trainer.tp:
        grads = trainer.tp.full_state_dict(grads)
    trainer.dp.zero_grad()
    losses = [trainer.train_step().loss for _ in range(n_steps)]
    return grads, losses, {n: v.detach().clone() for n, v in trainer.full_state_dict().items()}


@pytest.mark.parametrize("world_size,extra", [
    (2, ["parallel.tp=2"]),
    (2, ["parallel.tp=2", "parallel.sp=true"]),
    (4, ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true"]),  # composed with data parallelism
    (2, ["parallel.tp=2", "parallel.sp=true", "train.recompute=full"]),  # re-gathers inside recompute
])
def test_trainer_steps_equal_the_single_process_run(corpus, tmp_path, world_size, extra):
    from test_trainer import assert_close

    model_args = ["model.n_heads=8", "model.n_kv_heads=4"]
    reference = _trainer_steps(corpus, tmp_path / "ref", 1, model_args)
    results = run_ranks(_trainer_steps, world_size, corpus, tmp_path / "tp", world_size, extra + model_args,
                        timeout=120)
    for rank_result in results:
        assert_close(reference, rank_result)  # grads 1e-6, losses 1e-5, parameters 1e-5 after 3 AdamW steps
    assert reference[1][-1] < reference[1][0]


@pytest.mark.parametrize("world_size,extra", [
    (4, ["model.n_kv_heads=2", "parallel.tp=4"]),  # each kv head on 2 tp ranks
    (4, ["model.n_kv_heads=2", "parallel.tp=4", "parallel.sp=true"]),
    (4, ["model.n_kv_heads=1", "parallel.tp=2", "parallel.dp=2", "parallel.zero=3"]),  # multi-query, FSDP
    (4, ["model.n_kv_heads=1", "parallel.tp=4", "parallel.zero=2"]),  # one kv head on every tp rank
])
def test_kv_heads_replicated_across_tp_equal_the_single_process_run(corpus, tmp_path, world_size, extra):
    """tp > n_kv_heads: kv heads are replicated (Megatron) and the replicas' gradients summed."""
    from test_trainer import assert_close

    model_args = ["model.n_heads=8", *[e for e in extra if e.startswith("model.")]]
    reference = _trainer_steps(corpus, tmp_path / "ref", 1, model_args)
    results = run_ranks(_trainer_steps, world_size, corpus, tmp_path / "tp", world_size, extra + ["model.n_heads=8"],
                        timeout=120)
    for rank_result in results:
        assert_close(reference, rank_result)


def _bf16_losses(corpus, run_dir, world_size, extra):
    from test_trainer import build_trainer, make_cfg

    trainer = build_trainer(make_cfg(corpus, run_dir, world_size, "train.dtype=bfloat16", *extra))
    return [trainer.train_step().loss for _ in range(2)]


def test_bf16_autocast_runs_through_the_tensor_parallel_layers(corpus, tmp_path):
    _, fp32, _ = _trainer_steps(corpus, tmp_path / "ref", 1, [], n_steps=2)
    for losses in run_ranks(_bf16_losses, 2, corpus, tmp_path / "tp", 2, ["parallel.tp=2", "parallel.sp=true"]):
        assert losses == pytest.approx(fp32, abs=0.05) and losses != fp32


def test_sequence_parallel_without_tensor_parallel_is_a_config_error():
    with pytest.raises(ConfigError, match="parallel.sp"):
        resolve(load_config(None, ["model.preset=debug", "parallel.sp=true"]))
    with pytest.raises(ConfigError, match="model.n_kv_heads=2 neither divides nor is divisible by tp=3"):
        resolve(load_config(None, ["model.preset=debug", "model.dim=96", "model.n_heads=6", "model.ffn_dim=192",
                                   "parallel.tp=3"]), world_size=3)


# --------------------------------------------------------------------------- DTensor


def _against_dtensor(sequence_parallel):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from meshlm.bench.tp import dtensor_loss_sum, dtensor_parallelize

    cfg = model_cfg()  # vocab 512, untied: DTensor cannot keep a tied weight tied
    model, _, logits, loss, grads = tp_forward_backward(cfg, sequence_parallel)
    reference = Llama(cfg)
    init_weights(reference, 7)
    dtensor_parallelize(reference, init_device_mesh("cpu", (torch.distributed.get_world_size(),)), sequence_parallel)
    inputs, targets = batch(cfg)
    with loss_parallel():
        ref_logits = reference(inputs)
        ref_loss = dtensor_loss_sum(ref_logits, targets) / (targets != -100).sum()
        ref_loss.backward()
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    return dict(logits=(full(ref_logits) - logits).abs().max().item(), loss=(full(ref_loss) - loss).abs().item(),
                grads={n: (full(p.grad) - grads[n]).abs().max().item() for n, p in reference.named_parameters()})


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_equal_to_dtensor_parallelize_module(sequence_parallel):
    for r in run_ranks(_against_dtensor, 2, sequence_parallel, timeout=120):
        assert r["logits"] <= 1e-6 and r["loss"] <= 1e-6, r
        assert max(r["grads"].values()) <= 1e-6, r["grads"]


# --------------------------------------------------------------------------- cost formulas


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_communication_bytes_equal_the_formulas(tp_size, sequence_parallel):
    cfg = model_cfg()

    def run():
        ctx = ParallelContext(Layout(tp=tp_size))
        comm = Comm(ctx)
        model = Llama(cfg)
        init_weights(model, 7)
        tp = apply_tensor_parallel(model, comm, sequence_parallel)
        inputs, targets = batch(cfg)
        tp.loss_sum(model(inputs), targets).backward()
        return {r["op"]: (r["count"], r["bytes"], r["bytes_sent"]) for r in comm.summary() if r["axis"] == "tp"}

    predicted = comm_per_microbatch(cfg, BATCH, SEQ, tp_size, sequence_parallel)
    for recorded in run_ranks(run, tp_size, timeout=120):
        assert set(recorded) == set(predicted)
        for op, p in predicted.items():
            assert recorded[op] == (p["count"], p["bytes"], p["sent"]), op
    # One layer's share of the measured activation traffic (SP's [dim] all-reduces of the norm
    # gradients aside), as the per-layer formula says (by default with SP's re-gathers);
    # Korthikanti et al.: SP moves the same bytes per layer as TP (its re-gathers aside).
    deeper = comm_per_microbatch(dataclasses.replace(cfg, n_layers=cfg.n_layers + 1), BATCH, SEQ, tp_size,
                                 sequence_parallel)
    activations = ("all_gather", "reduce_scatter") if sequence_parallel else ("all_reduce",)
    one_layer = sum(deeper[op]["sent"] - predicted[op]["sent"] for op in activations)
    assert layer_comm_sent(cfg, BATCH, SEQ, tp_size, sequence_parallel) == pytest.approx(one_layer, rel=1e-12)
    assert layer_comm_sent(cfg, BATCH, SEQ, tp_size, True, include_regather=False) == \
        layer_comm_sent(cfg, BATCH, SEQ, tp_size, False)


def _saved_bytes_per_layer(tp_size, sequence_parallel, cfg_args):
    """Bytes autograd saves for backward inside layer 0, measured: every distinct storage packed by
    autograd's saved-tensor hooks while the block runs forward."""
    cfg = model_cfg(*cfg_args)
    model = Llama(cfg)
    init_weights(model, 7)
    if tp_size > 1:
        apply_tensor_parallel(model, Comm(ParallelContext(Layout(tp=tp_size))), sequence_parallel)
    # Parameters and buffers (the RoPE tables) are not activations.
    params = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}
    counting = [False]

    def pack(t):
        storage = t.untyped_storage()
        if counting[0] and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    block = model.layers[0]
    block.register_forward_pre_hook(lambda *_: counting.__setitem__(0, True))
    block.register_forward_hook(lambda *_: counting.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch(cfg)[0]).sum().backward()
    return sum(saved.values())


@pytest.mark.parametrize("cfg_args", [[], ["model.n_kv_heads=8", "model.ffn_dim=256"]])
def test_measured_activation_memory_per_layer_equals_the_formula(cfg_args):
    cfg = model_cfg(*cfg_args)
    measured = {(1, False): _saved_bytes_per_layer(1, False, cfg_args)}
    for tp_size in (2, 4):
        for sp in (False, True):
            measured[(tp_size, sp)] = run_ranks(_saved_bytes_per_layer, tp_size, tp_size, sp, cfg_args)[0]
    for (tp_size, sp), got in measured.items():
        assert got == activation_bytes_per_layer(cfg, BATCH, SEQ, tp_size, sp), (tp_size, sp)
    for tp_size in (2, 4):
        # SP divides what TP leaves replicated (norms, their statistics, the GEMM inputs) by tp.
        outside = BATCH * SEQ * (6 * cfg.dim + 2) * 4
        assert measured[(tp_size, False)] - measured[(tp_size, True)] == outside * (1 - 1 / tp_size)
        assert measured[(tp_size, True)] * tp_size == measured[(1, False)]  # SP: everything / tp


def test_a_regions_backward_gathers_its_input_once_and_drops_it_after_its_last_linear(monkeypatch):
    """Under SP the column linears of a region (wq, wk, wv) save the sequence *shard*; in backward
    the first to run all-gathers it, the others reuse that copy, and the last one drops it, so a
    full-sequence copy lives only while its region's backward runs."""
    from meshlm.parallel import tensor_layers
    from meshlm.parallel.tensor_layers import ParallelRegion

    comm = Comm(ParallelContext(Layout()))  # tp of one: the gather is a copy, the bookkeeping is the same
    gathers = []
    real_gather = tensor_layers.gather_sequence
    monkeypatch.setattr(tensor_layers, "gather_sequence", lambda shard, c: gathers.append(1) or real_gather(shard, c))
    region = ParallelRegion(comm, sequence_parallel=True)
    x = torch.randn(2, 4, 8, requires_grad=True)
    weights = [torch.randn(6, 8, requires_grad=True) for _ in range(3)]
    full = region.enter(x)
    outs = [region.linear(full, w) for w in weights]
    gather = region.current[1]
    region.leave()
    assert gather.users == 3 and gather.full is None and len(gathers) == 1  # forward: one gather
    held = []
    for i, out in enumerate(outs):  # each linear's backward alone, in turn
        out.sum().backward(retain_graph=True, inputs=[weights[i]])
        held.append(gather.full is not None)
    assert len(gathers) == 2 and held == [True, True, False] and gather.users == 0
    for w in weights:  # and each weight's gradient is that of the full input
        assert torch.allclose(w.grad, torch.ones(6, 1) * x.detach().reshape(-1, 8).sum(0), atol=1e-5)


@pytest.mark.parametrize("size, tp", [(8, 4), (7, 4), (2, 4), (1, 2)])
def test_shard_rows_pads_at_the_end_to_a_multiple_of_tp(size, tp):
    """Equal shards whatever the size, fewer rows than ranks included; the padding is zeros, last."""
    from meshlm.parallel.tensor_layers import shard_rows

    full = torch.arange(1.0, size * 3 + 1).reshape(size, 3)
    for dim, tensor in ((0, full), (1, full.t().contiguous())):
        shards = [shard_rows(tensor, tp, r, dim) for r in range(tp)]
        per = -(-size // tp)
        assert all(s.shape[dim] == per for s in shards)
        joined = torch.cat(shards, dim=dim)
        assert torch.equal(joined.narrow(dim, 0, size), tensor)
        assert not joined.narrow(dim, size, per * tp - size).any()
        assert shards[0].data_ptr() != tensor.data_ptr()  # a copy: the full tensor can be freed
