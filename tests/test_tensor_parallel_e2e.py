"""`meshlm train --nproc 2 parallel.tp=2` (with and without sequence parallelism) through torchrun
follows the single-process loss curve, and its gathered final weights are the single-process
model's shapes, so `meshlm generate` reads them."""

import json

import pytest
from safetensors.torch import load_file

from helpers import run_meshlm


def train(corpus, run_dir, *extra, in_process=False):
    # vocab 509: not divisible by tp, so the padded vocabulary is exercised end to end.
    return run_meshlm("train", *extra, "model.preset=debug", "model.vocab_size=509", "model.tie_embeddings=true",
                      f"data.path={corpus / 'topics.txt'}", f"data.cache_dir={corpus / 'cache'}", "train.seq_len=32",
                      "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=4", "train.lr=1e-3",
                      "train.eval_interval=2", "run.sample_tokens=0", f"run.dir={run_dir}", in_process=in_process)


def losses(run_dir):
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["loss"] for r in rows], [r["eval_loss"] for r in rows if "eval_loss" in r]


@pytest.fixture(scope="module")
def single_run(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tp-single")
    train(corpus, run_dir, in_process=True)  # one rank: the launcher's own process, no torchrun
    return run_dir


# sp=true only: plain TP's parity is tested in-process (test_tensor_parallel.py); the CLI run
# costs ~15 s per case.
@pytest.mark.parametrize("sp", ["true"])
def test_tensor_parallel_run_follows_the_single_process_loss_curve(corpus, single_run, tmp_path, sp):
    train(corpus, tmp_path, "--nproc", "2", "parallel.tp=2", f"parallel.sp={sp}")
    (ref_loss, ref_eval), (loss, eval_loss) = losses(single_run), losses(tmp_path)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    assert eval_loss == pytest.approx(ref_eval, abs=1e-5)
    assert ref_loss[-1] < ref_loss[0]
    single, parallel = load_file(single_run / "final" / "model.safetensors"), load_file(
        tmp_path / "final" / "model.safetensors")
    assert {k: v.shape for k, v in parallel.items()} == {k: v.shape for k, v in single.items()}
    assert max((parallel[k] - single[k]).abs().max().item() for k in single) <= 1e-4
    if sp == "true":  # the gathered weights are a plain model: generate reads them
        out = run_meshlm("generate", "--checkpoint", str(tmp_path), "--prompt", "The ", "--max-new-tokens", "8",
                         in_process=True).stdout
        assert out.startswith("The ")
