"""Failures inside an ExpertManager reach the driver with the worker's traceback and index, never a hang."""

from __future__ import annotations

import pickle

import pytest
import torch

from vela_ray.errors import ExpertWorkerError
from actors.transports import RayObjectRefTransport, collective_transport
from tests.ray.helpers import HIDDEN, TIMEOUT_S, synthetic_placement
from vela_ray.model.transport import ForwardRequest

TRANSPORTS = {"object_refs": RayObjectRefTransport, "collective": collective_transport}


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request, synthetic_cluster):
    cluster = synthetic_cluster
    built = TRANSPORTS[request.param](cluster.handles, cluster.worker_tiers(), timeout_s=TIMEOUT_S)
    yield built
    built.close()


def _expert_of(worker: int, layer: int = 0) -> int:
    return next(e for e, w in enumerate(synthetic_placement()[layer].tolist()) if w == worker)


@pytest.mark.timeout(120)
def test_exception_in_expert_forward_names_worker_and_carries_its_traceback(transport):
    expert = _expert_of(1)
    # rows one wider than the experts' hidden size: the matmul inside the expert fails
    bad = ForwardRequest(0, torch.tensor([expert, expert]), torch.randn(2, HIDDEN + 1), ("bad", 1))
    with pytest.raises(ExpertWorkerError, match="expert worker 1") as caught:
        transport.forward({1: bad})
    assert caught.value.worker == 1
    text = str(caught.value)
    assert f"(0, {expert})" in text  # the experts involved
    assert "forward_rows" in text and "experts.py" in text  # the worker's own traceback
    assert "RuntimeError" in text  # the matmul's own error (its wording depends on the experts kernel)


@pytest.mark.timeout(120)
def test_backward_without_forward_names_worker_and_key(transport):
    with pytest.raises(ExpertWorkerError, match=r"expert worker 2: backward of key \('never', 0\)"):
        transport.backward(("never", 0), {2: torch.ones(1, HIDDEN)})


@pytest.mark.timeout(120)
def test_failure_on_one_worker_leaves_the_others_usable(transport):
    bad = ForwardRequest(0, torch.tensor([_expert_of(1)]), torch.randn(1, HIDDEN + 1), None)
    good = ForwardRequest(0, torch.tensor([_expert_of(0)]), torch.randn(1, HIDDEN), None)
    with pytest.raises(ExpertWorkerError):
        transport.forward({0: good, 1: bad})
    assert transport.forward({0: good})[0].shape == (1, HIDDEN)


def test_expert_worker_error_survives_pickling():
    error = pickle.loads(pickle.dumps(ExpertWorkerError(3, "forward of experts [(0, 1)] failed")))
    assert (error.worker, error.message) == (3, "forward of experts [(0, 1)] failed")
    assert str(error) == "expert worker 3: forward of experts [(0, 1)] failed"
