"""End to end through the real launch path: `meshlm train --nproc 2` (torchrun) against one
process, the run-directory contract, and `meshlm generate` on the result."""

import json
import os
import subprocess
import sys

import pydoc_data.topics
import pytest

REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "mem_peak_bytes"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-corpus")
    (root / "topics.txt").write_text("\n\n".join(pydoc_data.topics.topics.values()))
    return root


def meshlm(*args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "meshlm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def train(corpus, run_dir, *extra):
    return meshlm("train", *extra, "model.preset=debug", f"data.path={corpus / 'topics.txt'}",
                  f"data.cache_dir={corpus / 'cache'}", "train.seq_len=32", "train.global_batch_size=8",
                  "train.micro_batch_size=2", "train.steps=4", "train.lr=1e-3", "train.eval_interval=2",
                  "run.sample_tokens=8", f"run.dir={run_dir}")


def metrics(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def single_run(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    proc = train(corpus, run_dir)
    return run_dir, proc


def test_single_process_run_writes_the_run_directory_contract(single_run):
    run_dir, proc = single_run
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert REQUIRED <= set(row)
        assert row["tokens"] == 8 * 32 and row["mem_peak_bytes"] > 0
    assert "eval_loss" in rows[1] and "eval_loss" in rows[3]
    assert (run_dir / "config.toml").exists() and (run_dir / "final" / "model.safetensors").exists()
    assert (run_dir / "logs" / "rank0.log").exists()
    assert "--- sample" in proc.stdout


def test_two_ranks_through_torchrun_follow_the_single_process_loss_curve(corpus, single_run, tmp_path):
    run_dir, _ = single_run
    proc = train(corpus, tmp_path, "--nproc", "2")
    reference, two_ranks = metrics(run_dir), metrics(tmp_path)
    assert [r["loss"] for r in two_ranks] == pytest.approx([r["loss"] for r in reference], abs=1e-5)
    assert [r["eval_loss"] for r in two_ranks if "eval_loss" in r] == pytest.approx(
        [r["eval_loss"] for r in reference if "eval_loss" in r], abs=1e-5)
    assert (tmp_path / "logs" / "rank1.log").exists()
    assert "dp=2" in proc.stdout


def test_generate_continues_the_prompt(single_run):
    run_dir, _ = single_run
    out = meshlm("generate", "--checkpoint", str(run_dir), "--prompt", "The ", "--max-new-tokens", "12").stdout
    assert out.startswith("The ") and len(out) > len("The ") + 5
    greedy = [meshlm("generate", "--checkpoint", str(run_dir / "final"), "--prompt", "The ", "--max-new-tokens",
                     "8", "--temperature", "0").stdout for _ in range(2)]
    assert greedy[0] == greedy[1]
