"""The memory model against measurement: every config of the grid runs two training steps with
the per-rank peak tracked (`train.track_memory`, live tensor bytes on CPU), and the model's
prediction for each pipeline rank must be within 10% of the largest measured peak of the ranks in
that role. Step 2 is measured: the optimizer state exists from step 1's update on.

The grid spans dp, zero 0-3, tp, sp, cp, pp with each schedule, recompute, bf16 and the
micro-batch count. `python tests/test_memory.py` prints the table in docs/memory.md."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import pytest  # noqa: E402
from helpers import build_trainer, small_cfg, write_offline_corpus  # noqa: E402

from meshlm.analysis.memory import predict, rank_parameters  # noqa: E402
from meshlm.testing import run_ranks  # noqa: E402

TOLERANCE = 0.10
PP2 = ("parallel.pp=2",)
WIDE = ("model.dim=256", "model.ffn_dim=768", "train.seq_len=16")  # model state over activations
GRID: list[tuple[int, tuple[str, ...]]] = [
    (1, ()),
    (1, ("train.micro_batch_size=8",)),  # one micro-batch: no gradients yet at the loss's backward
    (1, ("train.recompute=full",)),
    (1, ("train.recompute=selective",)),
    (1, ("train.dtype=bfloat16",)),
    (2, ("parallel.zero=0",)),
    (2, ("parallel.zero=1",)),
    (2, ("parallel.zero=2",)),
    (2, ("parallel.zero=3",)),
    (2, ("parallel.zero=1", "train.dtype=bfloat16")),
    (2, ("parallel.zero=2", "train.dtype=bfloat16")),
    (2, ("parallel.zero=3", "train.dtype=bfloat16")),
    (2, ("parallel.tp=2",)),
    (2, ("parallel.tp=2", "parallel.sp=true")),
    (2, ("parallel.cp=2",)),
    (2, (*PP2, "parallel.pp_schedule=1f1b")),
    (2, (*PP2, "parallel.pp_schedule=gpipe")),
    (2, (*PP2, "parallel.pp_schedule=interleaved", "parallel.pp_virtual=2", "model.n_layers=4")),
    (2, (*PP2, "parallel.pp_schedule=1f1b", "train.recompute=full")),
    (2, (*PP2, "parallel.zero=1", "train.dtype=bfloat16")),  # bf16 activations between the stages
    (4, ("parallel.zero=3",)),
    (4, ("parallel.zero=3", *WIDE)),  # gathered units and their prefetch dominate
    (2, ("parallel.zero=2", *WIDE)),
    (4, ("parallel.zero=2", "parallel.dp=4")),
    (4, ("parallel.dp=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero=1")),
    (4, ("parallel.dp=2", "parallel.cp=2", "parallel.zero=2")),
    (4, ("parallel.tp=2", *PP2, "parallel.pp_schedule=1f1b", "parallel.sp=true")),
]


def _measure(world: int, configs: list[tuple[str, ...]], corpus: Path, run_dir: Path) -> list[tuple[int, int]]:
    """(pipeline rank, step-2 peak bytes) of this rank for each config, in one set of processes."""
    out = []
    for extra in configs:
        cfg = small_cfg(corpus, run_dir, world, "train.track_memory=true", *extra)
        trainer = build_trainer(cfg)
        for _ in range(2):
            trainer.train_step()
        out.append((trainer.ctx.coord("pp"), trainer.memory.last_peak))
    return out


def measured_vs_predicted(corpus: Path, run_dir: Path) -> list[tuple[int, tuple[str, ...], int, int, int, str]]:
    """(world, overrides, pp rank, measured, predicted, phase) for every role of every config."""
    rows = []
    for world in sorted({w for w, _ in GRID}):
        configs = [extra for w, extra in GRID if w == world]
        if world == 1:
            per_rank = [_measure(1, configs, corpus, run_dir)]
        else:
            per_rank = run_ranks(_measure, world, world, configs, corpus, run_dir, timeout=300)
        for i, extra in enumerate(configs):
            report = predict(small_cfg(corpus, run_dir, world, *extra), backend="shm")
            by_role: dict[int, int] = {}
            for rank_results in per_rank:
                pp_rank, peak = rank_results[i]
                by_role[pp_rank] = max(by_role.get(pp_rank, 0), peak)
            for pp_rank, peak in sorted(by_role.items()):
                role = report.ranks[pp_rank]
                rows.append((world, extra, pp_rank, peak, role.peak_bytes, role.phase))
    return rows


def test_grid_has_at_least_twenty_configs():
    assert len(GRID) >= 20


def test_predicted_peak_within_ten_percent_of_measured(tmp_path):
    corpus = write_offline_corpus(tmp_path / "corpus")
    rows = measured_vs_predicted(corpus, tmp_path / "run")
    bad = [(w, e, pp, m, p) for w, e, pp, m, p, _ in rows if abs(p / m - 1) > TOLERANCE]
    assert not bad, bad


if __name__ == "__main__":  # the table in docs/memory.md
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_offline_corpus(Path(tmp) / "corpus")
        print("| ranks | overrides (debug preset, seq 32, micro-batch 2, global 8) | role | measured | predicted | error | peak at |")
        print("|---|---|---|---:|---:|---:|---|")
        for world, extra, pp_rank, measured, predicted, phase in measured_vs_predicted(corpus, Path(tmp) / "run"):
            print(f"| {world} | {' '.join(extra) or '(defaults)'} | pp{pp_rank} | {measured:,} | {predicted:,} | "
                  f"{predicted / measured - 1:+.1%} | {phase} |")


# --------------------------------------------------------------------------- the command


# The shape of issue 15, where model state dominates: 2.1M parameters, 32 tokens per rank.
MODEL_STATE_BOUND = ("model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4",
                     "model.vocab_size=1024", "train.micro_batch_size=1", "train.global_batch_size=2")


def test_every_zero_stage_lowers_the_peak_by_what_the_formulas_predict(tmp_path):
    from meshlm.parallel.zero import stage2_bucket_bytes

    corpus = write_offline_corpus(tmp_path / "corpus")
    configs = [(f"parallel.zero={z}", *MODEL_STATE_BOUND) for z in range(4)]
    per_rank = run_ranks(_measure, 2, 2, configs, corpus, tmp_path / "run", timeout=300)
    measured = [max(rank[i][1] for rank in per_rank) for i in range(4)]
    expected = [predict(small_cfg(corpus, tmp_path, 2, *c), backend="shm").peak_bytes for c in configs]
    assert all(abs(e / m - 1) <= TOLERANCE for e, m in zip(expected, measured)), (measured, expected)
    assert measured[0] > measured[1] > measured[2] > measured[3], measured
    # Stage 2 drops the replicated gradients (4N bytes, keeping the 4N/2 shard): no full-size gradient
    # buffer lives beyond the buckets in flight (parallel/zero.py: at most two of them, with gloo's copy).
    n = sum(rank_parameters(small_cfg(corpus, tmp_path, 2, *configs[2]), 0).values())
    staging = 3 * stage2_bucket_bytes(4 * n)
    assert measured[1] - measured[2] >= 4 * n / 2 - staging, (measured, n)


def test_cpu_peak_is_measured_on_the_first_steps_and_every_interval_and_carried_between():
    import torch

    from meshlm.train.memtrack import PeakMemory

    meter = PeakMemory(torch.device("cpu"), interval=3)
    seen = []
    for step in range(1, 8):
        with meter.step((), step):
            torch.ones(1000 * step)  # 4000 * step bytes: a different peak each step
        seen.append((meter.measured, meter.last_peak))
    assert seen == [(True, 4000), (True, 8000), (True, 12000), (False, 12000), (False, 12000), (True, 24000),
                    (False, 24000)]
    resumed = PeakMemory(torch.device("cpu"), interval=3)  # a run resumed from step 4: its first two steps
    measured = []
    for step in range(5, 9):
        with resumed.step((), step):
            torch.ones(1000)
        measured.append(resumed.measured)
    assert measured == [True, True, False, False] and resumed.last_peak == 4000


def _memory_json(capsys, *args: str, code: int = 0) -> dict:
    import json

    from meshlm.cli import main

    assert main(["memory", "--json", *args]) == code
    return json.loads(capsys.readouterr().out)


def test_memory_json_for_a_layout_of_64_ranks_without_starting_any(capsys):
    out = _memory_json(capsys, "--device-memory", "80GiB", "model.preset=llama3-70b", "parallel.dp=8",
                       "parallel.tp=8", "parallel.pp=1", "parallel.zero=3", "train.dtype=bfloat16",
                       "train.seq_len=4096", "train.micro_batch_size=1", "train.global_batch_size=64",
                       "train.recompute=full", "parallel.sp=true")
    assert out["peak_bytes"] == max(r["peak_bytes"] for r in out["ranks"])
    for role in out["ranks"]:
        parts = [role[f] for f in ("params_bytes", "grads_bytes", "optimizer_bytes", "master_bytes",
                                   "activations_bytes", "other_bytes")]
        assert all(isinstance(x, int) and x >= 0 for x in parts) and sum(parts) == role["peak_bytes"]
    assert out["fits"] and out["device_memory_bytes"] == 80 * 2**30
    assert [(r["role"], r["ranks"]) for r in out["ranks"]] == [("every rank", 64)]


def test_each_pipeline_role_counts_the_ranks_that_have_it(capsys):
    out = _memory_json(capsys, "model.preset=tiny", "parallel.dp=2", "parallel.tp=2", "parallel.cp=2",
                       "parallel.pp=4", "train.micro_batch_size=2", "train.global_batch_size=16")
    assert [(r["role"], r["ranks"]) for r in out["ranks"]] == [("pp0", 8), ("pp1", 8), ("pp2", 8), ("pp3", 8)]


def test_memory_names_the_changes_that_would_fit(capsys):
    out = _memory_json(capsys, "--device-memory", "80GiB", "model.preset=llama3-8b", "parallel.dp=8",
                       "train.dtype=bfloat16", "train.seq_len=8192", "train.micro_batch_size=1",
                       "train.global_batch_size=64", code=1)
    assert not out["fits"] and out["peak_bytes"] > 80 * 2**30
    assert out["suggestions"] and all(s["peak_bytes"] <= 80 * 2**30 for s in out["suggestions"])
    assert "parallel.zero=3" in [s["overrides"] for s in out["suggestions"]]


def test_memory_exits_1_when_the_peak_does_not_fit_as_plan_does(capsys, monkeypatch):
    """A verdict a script can gate a launch on: 1 when the peak exceeds the device's memory (text
    and JSON alike, the report still printed), 0 when it fits or no capacity is known. Without
    --device-memory the capacity is the visible GPU's: both machines are set here, so that the
    test means the same on a GPU machine (where an 80 GiB GPU gives a verdict) as on this one."""
    from meshlm.analysis import memory_report
    from meshlm.cli import main

    config = ["model.preset=llama3-8b", "parallel.dp=8", "train.dtype=bfloat16", "train.seq_len=8192",
              "train.micro_batch_size=1", "train.global_batch_size=64"]
    assert main(["memory", "--device-memory", "80GiB", *config]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["memory", "--device-memory", "80GiB", *config, "parallel.zero=3"]) == 0
    assert ": fits" in capsys.readouterr().out
    monkeypatch.setattr(memory_report, "visible_device_memory", lambda: None)
    assert main(["memory", *config]) == 0  # no GPU, no --device-memory: no verdict
    assert "fit" not in capsys.readouterr().out
    monkeypatch.setattr(memory_report, "visible_device_memory", lambda: 80 * 2**30)
    assert main(["memory", *config]) == 1  # the visible GPU's capacity
    assert "does NOT fit" in capsys.readouterr().out


def test_memory_pipeline_roles_and_plot(capsys, tmp_path):
    plot = tmp_path / "m.png"
    out = _memory_json(capsys, "--plot", str(plot), "--device-memory", "80GB", "model.preset=llama2-7b",
                       "parallel.pp=4", "parallel.pp_schedule=1f1b", "train.global_batch_size=8",
                       "train.micro_batch_size=1", "train.seq_len=1024")
    assert [r["role"] for r in out["ranks"]] == ["pp0", "pp1", "pp2", "pp3"]
    # 1F1B: stage r holds pp - r micro-batches, so the first stage holds the most activations
    acts = [r["activations_bytes"] for r in out["ranks"]]
    assert acts[0] > acts[1] > acts[2]
    assert plot.stat().st_size > 10_000


def test_memory_bad_input_is_one_line_exit_2(capsys):
    from meshlm.cli import main

    assert main(["memory", "model.preset=nope"]) == 2
    assert "model.preset" in capsys.readouterr().err
    assert main(["memory", "--device-memory", "lots", "model.preset=debug"]) == 2
    assert "--device-memory" in capsys.readouterr().err
    assert main(["memory", "parallel.tp=3", "model.preset=debug"]) == 2
    capsys.readouterr()
    for args, flag in ((["--device-memory", "0GiB"], "--device-memory: must be more than 0"),
                       (["--plot", "/no/such/dir/x.png"], "--plot: /no/such/dir is not a directory")):
        assert main(["memory", *args, "model.preset=debug"]) == 2
        err = capsys.readouterr().err
        assert flag in err and err.count("\n") == 1


def test_micro_batches_in_flight_come_from_the_schedule(tmp_path):
    from meshlm.analysis.memory import micro_batches_in_flight

    def held(*extra):
        cfg = small_cfg(write_offline_corpus(tmp_path), tmp_path / "run", 4, "parallel.pp=4", "model.n_layers=4", "train.micro_batch_size=1", *extra)
        return [micro_batches_in_flight(cfg, r) for r in range(4)]

    assert held("parallel.pp_schedule=1f1b") == [4, 3, 2, 1]  # stage r: pp - r (8 micro-batches)
    assert held("parallel.pp_schedule=gpipe") == [8, 8, 8, 8]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_preset_has_a_prediction(dtype):
    from meshlm.config import load_config, resolve
    from meshlm.model.presets import PRESETS

    for preset in PRESETS:
        cfg = resolve(load_config(None, [f"model.preset={preset}", f"train.dtype={dtype}", "train.seq_len=256",
                                         "train.micro_batch_size=1", "train.global_batch_size=2"]), world_size=1)
        report = predict(cfg)
        (role,) = report.ranks
        n = sum(rank_parameters(cfg, 0).values())
        assert role.params_bytes == 4 * n and role.optimizer_bytes == 8 * n  # DDP: fp32 weights, AdamW
        assert report.peak_bytes > 12 * n + role.activations_bytes


def test_the_fixed_bytes_are_the_models_rope_tables_and_one_pipeline_stage_is_every_rank():
    """Terms too small to move a peak of the grid by 10% (the peak test cannot see them): the RoPE
    tables (a function of model.max_seq_len alone) against the model's own buffers, exactly."""
    import torch

    from meshlm.config import load_config, resolve
    from meshlm.model import Llama

    def resolved(max_seq_len):
        return resolve(load_config(None, ["model.preset=debug", f"model.max_seq_len={max_seq_len}",
                                          "train.seq_len=64"]), world_size=1)

    def rope_bytes(cfg):
        with torch.device("meta"):
            model = Llama(cfg.model)
        return sum(b.numel() * b.element_size() for b in model.buffers())

    short, long = resolved(256), resolved(1024)
    assert predict(long).peak_bytes - predict(short).peak_bytes == rope_bytes(long) - rope_bytes(short) > 0
    assert [r.role for r in predict(short).ranks] == ["every rank"]


