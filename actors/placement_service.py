"""PlacementService: measure the master's link to every ExpertManager, for the placement.

It runs in the master's process (`actors.pool.RayWorkerPool.measure_links`), so the bandwidth it
measures to each ExpertManager is the master's link to it, over the data plane the broker's rows take:
the collective plane's own ping (`collective_ping`: gloo's TCP, or NCCL) or Ray calls carrying the payload
(`ray_ping`, the object-ref plane); either way the payload goes one way and a small answer comes back. The
two differ most within a node, where Ray's objects go through shared memory and the collective plane through
the loopback. The placement itself is a pure function of what is
measured (`vela_ray.runtime.placer.placement_problem`, then `placement.solve`), solved by the job runner.

    service = PlacementService(ray_ping(handles))            # or collective_ping(transport)
    links = service.probe(range(len(handles)))               # [LinkRecord], one per worker
    nics = service.probe_shared({"nic:node1": [2, 3]})       # {name: bytes/s}
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import ray
import torch

from vela_ray.training.summary import LinkRecord

logger = logging.getLogger(__name__)

PROBE_SIZES = (16 << 10, 256 << 10, 2 << 20, 8 << 20)  # bytes per probe message
LATENCY_REPEATS = 10  # empty calls per link, the fastest taken as its latency


Ping = Callable[[list[int], torch.Tensor], int]
"""Send `payload` to each of these workers over a data plane and wait for their (small) answers; returns the bytes
sent."""


def ray_ping(handles: Sequence[Any]) -> Ping:
    """The object-ref plane's: a Ray call to each worker's `ping` carrying the payload, its answer a number."""
    def ping(workers: list[int], payload: torch.Tensor) -> int:
        ray.get([handles[w].ping.remote(payload) for w in workers])
        return payload.numel() * payload.element_size() * len(workers)
    return ping


def collective_ping(transport: Any) -> Ping:
    """The collective plane's: the payload to each worker over its data plane, one element back
    (`vela_ray.model.collective.CollectiveTransport.ping`)."""
    def ping(workers: list[int], payload: torch.Tensor) -> int:
        return transport.ping({w: payload.reshape(-1, 1) for w in workers})
    return ping


def fit_link(samples: Sequence[tuple[int, float]], latency_s: float) -> LinkRecord:
    """The link of `latency_s` (an empty call's round trip) whose bandwidth fits seconds = a + bytes / bandwidth
    over the `samples` (least squares, bandwidth kept positive).

    The latency is timed, not the fit's intercept: the samples reach megabytes, where a millisecond of the
    intercept is lost in their scatter, and it came out 5 ms on same-node links whose empty calls take 1 ms
    and 0 on cross-node ones (a step pays it on every call: a layer's 8 calls a step then cost 40 ms)."""
    sizes = np.array([s for s, _ in samples], dtype=np.float64)
    times = np.array([t for _, t in samples], dtype=np.float64)
    slope = max(np.polyfit(sizes, times, 1)[0], 1e-15)
    return LinkRecord(latency_s=latency_s, bandwidth_bytes_per_s=1.0 / slope)


class PlacementService:
    """The link probes, called in the master's process over `ping`, the data plane the rows take."""

    def __init__(self, ping: Ping):
        self.ping = ping

    def probe(self, workers: Iterable[int], sizes: Sequence[int] = PROBE_SIZES, repeats: int = 3,
              enough_s: float = 0.1) -> list[LinkRecord]:
        """Time pings with payloads of several sizes to each worker alone; fit each worker's link.

        One worker at a time: the cost model takes per-worker links, and what links share
        (a NIC) separately (`probe_shared`). (Probing all workers at once, as the broker sends,
        folds the shared NIC into every link; in the vela-vs-EP benchmark that over-predicted the
        communication time of spread placements 2.5x, while probing alone predicted it within 35%.)
        Sizes grow until a message takes `enough_s` (after at least two sizes): 8 MB over
        100 Mbit/s would cost seconds per sample.
        """
        links = []
        for worker in workers:
            links.append(self._fit([worker], sizes, repeats, enough_s))
            logger.info("link to worker %d: %.3g GB/s, %.0f us latency", worker,
                        links[-1].bandwidth_bytes_per_s / 1e9, links[-1].latency_s * 1e6)
        return links

    def probe_shared(self, groups: dict[str, list[int]], sizes: Sequence[int] = PROBE_SIZES,
                     repeats: int = 3, enough_s: float = 0.1) -> dict[str, float]:
        """Bandwidth (bytes/s) of what each group of workers shares, e.g. a node's NIC: the same
        messages to all of the group's workers at once, total bytes fitted against the time."""
        bandwidths = {}
        for name, workers in groups.items():
            bandwidths[name] = self._fit(workers, sizes, repeats, enough_s).bandwidth_bytes_per_s
            logger.info("shared link %s (workers %s): %.3g GB/s", name, workers, bandwidths[name] / 1e9)
        return bandwidths

    def _fit(self, workers: list[int], sizes: Sequence[int], repeats: int, enough_s: float) -> LinkRecord:
        """seconds = latency + bytes / bandwidth over `workers` probed at once (bytes: all of them together); the
        latency an empty call's best round trip (`fit_link`)."""
        empty = torch.zeros(1)
        self.ping(workers, empty)  # warm the paths
        latency = min(self._time(workers, empty)[0] for _ in range(LATENCY_REPEATS))
        samples = []
        for size in sizes:
            payload = torch.zeros(size // 4, dtype=torch.float32)
            best, moved = min(self._time(workers, payload) for _ in range(repeats))
            samples.append((moved, best))
            if len(samples) >= 2 and best >= enough_s:
                break
        return fit_link(samples, latency)

    def _time(self, workers: list[int], payload: torch.Tensor) -> tuple[float, int]:
        start = time.perf_counter()
        moved = self.ping(workers, payload)
        return time.perf_counter() - start, moved
