"""`meshlm bench tp`, `pp`, `cp` and `gpu` (its CPU smoke) print DESIGN.md's `--json` rows (tiny
runs; the numbers themselves live in benchmarks/RESULTS.md, not in tests). `bench dp` is in
test_ddp_bench.py, `bench scaling` in test_bench_scaling.py."""

import json

import pytest
import torch
from helpers import host_memory_tuning_recorder

from meshlm.testing import run_ranks

DESIGN_FIELDS = {"name", "world_size", "meshlm_tokens_per_s", "reference", "reference_tokens_per_s",
                 "tokens_per_s_ratio", "meshlm_peak_bytes", "reference_peak_bytes", "memory_ratio"}


def check_rows(report, names):
    assert [r["name"] for r in report["rows"]] == names
    for row in report["rows"]:
        assert DESIGN_FIELDS <= set(row) and row["world_size"] == 2
        assert row["meshlm_tokens_per_s"] > 0 and row["reference_tokens_per_s"] > 0
        assert row["meshlm_peak_bytes"] > 0 and row["reference_peak_bytes"] > 0
        assert row["tokens_per_s_ratio"] == pytest.approx(row["meshlm_tokens_per_s"] / row["reference_tokens_per_s"])


def test_bench_tp_json(capsys, monkeypatch, tmp_path):
    from meshlm.bench.tp import main

    tuned = host_memory_tuning_recorder(monkeypatch, tmp_path)

    assert main(["--json", "--preset", "debug", "--seq-len", "16", "--batch", "2", "--pairs", "1",
                 "--warmup", "1", "--sp", "both"]) == 0
    check_rows(json.loads(capsys.readouterr().out), ["tp2", "tp2+sp"])
    assert len(tuned()) == 2  # both ranks allocate as `meshlm train`'s do


