"""The warnings vela-ray triggers knowingly stay silenced, and nothing else is.

A whole local run (build, train, eval, export, import) under `silence_known_warnings` must
warn nothing at all, so a new warning from our code or a library fails here instead of
repeating in every actor's log. Ray's zero-copy warnings are reproduced in a fresh process
(torch warns about a read-only NumPy array once per process), with a control run showing
that they still occur without the filters, so a filter that stops matching is noticed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from vela_ray.model.experts import LoraSpec
from vela_ray.model.families import debug_model
from vela_ray.quiet import silence_known_warnings
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.training.step import build_local, eval_loss, export, import_adapter, train_step


def _local_run(out_dir) -> None:
    table = torch.tensor([[0, 1, 2, 0, 1, 2], [2, 1, 0, 2, 1, 0]])
    master, workers = build_local(debug_model("mixtral"), table, LoraSpec(4, 8), OptimizerConfig(), seed=0)
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    train_step(master, workers, [batch], lr=1e-3, max_grad_norm=1.0)
    eval_loss(master, [batch])
    export(master, workers, out_dir)
    import_adapter(master, workers, out_dir)


def test_a_local_run_warns_nothing_once_the_known_warnings_are_silenced(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_known_warnings()
        _local_run(tmp_path)
    assert [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught] == []


_RAY_ZERO_COPY = """
import json, pickle, sys, warnings
warnings.simplefilter("always")
import torch
import ray.cloudpickle as cloudpickle
from ray._private import tensor_serialization_utils
from vela_ray.quiet import silence_known_warnings

if sys.argv[1] == "silenced":
    silence_known_warnings()
with warnings.catch_warnings(record=True) as caught:
    # what Ray registers in a process started with RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1
    cloudpickle.CloudPickler.dispatch[torch.Tensor] = tensor_serialization_utils.zero_copy_tensors_reducer
    buffers = []
    data = cloudpickle.dumps(torch.arange(4.0), protocol=5, buffer_callback=buffers.append)
    received = pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])  # read-only, like Ray's buffer
assert received.tolist() == [0.0, 1.0, 2.0, 3.0]
print(json.dumps([str(w.message) for w in caught]))
"""


def _zero_copy_warnings(mode: str) -> list[str]:
    """The warning messages of one fresh process (torch warns about read-only arrays once per process)."""
    out = subprocess.run([sys.executable, "-c", _RAY_ZERO_COPY, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_rays_zero_copy_warnings_are_silenced_and_still_occur_without_the_filters():
    unfiltered = _zero_copy_warnings("unfiltered")
    assert any(m.startswith("Zero-copy tensor serialization is enabled") for m in unfiltered), unfiltered
    assert any(m.startswith("The given NumPy array is not writable") for m in unfiltered), unfiltered
    assert _zero_copy_warnings("silenced") == []
