"""The Ray metrics backend: `vela_ray.observability.metrics.METRICS` exported through `ray.util.metrics`.

It lives here, with the actors, because it imports Ray and the model side never does
(`MetricsSink` and `MemoryMetricsBackend` stay in `vela_ray.observability.metrics`).
The runtime inside Ray builds the sink with it:

    sink = MetricsSink(RayMetricsBackend())

Ray exports a metric only from processes inside a Ray job (driver, actors, tasks),
through the node's metrics agent, with a `ray_` prefix.
"""

from __future__ import annotations

import threading
import time

from ray.util import metrics as ray_metrics

from vela_ray.observability.metrics import METRICS, TagKey, tag_key


class RayMetricsBackend:
    """`ray.util.metrics` objects, one per `METRICS` entry, created on first use in this process.

    Ray exports a gauge only while it is being set: its metrics agent drops a series not
    refreshed for two report intervals (RAY_metrics_report_interval_ms, 10 s by default).
    A placement version set once, or a loss between two 30-second steps, would vanish, so
    a daemon thread re-sets every gauge's last value each `refresh_s` seconds.
    """

    def __init__(self, refresh_s: float = 2.0) -> None:
        self._metrics: dict[str, object] = {}
        self._gauges: dict[tuple[str, TagKey], float] = {}
        self._lock = threading.Lock()
        self._refresher = threading.Thread(target=self._refresh_gauges, args=(refresh_s,), daemon=True,
                                           name="vela-metrics-gauges")
        self._refresher.start()

    def _metric(self, name: str):
        if name not in self._metrics:
            self._metrics[name] = _declare(name)
        return self._metrics[name]

    def inc(self, name: str, value: float, tags: dict[str, str]) -> None:
        self._metric(name).inc(value, tags=tags)

    def set(self, name: str, value: float, tags: dict[str, str]) -> None:
        with self._lock:
            self._gauges[(name, tag_key(tags))] = value
            self._metric(name).set(value, tags=tags)

    def observe(self, name: str, value: float, tags: dict[str, str]) -> None:
        self._metric(name).observe(value, tags=tags)

    def _refresh_gauges(self, every_s: float) -> None:
        while True:
            time.sleep(every_s)
            with self._lock:
                for (name, tags), value in self._gauges.items():
                    self._metric(name).set(value, tags=dict(tags))


def _declare(name: str):
    """The Ray metric object for one `METRICS` entry."""
    spec = METRICS[name]
    if spec.kind == "counter":
        # Ray's exporter appends `_total` to counters itself; declare the bare name.
        return ray_metrics.Counter(spec.name.removesuffix("_total"), spec.description, spec.tags)
    if spec.kind == "gauge":
        return ray_metrics.Gauge(spec.name, spec.description, spec.tags)
    return ray_metrics.Histogram(spec.name, spec.description, list(spec.boundaries), spec.tags)
