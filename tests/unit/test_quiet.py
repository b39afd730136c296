"""The warnings vela-ray triggers knowingly stay silenced, and nothing else is.

A whole local run (build, train, eval, export, import) under `silence_known_warnings` must
warn nothing at all, so a new warning from our code or a library fails here instead of
repeating in every actor's log. Ray's zero-copy warnings are reproduced in a fresh process
(torch warns about a read-only NumPy array once per process), with a control run showing
that they still occur without the filters, so a filter that stops matching is noticed.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings

import pytest
import torch

from vela_ray.model.experts import LoraSpec
from vela_ray.model.families import debug_model
from vela_ray.quiet import RAY_TOKEN_AUTH_LOGGER, silence_known_warnings
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.training.adapter_io import export, import_adapter
from vela_ray.training.master import build_local
from vela_ray.training.step import eval_loss, train_step


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


_HIGHS = """
import sys
import numpy as np
if sys.argv[1] == "placement":
    from placement import PlacementProblem, solve_lp
    problem = PlacementProblem(probs=np.array([[1.0, 0.6, 0.4, 0.0]]), top_k=2, tokens_per_step=64, hidden_size=8,
                               bandwidths=[1e9, 1e8], capacities=[2, 2])
    assert solve_lp(problem)[0] > 0
else:  # what placement.lp solves with, built plainly: the control
    import highspy
    highspy.Highs()
"""


def test_a_placement_solve_prints_no_highs_banner_and_a_plain_highs_object_still_does():
    """HiGHS writes its banner to fd 1 (C stdio, flushed at exit), so each case runs in a fresh process."""
    def stdout_of(mode: str) -> str:
        return subprocess.run([sys.executable, "-c", _HIGHS, mode], capture_output=True, text=True, check=True).stdout

    assert "Running HiGHS" in stdout_of("highspy")
    assert stdout_of("placement") == ""


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_rays_token_auth_notice_is_silenced_and_its_disabled_warning_is_not():
    from ray._private.authentication import authentication_token_setup as token_setup

    assert token_setup.logger.name == RAY_TOKEN_AUTH_LOGGER
    silence_known_warnings()
    records = _Records()  # Ray's loggers do not propagate to the root logger (nor to caplog)
    token_setup.logger.addHandler(records)
    try:
        token_setup._warn_token_auth_enabled()  # what ray.init says when it starts a local cluster
        token_setup._warn_token_auth_disabled()
    finally:
        token_setup.logger.removeHandler(records)
    assert len(records.messages) == 1 and records.messages[0].startswith("Token authentication is disabled")
