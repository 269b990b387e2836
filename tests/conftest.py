import os

import pytest
import torch

# One intra-op thread: the suite forks many ranks onto 2 cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Forked ranks must not inherit the tokenizers thread pool (it warns and disables itself).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