def _local_parameters(world: int, configs, corpus: Path, run_dir: Path) -> list[tuple[int, int]]:
    out = []
    for extra in configs:
        trainer = build_trainer(small_cfg(corpus, run_dir, world, *extra))
        out.append((trainer.ctx.coord("pp"), sum(p.numel() for p in trainer.model.parameters())))
    return out


def test_parameter_counts_are_the_built_models_on_every_rank(tmp_path):
    """Every term of the model is counted on `rank_parameters`: it must be each rank's own
    parameter count, where kv heads are replicated (tp 4 > 2 kv heads), split (tp 2), with a
    pipeline, and with a tied head copied to the last stage."""
    corpus = write_offline_corpus(tmp_path / "corpus")
    configs = [("parallel.tp=4",), ("parallel.tp=2", *PP2), ("parallel.pp=4", "model.n_layers=6", "parallel.pp_layers=3,1,1,1"),
               ("parallel.tp=2", *PP2, "model.tie_embeddings=true"), ("parallel.tp=4", "model.tie_embeddings=true")]
    per_rank = run_ranks(_local_parameters, 4, 4, configs, corpus, tmp_path / "run", timeout=300)
    for i, extra in enumerate(configs):
        cfg = small_cfg(corpus, tmp_path / "run", 4, *extra)
        for rank in per_rank:
            pp_rank, built = rank[i]
            assert sum(rank_parameters(cfg, pp_rank).values()) == built, (extra, pp_rank)


