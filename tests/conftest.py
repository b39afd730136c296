"""Test-wide settings: small thread pools (CI has 2 cores) and quiet libraries."""

import os

import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))
