"""MetricsSink without Ray: what each call records, names that follow Prometheus conventions, no Ray import.

(`actors.metrics.RayMetricsBackend` is exercised against a real Prometheus scrape in
tests/ray/test_metrics_scrape.py.)"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from vela_ray.observability.metrics import METRICS, MemoryMetricsBackend, MetricsSink
from vela_ray.model.traffic import TrafficCounter
from vela_ray.training.tiers import TierCounters

UNITS = ("_seconds", "_bytes_total", "_total", "_ratio", "_per_second", "_version", "_experts", "_loss", "_step",
         "_drift", "_info")


def _sink() -> tuple[MetricsSink, MemoryMetricsBackend]:
    backend = MemoryMetricsBackend()
    return MetricsSink(backend), backend


def _step_traffic() -> TrafficCounter:
    counter = TrafficCounter(2, 2, ["same_node", "cross_node"])
    counter.record(0, 0, "dispatch", 3, 300)
    counter.record(0, 1, "dispatch", 1, 100)
    counter.record(1, 1, "gather", 4, 400)
    return counter


def test_metric_names_carry_a_unit_and_counters_end_in_total():
    for name, spec in METRICS.items():
        assert name.startswith("vela_") and name.endswith(UNITS), name
        assert (spec.kind == "counter") == name.endswith("_total"), name
        assert spec.kind != "histogram" or spec.boundaries == tuple(sorted(spec.boundaries)), name


def test_record_step_feeds_traffic_routing_drift_and_gauges():
    sink, mem = _sink()
    counter = _step_traffic()
    counts_LE = np.array([[2, 0, 2], [1, 3, 0]])
    for step in (1, 2):  # the same delta twice: counters add up, gauges keep the last value
        sink.record_step(step, loss=3.0 - step, step_time_s=0.5, tokens=100, traffic_delta=counter.snapshot(),
                         expert_counts_LE=counts_LE, drift_L=np.array([0.1, 0.25]))
    assert mem.value("vela_expert_traffic_bytes_total", layer=0, worker=0, direction="dispatch",
                     link_tier="same_node") == 600
    assert mem.value("vela_expert_traffic_bytes_total", layer=1, worker=1, direction="gather",
                     link_tier="cross_node") == 800
    assert mem.value("vela_expert_traffic_rows_total", layer=0, worker=1, direction="dispatch") == 2
    assert mem.value("vela_tokens_routed_total", layer=1, expert=1) == 6
    assert (("expert", "1"), ("layer", "0")) not in mem.counters["vela_tokens_routed_total"]  # zero: no series
    assert mem.value("vela_train_loss") == 1.0 and mem.value("vela_train_step") == 2
    assert mem.value("vela_tokens_per_second") == 200.0
    assert mem.value("vela_locality_drift", layer=1) == 0.25
    assert len(mem.histograms["vela_step_duration_seconds"][()]) == 2


def test_load_ratio_is_dispatched_rows_over_the_placement_prediction():
    sink, mem = _sink()
    # worker 0 holds experts with P 0.5 + 0.5 (layer 0) and 1.0 (layer 1): 2 rows per token; worker 1: 2
    sink.set_placement(2, [[0, 0, 1], [1, 0, 1]], num_workers=2,
                       probs_LE=np.array([[0.5, 0.5, 1.0], [0.5, 1.0, 0.5]]), expected_comm_time_s=0.02)
    sink.record_step(1, 1.0, 0.1, tokens=2, traffic_delta=_step_traffic().snapshot())
    assert mem.value("vela_worker_load_ratio", worker=0) == pytest.approx(3 / 4)  # 3 rows, 2 tokens x 2 predicted
    assert mem.value("vela_worker_load_ratio", worker=1) == pytest.approx(1 / 4)
    assert mem.value("vela_placement_version") == 2 and mem.value("vela_worker_experts", worker=0) == 3
    assert mem.value("vela_placement_expected_comm_seconds") == 0.02


def test_explicit_predicted_rows_override_the_placement_share():
    sink, mem = _sink()
    sink.record_step(1, 1.0, 0.1, tokens=2, traffic_delta=_step_traffic().snapshot(),
                     predicted_rows_per_worker=np.array([3.0, 0.0]))
    assert mem.value("vela_worker_load_ratio", worker=0) == 1.0
    assert (("worker", "1"),) not in mem.gauges["vela_worker_load_ratio"]  # nothing predicted: no ratio


def test_an_empty_step_records_no_counter_increments():
    sink, mem = _sink()
    sink.record_step(1, 1.0, 0.0, tokens=0, traffic_delta=TrafficCounter(2, 2).snapshot(),
                     expert_counts_LE=np.zeros((2, 4), dtype=int))
    assert mem.counters == {} and "vela_tokens_per_second" not in mem.gauges


def test_latency_recorder_times_a_block_per_layer_and_phase():
    sink, mem = _sink()
    with sink.latency.time(3, "backward"):
        pass
    sink.latency.observe(3, 0.002)
    series = mem.histograms["vela_broker_round_trip_seconds"]
    assert len(series[(("layer", "3"), ("phase", "backward"))]) == 1
    assert series[(("layer", "3"), ("phase", "forward"))] == [0.002]


def test_a_worker_without_experts_gets_a_zero_expert_gauge_and_no_load_ratio():
    sink, mem = _sink()
    # 3 workers, worker 2 holds nothing (the table alone would suggest 2 workers)
    sink.set_placement(1, [[0, 0, 1], [1, 0, 1]], num_workers=3,
                       probs_LE=np.array([[0.5, 0.5, 1.0], [0.5, 1.0, 0.5]]))
    assert mem.gauges["vela_worker_experts"][(("worker", "2"),)] == 0
    counter = TrafficCounter(2, 3, ["same_node", "cross_node", "cross_node"])
    counter.record(0, 0, "dispatch", 4, 400)
    sink.record_step(1, 1.0, 0.1, tokens=2, traffic_delta=counter.snapshot())
    assert mem.value("vela_worker_load_ratio", worker=0) == 1.0
    assert (("worker", "2"),) not in mem.gauges["vela_worker_load_ratio"]  # nothing predicted: no ratio


def test_a_profile_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"expert_to_worker has shape \(1, 2\) but the profile \(2, 2\)"):
        MetricsSink().set_placement(1, [[0, 1]], num_workers=2, probs_LE=np.ones((2, 2)))


def test_the_model_side_sink_never_imports_ray():
    code = ("import sys; from vela_ray.observability.metrics import MetricsSink; s = MetricsSink(); "
            "s.set_placement(1, [[0, 1]], num_workers=2, probs_LE=[[1.0, 1.0]]); s.record_step(1, 1.0, 0.1, 10); "
            "assert 'ray' not in sys.modules, 'ray imported'; print(type(s.backend).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "MemoryMetricsBackend"


def test_each_masters_traffic_is_binned_by_its_own_link_tiers():
    """Data-parallel masters: worker 1 is cross-node to master 0 and same-node to master 1."""
    sink, mem = _sink()
    master0 = _step_traffic()  # tiers: worker 0 same_node, worker 1 cross_node
    master1 = TrafficCounter(2, 2, ["cross_node", "same_node"])
    master1.record(1, 1, "gather", 4, 400)
    sink.record_step(1, 1.0, 0.1, tokens=2, traffic_delta=[master0.snapshot(), master1.snapshot()])
    assert mem.value("vela_expert_traffic_bytes_total", layer=1, worker=1, direction="gather",
                     link_tier="cross_node") == 400  # master 0's rows
    assert mem.value("vela_expert_traffic_bytes_total", layer=1, worker=1, direction="gather",
                     link_tier="same_node") == 400  # master 1's
    assert mem.value("vela_expert_traffic_rows_total", layer=1, worker=1, direction="gather") == 8


def test_record_tiers_turns_each_workers_running_counts_into_counter_increments():
    sink, mem = _sink()
    first = TierCounters(worker=0, rows_cpu=100, rows_device=300, uploads=4, upload_bytes=4000, predictions=10,
                         predicted_overlap_sum=8.0)
    sink.record_tiers([first, None, TierCounters(worker=2)])  # worker 1 untiered, worker 2 idle so far
    later = first.model_copy(update={"rows_cpu": 150, "rows_device": 500, "uploads": 6, "upload_bytes": 6000,
                                     "predictions": 20, "predicted_overlap_sum": 18.0})
    sink.record_tiers([later, None, TierCounters(worker=2, rows_cpu=7)])
    sink.record_tiers([later, None])  # nothing new: nothing added
    assert mem.value("vela_tier_rows_total", worker=0, tier="cpu") == 150
    assert mem.value("vela_tier_rows_total", worker=0, tier="device") == 500
    assert mem.value("vela_tier_uploads_total", worker=0) == 6
    assert mem.value("vela_tier_upload_bytes_total", worker=0) == 6000
    assert mem.value("vela_tier_predictor_overlap_ratio", worker=0) == pytest.approx(0.9)  # 18 / 20 so far
    assert mem.value("vela_tier_rows_total", worker=2, tier="cpu") == 7
    assert (("tier", "device"), ("worker", "2")) not in mem.counters["vela_tier_rows_total"]  # zero: no series
    assert (("worker", "2"),) not in mem.gauges.get("vela_tier_predictor_overlap_ratio", {})  # nothing predicted
    assert not any(("worker", "1") in key for series in mem.counters.values() for key in series)


def test_a_replaced_worker_counting_from_zero_adds_all_of_its_counts():
    sink, mem = _sink()
    sink.record_tiers([TierCounters(worker=1, rows_cpu=50, uploads=3, upload_bytes=300)])
    sink.record_tiers([TierCounters(worker=1, rows_cpu=20, uploads=1, upload_bytes=100)])  # a recovered worker
    assert mem.value("vela_tier_rows_total", worker=1, tier="cpu") == 70
    assert mem.value("vela_tier_uploads_total", worker=1) == 4
    assert mem.value("vela_tier_upload_bytes_total", worker=1) == 400


def test_the_training_method_is_an_info_series():
    sink, mem = _sink()
    sink.set_method("zo")
    assert mem.value("vela_training_method_info", method="zo") == 1
    assert mem.value("vela_training_method_info", method="first_order") == 0
    assert len(mem.gauges["vela_training_method_info"]) == 2
