"""Test-wide settings: small thread pools (CI has 2 cores) and quiet libraries."""

import os
import tempfile

import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the `datasets` Arrow cache of the records files tests write: per run, not in the user's ~/.cache
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="vela-tests-datasets-"))
torch.set_num_threads(min(2, torch.get_num_threads()))