def test_memory_phases_lists_each_roles_walk_whose_largest_point_is_the_peak(capsys):
    from meshlm.cli import main

    args = ["model.preset=debug", "parallel.pp=2", "parallel.pp_schedule=1f1b", "train.global_batch_size=4",
            "train.micro_batch_size=1", "train.seq_len=64"]
    out = _memory_json(capsys, "--phases", *args)
    assert len(out["phases"]) == 2
    for role, points in zip(out["ranks"], out["phases"]):
        assert max(p["peak_bytes"] for p in points) == role["peak_bytes"]
        peak = max(points, key=lambda p: p["peak_bytes"])
        assert peak["phase"] == role["phase"]
        instructions = [p["instruction"] for p in points]
        assert instructions == sorted(instructions)  # in the order the step reaches them
        # 4 micro-batches: 4 forwards and 4 backwards, then the reduction and the optimizer step
        assert instructions[-1] == 9 and [p["phase"] for p in points[-2:]] == ["gradient reduction", "optimizer step"]
    assert "phases" not in _memory_json(capsys, *args)
    assert main(["memory", "--phases", *args]) == 0
    text = capsys.readouterr().out
    assert "pp0: instr" in text and "pp1: instr" in text and text.count("optimizer step") == 2


def _saved_bytes(world: int, configs, corpus: Path, run_dir: Path) -> list[int]:
    """Bytes autograd saves for one micro-batch's forward and loss, each storage once, leaving out
    what exists before it (parameters, buffers, the batch)."""
    import torch

    out = []
    for extra in configs:
        cfg = small_cfg(corpus, run_dir, world, "train.seq_len=48", *extra)
        trainer = build_trainer(cfg)
        inputs, targets = trainer.loader.microbatches(0, 0, 1, cfg.train.micro_batch_size)[0]
        existing = (*trainer.model.parameters(), *trainer.model.buffers(), inputs)
        before = {t.untyped_storage().data_ptr() for t in existing}
        saved: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in before:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with trainer._autocast():
                logits = trainer.dp.module(inputs)
            trainer.loss_sum(logits, targets)
        out.append(sum(saved.values()))
    return out


