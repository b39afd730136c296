"""vela metrics reach Prometheus: a Ray head with a known metrics port, a Ray actor feeding a MetricsSink
known traffic and routing counts, and a scrape of `http://127.0.0.1:PORT/metrics` whose values must equal them.

The actor runs in a driver subprocess connected to a `ray start` head (token auth on), like the
MasterActor of a real job; the test never calls `ray stop` (that would kill other tests' Ray) but kills
the head's own process group.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.ray.head import auth_env, free_port, ray_head
from vela_ray.observability.metrics import METRICS, PROMETHEUS_PREFIX

REPO = Path(__file__).resolve().parents[2]
TIERS = ["same_node", "cross_node", "cross_node"]  # worker 0 beside the master, workers 1-2 elsewhere

# Two steps of known data; the actor feeds exactly these (see FEEDER below).
ROWS_STEP = [[[3, 3, 3, 3], [5, 5, 5, 5], [0, 0, 0, 0]], [[1, 1, 1, 1], [2, 2, 2, 2], [4, 4, 4, 4]]]
ROW_BYTES = 64
COUNTS_LE = [[4, 0, 3, 1], [2, 2, 2, 2]]  # [L=2, E=4] rows routed per expert per step
GAUGE_TTL_S = 4.0  # Ray's agent drops a gauge not set for 2 report intervals (1 s here, see the fixture)

FEEDER = f"""
import sys, time
import numpy as np
import ray
from actors.metrics import RayMetricsBackend
from vela_ray.observability.metrics import MetricsSink
from vela_ray.model.traffic import TrafficCounter

@ray.remote(num_cpus=0)
class Feeder:
    def feed(self, steps):
        sink = MetricsSink(RayMetricsBackend())
        sink.set_placement(3, [[0, 0, 1, 2], [1, 2, 0, 0]], num_workers=3, expected_comm_time_s=0.5)
        counter = TrafficCounter(2, 3, {TIERS!r})
        for step in range(steps):
            before = counter.snapshot()
            for (layer, worker), rows in np.ndenumerate(np.asarray({ROWS_STEP!r})[:, :, 0]):
                for direction in ("dispatch", "gather", "grad_dispatch", "grad_gather"):
                    if rows:
                        counter.record(layer, worker, direction, int(rows), int(rows) * {ROW_BYTES})
            sink.record_step(step + 1, 2.0 - step, 0.25, 512, traffic_delta=counter.snapshot() - before,
                             expert_counts_LE=np.asarray({COUNTS_LE!r}), drift_L=np.array([0.1, 0.2]))
            sink.latency.observe(0, 0.003)
        return True

ray.init(address=sys.argv[1], log_to_driver=False)
feeder = Feeder.remote()
assert ray.get(feeder.feed.remote(int(sys.argv[2])))
print("fed", flush=True)
sys.stdin.read()  # stay connected (the actor's metrics stay exported) until the test closes stdin
"""


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line of a Prometheus text exposition."""
    samples = []
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)", line)
        if match and not line.startswith("#"):
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def _scrape_until(port: int, ready, timeout_s: float = 60) -> list:
    deadline, samples = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                samples = parse_prometheus(response.read().decode())
        except OSError:
            samples = []
        if ready(samples):
            return samples
        time.sleep(0.2)
    names = sorted({n for n, _, _ in samples if "vela" in n})
    raise TimeoutError(f"vela metrics incomplete after {timeout_s} s; vela series seen: {names}")


