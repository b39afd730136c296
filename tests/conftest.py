"""Test-wide settings: small thread pools (CI has 2 cores) and quiet libraries."""

import os
import tempfile

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the `datasets` Arrow cache of the records files tests write: per run, not in the user's ~/.cache
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="vela-tests-datasets-"))
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests need a CUDA device: skipped, saying so, where there is none (`make test-gpu` runs them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