def test_what_a_micro_batch_saves_is_the_models_count_to_the_byte(tmp_path):
    """The activations term exactly, below what a peak or a window can resolve: every block's
    saved tensors under each recompute mode, in fp32 and with bf16 weights (fp32 norm inputs and
    statistics, the fp32 log-sum-exp, RoPE's bf16 tables), DDP's autocast (fp32 norms, a bf16
    input copy per linear, bf16 weight copies), the final norm, the loss's per-row state. One
    rank, no tp/cp/pp (the vocabulary-parallel loss and ring attention save others)."""
    from meshlm.analysis.memory_terms import chunk_saved_bytes

    corpus = write_offline_corpus(tmp_path / "corpus")
    configs = [(), ("train.recompute=selective",), ("train.recompute=full",), ("model.tie_embeddings=true",),
               ("parallel.zero=1",),
               ("parallel.zero=1", "train.dtype=bfloat16"),
               ("parallel.zero=1", "train.dtype=bfloat16", "train.recompute=selective"),
               ("parallel.zero=2", "train.dtype=bfloat16", "train.recompute=full"),
               ("train.dtype=bfloat16",), ("train.dtype=bfloat16", "train.recompute=selective"),
               ("train.dtype=bfloat16", "train.recompute=full")]
    (measured,) = run_ranks(_saved_bytes, 1, 1, configs, corpus, tmp_path / "run", timeout=300)
    predicted = [chunk_saved_bytes(small_cfg(corpus, tmp_path / "run", 1, "train.seq_len=48", *extra), 0)
                 for extra in configs]
    assert measured == predicted, list(zip(configs, measured, predicted))
