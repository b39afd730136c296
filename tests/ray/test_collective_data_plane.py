"""The collective transport's split planes between real ExpertManager actors: which backend carries the
rows, a SIGKILLed worker ending in the named `PeerLostError` within 30 s, never a hang, and a plane that
cannot form named with its fix.

(The protocol itself, in one process with no Ray: tests/unit/test_collective_planes.py.)
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
import torch

from actors.transports import collective_transport
from tests.ray.helpers import (
    HIDDEN, NUM_WORKERS, TIMEOUT_S, specs_for, split_weights, synthetic_placement, synthetic_weights,
)
from vela_ray.errors import ClusterError
from vela_ray.model.collective import PeerLostError
from vela_ray.model.transport import ForwardRequest


def _requests(layer: int = 0) -> dict[int, ForwardRequest]:
    placement = synthetic_placement()[layer].tolist()
    return {w: ForwardRequest(layer, torch.tensor([placement.index(w)] * 2), torch.randn(2, HIDDEN), None)
            for w in range(NUM_WORKERS)}


@pytest.mark.timeout(180)
def test_the_data_backend_can_be_forced_and_results_come_back_on_its_device(synthetic_cluster):
    """(The automatic choice on these CPU actors, gloo: tests/ray/test_transport_conformance.py.)"""
    cluster = synthetic_cluster
    transport = collective_transport(cluster.handles, cluster.worker_tiers(), timeout_s=TIMEOUT_S,
                                     data_backend="gloo")
    try:
        assert transport.data.backend == "gloo" and transport.data.group is not transport.group
        outputs = transport.forward(_requests())
        assert all(out.device.type == "cpu" and out.shape == (2, HIDDEN) for out in outputs.values())
    finally:
        transport.close()


@pytest.mark.timeout(180)
def test_a_sigkilled_worker_ends_in_peer_lost_naming_it_within_30s(ray_pool):
    cluster = ray_pool.spawn(specs_for(split_weights(synthetic_weights(), synthetic_placement(), NUM_WORKERS)))
    transport = ray_pool.track(collective_transport(cluster.handles, cluster.worker_tiers(), timeout_s=TIMEOUT_S))
    assert len(transport.forward(_requests())) == NUM_WORKERS  # both planes up and serving
    os.kill(ray.get(cluster.handles[1].report.remote(), timeout=TIMEOUT_S).pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(PeerLostError, match="expert worker 1") as caught:
        for _ in range(100):  # the kill lands within a call or two
            transport.forward(_requests())
            time.sleep(0.05)
    assert caught.value.worker == 1
    assert time.monotonic() - killed < 30  # noticed through the closed connection, not a timeout (60 s)
    with pytest.raises(RuntimeError, match="lost a worker"):
        transport.forward(_requests())


@ray.remote(num_cpus=0)
class _UnreachableWorker:
    """An actor asked to join the data plane whose connection never arrives, as from a node whose TCP to the
    master is firewalled (only Ray's own ports open)."""

    def join_collective(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        time.sleep(timeout_s + 30)


@pytest.mark.timeout(120)
def test_a_plane_that_cannot_form_says_so_in_one_line_with_the_fix(ray_session):
    unreachable = [_UnreachableWorker.remote() for _ in range(2)]
    try:
        start = time.monotonic()
        with pytest.raises(ClusterError) as caught:
            collective_transport(unreachable, ["cross_node"] * 2, join_timeout_s=3)
        assert time.monotonic() - start < 30
        message = str(caught.value)
        assert "\n" not in message and message.startswith("the collective data plane did not form within 3 s (")
        assert "set data_plane.transport: object_ref" in message
    finally:
        for actor in unreachable:
            ray.kill(actor)
