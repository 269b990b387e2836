"""End to end through the real launch path: `meshlm train --nproc 2` (torchrun) against one
process, the run-directory contract, and `meshlm generate` on the result."""

import pytest

from helpers import cli_train_args, read_metrics, run_meshlm

REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "mem_peak_bytes"}


def test_single_process_run_writes_the_run_directory_contract(single_cli_run):
    run_dir, proc = single_cli_run
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert REQUIRED <= set(row)
        assert row["tokens"] == 8 * 32 and row["mem_peak_bytes"] > 0
    assert "eval_loss" in rows[1] and "eval_loss" in rows[3]
    assert (run_dir / "config.toml").exists() and (run_dir / "final" / "model.safetensors").exists()
    assert (run_dir / "logs" / "rank0.log").exists()
    assert "--- sample" in proc.stdout
    # the memory model's prediction before step 1, the measured peak beside it at the end
    assert [line.split(" peak")[0] for line in proc.stdout.splitlines() if line.startswith("memory: ")] == \
        ["memory: predicted", "memory: measured"]


def test_two_ranks_through_torchrun_follow_the_single_process_loss_curve(corpus, single_cli_run, tmp_path):
    run_dir, _ = single_cli_run
    proc = run_meshlm(*cli_train_args(corpus, tmp_path, nproc=2))
    reference, two_ranks = read_metrics(run_dir), read_metrics(tmp_path)
    assert [r["loss"] for r in two_ranks] == pytest.approx([r["loss"] for r in reference], abs=1e-5)
    assert [r["eval_loss"] for r in two_ranks if "eval_loss" in r] == pytest.approx(
        [r["eval_loss"] for r in reference if "eval_loss" in r], abs=1e-5)
    assert (tmp_path / "logs" / "rank1.log").exists()
    assert "dp=2" in proc.stdout


def test_generate_continues_the_prompt(single_cli_run):
    run_dir, _ = single_cli_run
    out = run_meshlm("generate", "--checkpoint", str(run_dir), "--prompt", "The ", "--max-new-tokens", "12").stdout
    assert out.startswith("The ") and len(out) > len("The ") + 5
    greedy = [run_meshlm("generate", "--checkpoint", str(run_dir / "final"), "--prompt", "The ", "--max-new-tokens",
                     "8", "--temperature", "0").stdout for _ in range(2)]
    assert greedy[0] == greedy[1]
