"""Dtype names, as configs and specs write them, and the torch dtypes they stand for: the one translation.

    torch_dtype("bfloat16")      # torch.bfloat16
    torch_dtype(torch.float32)   # already a dtype: returned as is

`JobConfig.torch_dtype`, the ExpertManagers' `spec.dtype`, checkpoints' `config.json` dtypes and the
benchmarks' `--dtype` flags all go through `torch_dtype`, so a name means the same everywhere.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # some checkpoints' config.json say it; vela trains in the first three
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype `name` stands for; a torch dtype passes through. ValueError naming the known names."""
    if isinstance(name, torch.dtype):
        return name
    dtype = DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not one vela-ray knows: use one of {', '.join(DTYPES)}")
    return dtype
