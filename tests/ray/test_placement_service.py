"""PlacementService: a link's latency is an empty call's timed round trip, its bandwidth the probes' slope."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from actors.placement_service import PlacementService, ray_ping

DELAY_S = 0.005  # what every call costs the stand-in worker, whatever it carries
RATE = 1e6  # bytes/s its link carries on top of that, beyond the delay


@ray.remote(num_cpus=0)
class SlowPing:
    """A worker whose call takes max(DELAY_S, bytes / RATE): a fixed cost that a transfer of any probe size hides,
    so a line fitted through the probe sizes meets zero seconds near zero bytes (intercept <= 0)."""

    def ping(self, payload: torch.Tensor | None = None) -> int:
        size = 0 if payload is None else payload.numel() * payload.element_size()
        time.sleep(max(DELAY_S, size / RATE))
        return 0


def test_the_latency_is_an_empty_calls_round_trip_not_the_fits_intercept(ray_session):
    worker = SlowPing.remote()
    (link,) = PlacementService(ray_ping([worker])).probe([0], sizes=(16 << 10, 64 << 10, 256 << 10), enough_s=1.0)
    # the fit's intercept here is ~0 (16 KiB take 16 ms, 64 KiB 64 ms, ...); an empty call takes DELAY_S
    assert DELAY_S <= link.latency_s < DELAY_S + 0.02
    assert link.bandwidth_bytes_per_s == pytest.approx(RATE, rel=0.3)
