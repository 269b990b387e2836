"""`meshlm bench dp`'s contract: its JSON follows the design's schema, its reference on
transformers' Llama trains the same model as on meshlm's, and its reference and compute-only
steps use the AdamW meshlm's engines step."""

import pytest
import torch

from meshlm.config import TrainConfig
from meshlm.testing import run_ranks

import dp_engines  # noqa: F401  (its AdamW imports dynamo once, here, not in each forked rank)
from helpers import comm_here, host_memory_tuning_recorder


def test_bench_dp_json_follows_the_design_schema(capsys, monkeypatch, tmp_path):
    import json

    from meshlm.bench.dp import main

    tuned = host_memory_tuning_recorder(monkeypatch, tmp_path)

    assert main(["--zero", "0,3", "--steps", "1", "--warmup", "0", "--dim", "32", "--layers", "2", "--heads", "2",
                 "--ffn", "64", "--vocab", "300", "--seq", "16", "--batch", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    required = {"name", "world_size", "meshlm_tokens_per_s", "reference", "reference_tokens_per_s",
                "tokens_per_s_ratio", "meshlm_peak_bytes", "reference_peak_bytes", "memory_ratio",
                "meshlm_exposed_comm_share", "reference_exposed_comm_share"}
    assert [r["name"] for r in report["rows"]] == ["zero0", "zero3"]
    for row in report["rows"]:
        assert required <= set(row) and row["world_size"] == 2
        assert row["meshlm_tokens_per_s"] > 0 and row["reference_tokens_per_s"] > 0
        assert row["meshlm_peak_bytes"] > 0 and row["reference_peak_bytes"] > 0
        assert 0 <= row["meshlm_exposed_comm_share"] < 1
    assert [r["reference"] for r in report["rows"]] == ["torch DDP", "fully_shard"]
    assert len(tuned()) == 2  # both ranks allocate as `meshlm train`'s do (train/host_memory.py)
    assert main(["--zero", "5"]) == 2  # bad usage: exit 2


def _reference_models_rank(zero):
    from meshlm.bench import dp as bench
    from meshlm.train.checkpoint.hf import hf_name

    class Opts:
        dim, layers, heads, ffn, vocab, seq, batch = 32, 2, 2, 64, 300, 16, 2

    cfg = bench.model_config(Opts)
    comm = comm_here()
    engines = [bench.Engine("reference", zero, cfg, comm, torch.device("cpu"), reference_model=m)
               for m in ("meshlm", "transformers")]
    for step in range(2):
        batch = bench._batch(step, Opts, torch.device("cpu"))
        for engine in engines:
            engine.step(*batch)
    ours, theirs = ({n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                     for n, p in e.model.named_parameters()} for e in engines)
    import transformers

    hf = isinstance(engines[1].model, transformers.LlamaForCausalLM)  # (fully_shard subclasses it)
    return hf, max((ours[n] - theirs[hf_name(n)]).abs().max().item() for n in ours)


@pytest.mark.parametrize("zero", [0, 3])
def test_bench_reference_on_transformers_llama_trains_the_same_model(zero, capsys):
    """--reference-model transformers: torch DDP / fully_shard on LlamaForCausalLM with meshlm's
    weights take the same steps as on meshlm's Llama, so the bench compares like with like."""
    from meshlm.bench.dp import main

    for hf, difference in run_ranks(_reference_models_rank, 2, zero, timeout=120):
        assert hf and difference <= 1e-5
    assert main(["--zero", "0", "--steps", "1", "--warmup", "0", "--dim", "32", "--layers", "2", "--heads", "2",
                 "--ffn", "64", "--vocab", "300", "--seq", "16", "--batch", "2", "--reference-model", "transformers"]) == 0
    assert "torch DDP + HF Llama" in capsys.readouterr().out


def _bench_optimizers_rank():
    from meshlm.bench import dp as bench
    from meshlm.parallel.mixed_precision import decays

    class Opts:
        dim, layers, heads, ffn, vocab, seq, batch = 32, 2, 2, 64, 300, 16, 2

    cfg, comm = bench.model_config(Opts), comm_here()
    flags, groups = {}, {}
    for zero in (0, 3):
        for kind in ("meshlm", "reference", "compute"):
            engine = bench.Engine(kind, zero, cfg, comm, torch.device("cpu"))
            optimizer = engine.dp.optim.optimizer if kind == "meshlm" else engine.optimizer
            flags[zero, kind] = {k: optimizer.defaults[k] for k in ("foreach", "fused")}
            if kind != "meshlm":  # meshlm's groups hold flat master segments: decays() decided them
                groups[zero, kind] = [(g["weight_decay"], all(decays(p) == (g["weight_decay"] > 0) for p in g["params"]))
                                      for g in optimizer.param_groups]
    return flags, groups


def test_bench_dp_gives_its_reference_and_compute_only_steps_meshlms_adamw(monkeypatch):
    """On CUDA meshlm's engines step a fused AdamW (adamw_implementation); the reference and the
    compute-only step once had train/optim.py's per-tensor one, a slower optimizer than meshlm's.
    The chooser is made to answer its CUDA flags on this CPU (fused AdamW runs on CPU too)."""
    from meshlm.parallel import mixed_precision

    cuda_flags = mixed_precision.adamw_implementation(True)
    assert cuda_flags["fused"] is True
    monkeypatch.setattr(mixed_precision, "adamw_implementation", lambda on_cuda: dict(cuda_flags))
    flags, groups = run_ranks(_bench_optimizers_rank, 1, timeout=60)[0]
    for (zero, kind), got in flags.items():
        assert got == cuda_flags, (zero, kind)
    for key, got in groups.items():
        assert got == [(TrainConfig().weight_decay, True), (0.0, True)], key
