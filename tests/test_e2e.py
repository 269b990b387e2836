"""End to end through the real launch path: two nodes on this machine through `meshlm train
--nnodes 2` (torchrun, c10d rendezvous) against one process, the run-directory contract, and
`meshlm generate` on the result."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers import cli_train_args, free_port, no_rank_left, read_metrics, run_meshlm

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
    assert "communication on rank" not in proc.stdout  # one process: no collective to summarise
    # 4 steps under the default 30 warmup steps: the schedule never reaches its peak, and says so,
    # with the rate of the last update (step 3 of 0-3: 4/30 of train.lr=1e-3)
    assert (f"warning: train.warmup_steps=30 >= train.steps=4: the learning rate never leaves its warmup (it ends "
            f"at {1e-3 * 4 / 30:.3g}, not at train.lr, and never decays to min_lr)") in proc.stdout
    # the memory model's prediction before step 1, the measured peak beside it at the end
    assert [line.split(" peak")[0] for line in proc.stdout.splitlines() if line.startswith("memory: ")] == \
        ["memory: predicted", "memory: measured"]


def start_node(corpus, run_dir, node_rank: int, port: int, *extra: str) -> subprocess.Popen:
    # Each node its own run.dir, as on machines that share no filesystem: so no checkpoints.
    args = [*cli_train_args(corpus, run_dir, "parallel.dp=2", "checkpoint.interval=0", *extra), "--nnodes", "2",
            "--node-rank", str(node_rank), "--rdzv-endpoint", f"127.0.0.1:{port}"]
    return subprocess.Popen([sys.executable, "-m", "meshlm.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def run_two_nodes(corpus, tmp_path, *extra: str, timeout: float) -> tuple[dict, dict, dict]:
    """Two launchers, node 1 started first, each with its own run.dir: (dirs, outputs, exit codes)."""
    port, dirs = free_port(), {r: tmp_path / f"node{r}" for r in (1, 0)}
    nodes = {r: start_node(corpus, dirs[r], r, port, *extra) for r in dirs}
    try:
        out = {r: node.communicate(timeout=timeout) for r, node in nodes.items()}
    finally:
        for node in nodes.values():
            node.kill()
    return dirs, out, {r: node.returncode for r, node in nodes.items()}


def test_two_nodes_through_torchrun_follow_the_single_process_loss_curve_and_both_exit_zero(
        corpus, single_cli_run, tmp_path):
    """Two ranks through torchrun with the same checks as the `--nproc 2` run this file had (loss,
    eval loss, rank 1's log): that run's launch path, torchrun --standalone, is still run end to end
    by the CLI tests of test_fsdp, test_pipeline, test_tensor_parallel_e2e and test_checkpoint_cli.

    Node 1 starts first: the rendezvous orders nodes by host name and launcher pid, so global rank
    0 runs on node 1, the case where node 0 went on to print a sample from a final/ it did not
    have and exited 2."""
    dirs, out, codes = run_two_nodes(corpus, tmp_path, timeout=240)
    assert codes == {1: 0, 0: 0}, out
    (rank0_node,) = [r for r in dirs if "--- sample" in out[r][0]]  # exactly one node prints it
    other = 1 - rank0_node
    assert f"global rank 0 ran on node {rank0_node}" in out[other][0] and "--- sample" not in out[other][0]
    reference, two_nodes = read_metrics(single_cli_run[0]), read_metrics(dirs[rank0_node])
    assert [r["loss"] for r in two_nodes] == pytest.approx([r["loss"] for r in reference], abs=1e-5)
    assert [r["eval_loss"] for r in two_nodes if "eval_loss" in r] == pytest.approx(
        [r["eval_loss"] for r in reference if "eval_loss" in r], abs=1e-5)
    assert (dirs[other] / "logs" / "rank1.log").exists() and not (dirs[other] / "metrics.jsonl").exists()
    assert "dp=2" in out[0][0] and "dp=2" in out[1][0]
    for run_dir in dirs.values():
        no_rank_left(run_dir)


def test_a_signal_stops_two_nodes_that_share_no_run_dir_without_a_checkpoint(corpus, tmp_path):
    """Without one run.dir there is nowhere to put a checkpoint's shards together: a SIGTERM to one
    node's launcher stops both after the same step, saving nothing (a save hung global rank 0,
    waiting for a shard written into the other node's directory), and both exit 0 saying so."""
    import signal
    import time

    port, dirs = free_port(), {r: tmp_path / f"node{r}" for r in (1, 0)}
    nodes = {r: start_node(corpus, dirs[r], r, port, "train.steps=400", "train.eval_interval=0") for r in dirs}
    try:
        deadline = time.monotonic() + 120
        while not any((d / "metrics.jsonl").exists() and (d / "metrics.jsonl").read_text().count("\n") >= 2
                      for d in dirs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        nodes[0].send_signal(signal.SIGTERM)
        out = {r: node.communicate(timeout=90) for r, node in nodes.items()}
    finally:
        for node in nodes.values():
            node.kill()
    assert {r: node.returncode for r, node in nodes.items()} == {1: 0, 0: 0}, out
    for r in dirs:
        assert "no checkpoint (the nodes do not share run.dir), so the run cannot be continued" in out[r][0], out[r]
        assert not (dirs[r] / "checkpoints").exists() and not (dirs[r] / "final").exists()
        no_rank_left(dirs[r])


@pytest.mark.parametrize("restarts", [0, 2])
def test_a_config_error_only_the_ranks_can_find_exits_2_on_every_node(corpus, tmp_path, restarts):
    """Checkpoints into run.dirs the nodes do not share: found when the ranks meet (no launcher can
    see the other node's filesystem), reported in one line and exit 2 as a bad config is. With
    --max-restarts, torchrun restarts on any failure: the later attempts exit 2 at once, saying
    nothing more (they restarted into the same error, "restart k of n" each time)."""
    dirs, out, codes = run_two_nodes(corpus, tmp_path, "checkpoint.interval=100", "--max-restarts", str(restarts),
                                     timeout=120)
    assert codes == {1: 2, 0: 2}, out
    for r in dirs:
        errors = [line for line in out[r][1].splitlines() if line.startswith("meshlm:")]
        assert len(errors) == 1 and errors[0].startswith("meshlm: error: checkpoint.interval: rank "), out[r][1]


def _meet_rank0(run_dirs, interval):
    """One rank per "node" (forked), each with its own run.dir from `run_dirs`."""
    import torch.distributed as dist

    from meshlm.errors import ConfigError
    from meshlm.train.rank0_node import meet_rank0

    rank = dist.get_rank()
    os.environ.update(GROUP_WORLD_SIZE="2", LOCAL_RANK="0", MESHLM_NODE_RANK=str(7 + rank),
                      MESHLM_LAUNCH_ID=f"launch{rank}")
    cfg = SimpleNamespace(run=SimpleNamespace(dir=str(run_dirs[rank])), checkpoint=SimpleNamespace(interval=interval))
    try:
        here = meet_rank0(cfg)  # None: every rank sees rank 0's run.dir
    except ConfigError as e:
        return str(e)
    return here


def test_each_node_notes_where_rank_0_ran_and_checkpoints_need_one_shared_run_dir(tmp_path):
    from meshlm.testing import run_ranks
    from meshlm.train.rank0_node import rank0_elsewhere

    apart = [tmp_path / "a", tmp_path / "b"]
    for d in apart:
        d.mkdir()
    assert run_ranks(_meet_rank0, 2, apart, 0) == [[0], [1]]  # no checkpoints: separate run.dirs do, each its ranks
    assert rank0_elsewhere(apart[0], "launch0") is None  # the launcher of rank 0
    assert rank0_elsewhere(apart[1], "launch1")["node_rank"] == 7  # the other: where rank 0 ran
    assert rank0_elsewhere(apart[1], "launch1")["run_dir"] == str(apart[0].resolve())
    errors = run_ranks(_meet_rank0, 2, apart, 100)  # a checkpoint would be split across the nodes
    assert errors[0] == errors[1] and errors[0].startswith("checkpoint.interval: rank 1 ") and "\n" not in errors[0]
    assert run_ranks(_meet_rank0, 2, [tmp_path / "a"] * 2, 100) == [None, None]  # one shared run.dir
    assert [p.name for p in tmp_path.glob("*/.rank0-probe-*")] == []  # the probes are gone
    assert json.loads((tmp_path / "a" / "rank0.json").read_text())["launch"] == "launch0"


def test_generate_needs_nothing_of_the_training_data(single_cli_run, tmp_path):
    """A run trained on a blend whose corpora are gone since: generate reads the weights, the
    config and the tokenizer saved beside them, and checks nothing that only training needs."""
    import shutil

    run_dir, _ = single_cli_run
    shutil.copytree(run_dir / "final", tmp_path / "final")
    config = (tmp_path / "final" / "config.toml").read_text()
    config = "\n".join(line for line in config.splitlines() if not line.startswith("path = "))
    config = config.replace("[data]", '[data]\nblend = [[1.0, "/gone/corpus"]]')
    (tmp_path / "final" / "config.toml").write_text(config)
    out = run_meshlm("generate", "--checkpoint", str(tmp_path / "final"), "--prompt", "The ", "--max-new-tokens", "4",
                     in_process=True).stdout
    assert out.startswith("The ")


def test_an_empty_prompt_starts_after_the_end_of_text_token():
    """meshlm's BPE has it at id 0; a pretrained tokenizer anywhere (GPT-2's is 50256)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from meshlm.train.generate import start_ids

    words = Tokenizer(WordLevel({"!": 0, "the": 1, "<|endoftext|>": 7}, unk_token="!"))
    words.pre_tokenizer = Whitespace()
    assert start_ids(words, "") == [7] and start_ids(words, "the") == [1]
    no_end = Tokenizer(WordLevel({"!": 0, "the": 1}, unk_token="!"))
    assert start_ids(no_end, "") == [0]


def test_a_prompt_is_encoded_as_the_training_data_was_with_no_bos():
    """A Llama tokenizer's post-processor puts a BOS in front of every encode(); meshlm's data is
    encoded without it (tokenizer.encode), so a prompt is too: the model never saw that token
    (it prefixed every prompt, and an empty prompt started from it instead of end-of-text). An
    empty prompt starts after the run's own separator (`end_id`), not the first known name."""
    from tokenizers import Tokenizer, processors
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from meshlm.train.generate import start_ids

    words = Tokenizer(WordLevel({"!": 0, "the": 1, "<s>": 5, "<|endoftext|>": 7, "<|eot_id|>": 8}, unk_token="!"))
    words.pre_tokenizer = Whitespace()
    words.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 5)])
    assert words.encode("the").ids == [5, 1]
    assert start_ids(words, "the") == [1] and start_ids(words, "") == [7]
    assert start_ids(words, "", end_id=8) == [8] and start_ids(words, "the", end_id=8) == [1]


def test_generate_continues_the_prompt(single_cli_run):
    run_dir, _ = single_cli_run
    out = run_meshlm("generate", "--checkpoint", str(run_dir), "--prompt", "The ", "--max-new-tokens", "12",
                     in_process=True).stdout
    assert out.startswith("The ") and len(out) > len("The ") + 5
    greedy = [run_meshlm("generate", "--checkpoint", str(run_dir / "final"), "--prompt", "The ", "--max-new-tokens",
                         "8", "--temperature", "0", in_process=True).stdout for _ in range(2)]
    assert greedy[0] == greedy[1]
    # a tiny temperature is nearly greedy (logits / 1e-40 overflowed: inf - inf, NaN probabilities)
    assert run_meshlm("generate", "--checkpoint", str(run_dir / "final"), "--prompt", "The ", "--max-new-tokens",
                      "8", "--temperature", "1e-40", in_process=True).stdout == greedy[0]