def test_bench_pp_json(capsys, monkeypatch, tmp_path):
    from meshlm.bench.pp import main

    tuned = host_memory_tuning_recorder(monkeypatch, tmp_path)

    assert main(["--json", "--preset", "debug", "--schedule", "1f1b", "--seq-len", "16", "--batch", "4",
                 "--microbatches", "2", "--pairs", "1", "--warmup", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    check_rows(report, ["pp2-1f1b"])
    assert report["rows"][0]["loss_max_abs_diff"] == 0  # same stages, same schedule: same losses
    assert report["rows"][0]["loss_check_passed"] is True
    q1, q3 = report["rows"][0]["tokens_per_s_ratio_quartiles"]
    assert 0 < q1 <= q3
    assert "cpu_steal_fraction" in report and "load_average" in report
    assert len(tuned()) == 2


def test_bench_pp_weighs_memory_on_a_warm_step_whatever_the_warmup(capsys):
    """--warmup 1 once measured the first step, before AdamW's state existed: both sides low."""
    from meshlm.bench.pp import main

    peaks = {}
    for warmup in ("1", "2"):
        assert main(["--json", "--preset", "debug", "--schedule", "1f1b", "--seq-len", "16", "--batch", "4",
                     "--microbatches", "2", "--pairs", "1", "--warmup", warmup]) == 0
        row, = json.loads(capsys.readouterr().out)["rows"]
        peaks[warmup] = row["meshlm_peak_bytes"], row["reference_peak_bytes"]
    assert peaks["1"] == peaks["2"]


def test_bench_pp_fails_its_loss_check_on_nan_losses(capsys, monkeypatch):
    from meshlm.bench.pp import main
    from meshlm.model import loss as loss_module

    real = loss_module.token_loss_sum
    monkeypatch.setattr(loss_module, "token_loss_sum", lambda *a, **k: real(*a, **k) * float("nan"))
    assert main(["--json", "--preset", "debug", "--schedule", "1f1b", "--seq-len", "16", "--batch", "4",
                 "--microbatches", "2", "--pairs", "1", "--warmup", "1"]) == 0
    row, = json.loads(capsys.readouterr().out)["rows"]
    assert row["loss_check_passed"] is False and row["loss_max_abs_diff"] is None


def test_bench_cp_fails_its_loss_check_when_the_reference_loss_is_nan(capsys, monkeypatch):
    """max(meshlm_vs_single, nan) once kept the first and passed the check."""
    from meshlm.bench import cp

    real = cp._summary

    def nan_reference(losses, truth):
        check = real(losses, truth)
        return {**check, "reference_loss": float("nan"), "loss_max_abs_diff": float("nan")}

    monkeypatch.setattr(cp, "_summary", nan_reference)
    assert cp.main(["--json", "--preset", "debug", "--seq", "64", "--steps", "1", "--warmup", "1", "--cpu-shim"]) == 0
    row, = json.loads(capsys.readouterr().out)["rows"]
    assert row["meshlm_vs_single_max_abs_diff"] <= cp.LOSS_TOLERANCE and row["loss_check_passed"] is False


def test_loss_check_needs_every_value_finite():
    from meshlm.bench.report import loss_check_passed

    nan, inf = float("nan"), float("inf")
    assert loss_check_passed({"loss": 2.0, "d": 1e-5}, ("d",), 1e-4)
    assert not loss_check_passed({"loss": 2.0, "d": 1e-3}, ("d",), 1e-4)
    for bad in (nan, inf, None):
        assert not loss_check_passed({"loss": bad, "d": 0.0}, ("d",), 1e-4)
        assert not loss_check_passed({"loss": 2.0, "d": bad}, ("d",), 1e-4)


def test_ratio_quartiles_stay_within_the_pairs_measured():
    from meshlm.bench.report import bench_row

    row = bench_row("x", 2, "ref", [100.0, 200.0], [100.0, 100.0], 1, 1)
    assert row["tokens_per_s_ratio"] == 1.5 and row["tokens_per_s_ratio_quartiles"] == [1.25, 1.75]


@pytest.mark.parametrize("name,args,option", [
    ("tp", ["--nproc", "1"], "--nproc"), ("pp", ["--batch", "3"], "--batch"), ("cp", ["--nproc", "1"], "--nproc"),
    # once tracebacks (exit 1): an empty or negative batch, a negative warm-up, a negative global batch
    ("tp", ["--batch", "0"], "--batch"), ("tp", ["--batch", "-1"], "--batch"),
    ("tp", ["--warmup", "-1"], "--warmup"), ("pp", ["--warmup", "-1"], "--warmup"),
    ("cp", ["--warmup", "-1"], "--warmup"),
    ("dp", ["--zero", "3", "--steps", "1", "--warmup", "-5"], "--warmup"),
    ("scaling", ["--mode", "strong", "--global-batch", "-4", "--nproc", "1,2", "--engines", "ddp", "--steps", "1"],
     "--global-batch"),
    # 0 was once silently replaced by the default
    ("scaling", ["--mode", "strong", "--global-batch", "0", "--nproc", "1,2", "--engines", "ddp", "--steps", "1"],
     "--global-batch"),
    ("dp", ["--zero", "x"], "--zero"),  # argparse's own errors are one line too (no usage text)
])
def test_bad_bench_arguments_are_one_line_on_stderr_and_nothing_on_stdout(capsys, name, args, option):
    from meshlm.cli import main

    assert main(["bench", name, *args, "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"meshlm bench {name}: error: {option}") and err.count("\n") == 1


@pytest.mark.parametrize("name,args", [
    ("tp", ["--preset", "debug", "--seq-len", "16", "--batch", "2", "--pairs", "1", "--sp", "off"]),
    ("pp", ["--preset", "debug", "--schedule", "1f1b", "--seq-len", "16", "--batch", "4", "--microbatches", "2",
            "--pairs", "1"]),
    ("cp", ["--preset", "debug", "--seq", "64", "--steps", "1", "--cpu-shim"]),
])
def test_every_bench_takes_warmup_0_as_bench_dp_does(capsys, name, args):
    from meshlm.cli import main

    assert main(["bench", name, *args, "--warmup", "0", "--json"]) == 0
    for row in json.loads(capsys.readouterr().out)["rows"]:
        assert row["meshlm_peak_bytes"] > 0 and row["reference_peak_bytes"] > 0


@pytest.mark.parametrize("name,flag,args", [
    ("comm", "--save-profile", ["--sizes", "64K", "--save-profile", "/no/such/dir/p.json"]),
    ("scaling", "--plot", ["--nproc", "1", "--plot", "/no/such/dir/s.png"]),
    ("scaling", "--profile", ["--nproc", "1", "--profile", "/no/such/profile.json"]),
    ("data", "--dir", ["--size-mb", "1", "--dir", "/no/such/dir"]),
])
def test_a_bench_output_or_input_path_that_cannot_serve_is_refused_before_the_work(capsys, name, flag, args):
    """A traceback once, and for --save-profile and --plot only after the whole benchmark ran."""
    from meshlm.cli import main

    assert main(["bench", name, *args]) == 2
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    assert out == "" and line.startswith(f"meshlm bench {name}: error: {flag}: ") and "/no/such/" in line


def test_steal_fraction_reads_the_eighth_cpu_column():
    from meshlm.bench.report import steal_fraction

    assert steal_fraction([10, 0, 5, 80, 0, 0, 0, 5], [40, 0, 10, 100, 0, 0, 0, 30]) == pytest.approx(25 / 80)
    assert steal_fraction(None, [1] * 8) is None


@pytest.mark.parametrize("shim", [False, True], ids=["torch-cp", "cpu-shim"])
def test_bench_cp_json(capsys, shim, monkeypatch, tmp_path):
    from meshlm.bench.cp import LOSS_TOLERANCE, main

    tuned = host_memory_tuning_recorder(monkeypatch, tmp_path)

    assert main(["--json", "--preset", "debug", "--seq", "64", "--steps", "1", "--warmup", "1"]
                + (["--cpu-shim"] if shim else [])) == 0
    row, = json.loads(capsys.readouterr().out)["rows"]
    assert DESIGN_FIELDS <= set(row) and row["world_size"] == 2
    assert row["meshlm_tokens_per_s"] > 0 and row["meshlm_peak_bytes"] > 0
    # The loss check: meshlm's first step equals the single-process loss, token by token.
    assert row["loss_check_passed"] and row["meshlm_vs_single_max_abs_diff"] <= LOSS_TOLERANCE
    assert len(tuned()) == 2
    assert row["meshlm_loss"] == pytest.approx(row["single_process_loss"], abs=1e-5)
    if row["reference_tokens_per_s"] is None:  # torch 2.13's CP has no CPU kernel: a reason, no numbers
        assert row["device"] == "cpu" and not shim
        assert "_scaled_dot_product_flash_attention_for_cpu" in row["reference_unavailable"]
        assert row["tokens_per_s_ratio"] is None and row["reference_peak_bytes"] is None and row["memory_ratio"] is None
    else:  # both sides ran: the same loss on the first step, and a ratio
        check_rows({"rows": [row]}, [row["name"]])
        assert row["loss_max_abs_diff"] <= LOSS_TOLERANCE
        assert row["reference_loss"] == pytest.approx(row["meshlm_loss"], abs=1e-5)


# --------------------------------------------------------------------------- bench gpu


def test_bench_gpu_without_a_gpu_says_so_in_one_line(capsys, monkeypatch):
    import torch

    from meshlm.bench.gpu import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA GPU" in err and "--device cpu" in err


def test_bench_gpu_cpu_smoke_rows_carry_mfu(capsys):
    from meshlm.analysis.flops import flops_per_token
    from meshlm.bench.gpu import main
    from meshlm.config import load_config, resolve

    assert main(["--device", "cpu", "--modes", "eager", "--seq", "32", "--steps", "1", "--warmup", "0",
                 "--peak-tflops", "2", "--json"]) == 0
    row, = json.loads(capsys.readouterr().out)["rows"]
    assert DESIGN_FIELDS <= set(row) and row["world_size"] == 1 and row["reference"] == "transformers eager"
    assert row["meshlm_tokens_per_s"] > 0 and row["meshlm_peak_bytes"] > 0 and row["reference_peak_bytes"] > 0
    fpt = flops_per_token(resolve(load_config(None, ["model.preset=debug"])).model, 32)
    assert row["mfu"] == pytest.approx(row["meshlm_tokens_per_s"] * fpt / 2e12)
    assert row["reference_mfu"] == pytest.approx(row["reference_tokens_per_s"] * fpt / 2e12)
    # Same weights, same batch: the first step's loss agrees up to bf16 rounding.
    assert row["meshlm_loss"] == pytest.approx(row["reference_loss"], abs=2e-2)


def test_bench_gpu_targets_are_recorded_where_they_apply():
    from meshlm.bench.gpu import targets_met

    row = {"reference": "transformers+compile", "tokens_per_s_ratio": 0.97, "preset": "1b", "seq_len": 2048,
           "mfu": 0.47}
    assert targets_met(row) == {"tokens_per_s_ratio >= 1.0": False, "mfu >= 0.45": True}
    assert targets_met({**row, "reference": "transformers eager", "preset": "125m"}) == {}


def test_bench_gpu_keeps_the_rows_of_the_modes_that_ran_when_one_fails(capsys, monkeypatch):
    from meshlm.bench import gpu

    real = gpu._mode_pair

    def compile_fails(preset, seq, mb, mode, opts, device):
        if mode == "compile":
            raise RuntimeError("inductor: no C compiler\nsecond line")
        return real(preset, seq, mb, mode, opts, device)

    monkeypatch.setattr(gpu, "_mode_pair", compile_fails)
    assert gpu.main(["--device", "cpu", "--modes", "eager,compile", "--seq", "32", "--steps", "1", "--warmup", "0",
                     "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert [r["name"] for r in report["rows"]] == ["debug-s32-b2-eager"]
    assert report["failed"] == ["debug seq 32 micro-batch 2 compile: RuntimeError: inductor: no C compiler"]
    # announced as they happen: the row that landed, then the failure
    assert "debug-s32-b2-eager: " in captured.err and "compile: RuntimeError" in captured.err


def test_bench_gpu_refuses_a_transformers_whose_loss_would_shift_twice(capsys, monkeypatch):
    import transformers.loss.loss_utils as loss_utils

    from meshlm.bench import gpu

    def old_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
        raise AssertionError("not to be called")

    monkeypatch.setattr(loss_utils, "ForCausalLMLoss", old_loss)
    assert gpu.main(["--device", "cpu", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "takes no shift_labels" in err


def _tp_clip_rank():
    from torch.distributed.device_mesh import init_device_mesh

    from meshlm.bench.timing import random_batch
    from meshlm.bench.tp import TensorParallelEngine
    from meshlm.comm import Comm
    from meshlm.config import load_config, resolve
    from meshlm.mesh import Layout, ParallelContext

    comm = Comm(ParallelContext(Layout(tp=2)))
    mesh = init_device_mesh("cpu", (2,))
    cfg = resolve(load_config(None, ["model.preset=debug", "model.tie_embeddings=false", "train.seq_len=16",
                                     "parallel.tp=2"]), world_size=2).model
    batch = random_batch(0, 2, 16, cfg.vocab_size, "cpu")
    moved = {}
    for kind in ("meshlm+sp", "dtensor+sp"):
        after = {}
        for max_norm in (1e-6, float("inf")):
            engine = TensorParallelEngine(kind, cfg, comm, mesh, torch.device("cpu"), max_norm=max_norm)
            engine.step(*batch)
            after[max_norm] = [getattr(p, "_local_tensor", p).detach().clone() for p in engine.model.parameters()]
        moved[kind] = max((a - b).abs().max().item() for a, b in zip(after[1e-6], after[float("inf")]))
    return moved


def test_bench_tp_engines_clip_gradients_as_bench_dps_do():
    """bench scaling measures TP against a one-rank baseline that clips: both TP sides clip too."""
    for moved in run_ranks(_tp_clip_rank, 2, timeout=120):
        assert moved["meshlm+sp"] > 1e-6 and moved["dtensor+sp"] > 1e-6, moved


@pytest.mark.parametrize("name", ["comm", "cp", "data", "dp", "gpu", "pp", "scaling", "tp"])
def test_bench_help_describes_the_bench_in_a_whole_sentence(name, capsys):
    """`meshlm bench NAME --help` opens with its module's first sentence, not the docstring's first
    line: `bench gpu` and `bench scaling` wrap theirs, and their help stopped mid-sentence ("one GPU,")."""
    import re

    from meshlm.cli import main

    try:
        code = main(["bench", name, "--help"])
    except SystemExit as e:  # bench data's parser exits itself
        code = e.code
    assert not code
    help_text = capsys.readouterr().out
    description = " ".join(help_text.split("\n\n")[1].split())
    assert re.match(rf"`meshlm bench {name}\b", description) and description.endswith("."), description
