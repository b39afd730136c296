"""`SplitTransport` (`cluster.workers_on_master`): workers 0..A-1 behind one transport, A.. in this process.

Both halves are in-process here, so the split itself is what is tested: worker numbering, the merge,
the remote half running on its own thread while the local half computes, and an error on either side.
A whole Ray job with a worker in the master's process is in tests/ray/test_job_runtime.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.ray.helpers import (
    HIDDEN, NUM_WORKERS, random_lora_state, split_weights, synthetic_placement, synthetic_prototypes,
    synthetic_weights,
)
from tests.equivalence import LORA
from vela_ray.model.experts import ExpertShard
from vela_ray.model.transport import ForwardRequest, InProcessTransport, SplitTransport


def _shards() -> list[ExpertShard]:
    shards = [ExpertShard.from_weights(part, LORA, synthetic_prototypes())
              for part in split_weights(synthetic_weights(), synthetic_placement(), NUM_WORKERS)]
    for shard in shards:
        shard.load_lora_state(random_lora_state(shard.keys))
    return shards


def _requests(layer: int, key) -> dict[int, ForwardRequest]:
    placement, g = synthetic_placement()[layer], torch.Generator().manual_seed(layer)
    requests = {}
    for worker in range(NUM_WORKERS):
        experts = [e for e in range(len(placement)) if int(placement[e]) == worker]
        if experts:
            ids = torch.tensor(experts).repeat_interleave(3)
            requests[worker] = ForwardRequest(layer, ids, torch.randn(len(ids), HIDDEN, generator=g), key)
    return requests


class _ThreadNoting(InProcessTransport):
    """An in-process transport that notes the thread each call ran on."""

    threads: list[str]

    def forward(self, requests):
        self.threads = [*getattr(self, "threads", []), threading.current_thread().name]
        return super().forward(requests)


@pytest.mark.parametrize("split", [1, NUM_WORKERS - 1])
def test_a_split_transport_answers_as_one_transport_over_all_workers(split):
    whole, parts = _shards(), _shards()
    remote = _ThreadNoting(parts[:split])
    transport = SplitTransport(remote, InProcessTransport(parts[split:]))
    assert transport.num_workers == NUM_WORKERS
    assert transport.worker_tiers() == ["same_process"] * NUM_WORKERS
    requests = _requests(1, key=("k", 1))
    got = transport.forward(requests)
    want = InProcessTransport(whole).forward(requests)
    assert got.keys() == want.keys() == requests.keys()
    for worker in requests:
        torch.testing.assert_close(got[worker], want[worker], rtol=0, atol=0)
    grads = {w: torch.randn_like(r.rows) for w, r in requests.items()}
    got_back, want_back = transport.backward(("k", 1), grads), InProcessTransport(whole).backward(("k", 1), grads)
    for worker in requests:
        torch.testing.assert_close(got_back[worker], want_back[worker], rtol=0, atol=0)
    assert remote.threads and all(name.startswith("vela-remote-rows") for name in remote.threads)
    transport.close()


def test_a_local_error_waits_for_the_remote_half_and_names_the_expert():
    parts = _shards()
    transport = SplitTransport(InProcessTransport(parts[:1]), InProcessTransport(parts[1:]))
    foreign = next(e for e in range(6) if int(synthetic_placement()[0][e]) != 1)
    good = _requests(0, key=None)
    bad = {**good, 1: ForwardRequest(0, torch.tensor([foreign]), torch.randn(1, HIDDEN), None)}
    with pytest.raises(KeyError, match=rf"l0_e{foreign}|\(0, {foreign}\)"):
        transport.forward(bad)
    assert transport.forward(good).keys() == good.keys()  # the transport goes on serving
    transport.close()
