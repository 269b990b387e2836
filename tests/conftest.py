import os

import pytest
import torch

# One intra-op thread: the suite forks many ranks onto 2 cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Forked ranks must not inherit the tokenizers thread pool (it warns and disables itself).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The offline corpus, one per test session, so its tokenizer cache is built once."""
    from helpers import write_offline_corpus

    return write_offline_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def saved(corpus, tmp_path_factory):
    """layout -> (run dir, checkpoint, full weights) of hf_saved.SAVED, each made on first use: one
    set for the Hugging Face export and import tests."""
    from hf_saved import saved_runs

    return saved_runs(corpus, tmp_path_factory)


@pytest.fixture(scope="session")
def single_cli_run(corpus, tmp_path_factory):
    """One rank through `meshlm train` (helpers.cli_train_args), in this process: the reference loss
    curve the end-to-end tests of every layout compare with. Returns (run dir, completed process)."""
    from helpers import cli_train_args, run_meshlm

    run_dir = tmp_path_factory.mktemp("single-cli-run")
    return run_dir, run_meshlm(*cli_train_args(corpus, run_dir), in_process=True)