def _total(samples: list, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def _expected_bytes_by_tier(steps: int) -> dict[str, float]:
    rows_LN = np.asarray(ROWS_STEP)[:, :, 0]
    return {tier: float(steps * 4 * ROW_BYTES * rows_LN[:, [t == tier for t in TIERS]].sum())
            for tier in set(TIERS)}


@pytest.fixture
def metrics_head():
    """A `ray start --head` with token auth and a known metrics export port; yields (gcs address, port, env)."""
    env = auth_env(RAY_metrics_report_interval_ms="1000", PYTHONPATH=str(REPO))
    gcs_port, metrics_port = free_port(), free_port()
    with ray_head(env, f"--port={gcs_port}", "--num-cpus=1", f"--metrics-export-port={metrics_port}",
                  "--include-dashboard=false", wait_port=gcs_port):
        yield f"127.0.0.1:{gcs_port}", metrics_port, env


def test_scraped_vela_metrics_equal_the_fed_traffic_and_routing_counts(metrics_head):
    address, metrics_port, env = metrics_head
    steps = 2
    driver = subprocess.Popen([sys.executable, "-c", FEEDER, address, str(steps)], env=env, cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "fed", driver.stderr.read()[-3000:]
        fed_at = time.monotonic()
        traffic = PROMETHEUS_PREFIX + "vela_expert_traffic_bytes_total"
        routed = PROMETHEUS_PREFIX + "vela_tokens_routed_total"
        expected_tiers = _expected_bytes_by_tier(steps)
        # Past GAUGE_TTL_S after the last set, a gauge is only there if the sink keeps refreshing it.
        samples = _scrape_until(metrics_port, lambda s: time.monotonic() - fed_at > GAUGE_TTL_S and all(
            _total(s, traffic, link_tier=t) == b for t, b in expected_tiers.items())
            and _total(s, routed) == steps * np.sum(COUNTS_LE))
    finally:
        driver.stdin.close()
        driver.wait(timeout=30)

    # bytes per link tier: worker 0 (same_node) got rows 3 + 1 per direction and step, workers 1-2 the rest
    for tier, expected in expected_tiers.items():
        assert _total(samples, traffic, link_tier=tier) == expected
    for (layer, expert), count in np.ndenumerate(np.asarray(COUNTS_LE)):
        assert _total(samples, routed, layer=str(layer), expert=str(expert)) == steps * count
    assert _total(samples, PROMETHEUS_PREFIX + "vela_placement_version") == 3  # set once, kept alive
    assert _total(samples, PROMETHEUS_PREFIX + "vela_train_loss") == 1.0  # the last step's loss
    assert _total(samples, PROMETHEUS_PREFIX + "vela_broker_round_trip_seconds_count", layer="0") == steps
    exported = {n for n, _, _ in samples}
    assert {PROMETHEUS_PREFIX + m for m in ("vela_tokens_per_second", "vela_locality_drift",
                                            "vela_step_time_seconds")} <= exported
    assert set(METRICS) >= {n.removeprefix(PROMETHEUS_PREFIX).removesuffix("_bucket").removesuffix("_sum")
                            .removesuffix("_count") for n in exported if n.startswith(PROMETHEUS_PREFIX + "vela")}


JOB_DRIVER = """
import json, sys
import ray
from actors.master import MasterActor
from vela_ray.config import JobConfig

ray.init(address=sys.argv[1], log_to_driver=False)
config = JobConfig.from_dict(json.loads(sys.argv[2]))
config.preflight()
master = ray.remote(MasterActor).options(num_cpus=0).remote(config)  # as VelaJob does, kept alive after run
print("SUMMARY " + ray.get(master.run.remote()).model_dump_json(), flush=True)
sys.stdin.read()  # the master's metrics stay exported until the test closes stdin
"""


def test_a_real_job_exports_its_own_traffic_and_routing_counts(metrics_head, tmp_path):
    import json

    from tests.fixtures import job_dict, make_checkpoint

    address, metrics_port, env = metrics_head
    job = job_dict(make_checkpoint(tmp_path / "model"), tmp_path / "out", steps=2)
    driver = subprocess.Popen([sys.executable, "-c", JOB_DRIVER, address, json.dumps(job)], env=env, cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = driver.stdout.readline()
        assert line.startswith("SUMMARY "), driver.stderr.read()[-3000:]
        summary = json.loads(line.removeprefix("SUMMARY "))
        history = summary["history"]
        tiers = {t: sum(h["bytes_by_tier"][t] for h in history) for t in history[0]["bytes_by_tier"]}
        routed_LE = np.asarray(summary["tokens_routed"])
        traffic = PROMETHEUS_PREFIX + "vela_expert_traffic_bytes_total"
        routed = PROMETHEUS_PREFIX + "vela_tokens_routed_total"
        samples = _scrape_until(metrics_port, lambda s: all(
            _total(s, traffic, link_tier=t) == b for t, b in tiers.items() if b)
            and _total(s, routed) == routed_LE.sum(), timeout_s=90)
    finally:
        driver.stdin.close()
        driver.wait(timeout=60)
    assert sum(tiers.values()) > 0 and routed_LE.sum() > 0 and routed_LE.ndim == 2
    for tier, expected in tiers.items():
        assert _total(samples, traffic, link_tier=tier) == expected
    for (layer, expert), count in np.ndenumerate(routed_LE):
        assert _total(samples, routed, layer=str(layer), expert=str(expert)) == count
