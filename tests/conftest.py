"""Test-wide settings: small thread pools (CI has 2 cores) and quiet libraries."""

import os
import tempfile

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the `datasets` Arrow cache of the records files tests write: per run, not in the user's ~/.cache
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="vela-tests-datasets-"))
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module of tiny models (`pytestmark = pytest.mark.usefixtures(...)`): a
    second OpenMP thread only spin-waits at barriers on a shared 2-core machine, many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests need a CUDA device: skipped, saying so, where there is none (`make test-gpu` runs them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
