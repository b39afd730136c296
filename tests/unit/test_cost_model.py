"""The step the cost model predicts (placement.cost.predict_step): the objective's round trips plus each call's
latency, every worker's compute and the master's own compute; and what the solvers minimise is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from placement import (
    PlacementProblem, TrainingStep, layer_times, node_shared_links, predict_step, round_trip_times, solve, step_time,
    synthetic_probs,
)

ROOT = Path(__file__).resolve().parents[2]


def three_worker_problem(**overrides) -> PlacementProblem:
    # Each row is b*H/8 = 32*8/8 = 32 bytes each way; forward + backward: 4 crossings = 128 bytes. Expert 0 (P 0.5)
    # on worker 0, expert 1 (P 0.5) on worker 1: 0.5 * K = 50 rows each, 6400 bytes, at 128 kB/s = 0.05 s on
    # worker 0 and at 64 kB/s = 0.1 s on worker 1. Worker 2 holds no expert of the layer.
    fields = dict(probs=[[0.5, 0.5]], top_k=1, tokens_per_step=100, hidden_size=8, bits_per_element=32,
                  bandwidths=[128e3, 64e3, 1e3], capacities=[1, 1, 1])
    return PlacementProblem(**{**fields, **overrides})


TABLE = np.array([[0, 1]])


def test_without_latency_and_training_step_the_prediction_is_the_objective_exactly():
    problem = three_worker_problem()
    prediction = predict_step(problem, TABLE)
    assert prediction.serial_s == prediction.step_s == step_time(problem, TABLE) == pytest.approx(0.1)
    assert prediction.master_s == 0.0
    # the same with compute, shared links and several masters' own routes
    probs = synthetic_probs(3, 6, 2, concentration=0.5, seed=1)
    nodes = ["a", "a", "b", "b", "c", "c"]
    masters = PlacementProblem(probs=probs, top_k=2, tokens_per_step=512, hidden_size=64, capacities=[12] * 6,
                               bandwidths=[4e9, 4e9, 1e8, 1e8, 1e8, 1e8], worker_nodes=nodes,
                               master_nodes=["a", "b"], compute_seconds_per_row=[1e-6] * 6,
                               shared_links=node_shared_links(nodes, ["a", "b"], 2e8))
    table = solve(masters, "random", seed=2).as_array()
    routes = np.stack([table, np.roll(table, 1, axis=1)])
    for placement in (table, routes):
        assert np.array_equal(round_trip_times(masters, placement), layer_times(masters, placement))
        assert predict_step(masters, placement).step_s == step_time(masters, placement)


def test_stored_problems_load_and_predict_what_their_runs_recorded():
    """A run summary from before the step inputs existed: its problem predicts the objective it recorded."""
    raw = json.loads((ROOT / "benchmarks/results/vela_vs_ep_tp2/results.json").read_text())["raw"]
    for run in raw["runs"]["wikitext"].values():
        record = run["summary"]["placement"]
        if record["problem"] is None:
            continue  # the expert-parallel baseline
        problem = PlacementProblem.model_validate(record["problem"])
        assert problem.latencies_s is None and problem.training_step is None and problem.compute_in_objective
        table = np.asarray(record["routes"] or record["expert_to_worker"])
        # those runs counted a NIC's two directions against one bandwidth; at half the bandwidth, full duplex
        # (today's model) predicts what they recorded
        assert problem.shared_links
        as_then = problem.model_copy(update={"shared_links": [
            link.model_copy(update={"bandwidth_bytes_per_s": link.bandwidth_bytes_per_s / 2})
            for link in problem.shared_links]})
        assert predict_step(as_then, table).step_s == pytest.approx(record["expected_step_time_s"], rel=1e-12)
        assert predict_step(problem, table).step_s < record["expected_step_time_s"]


def test_every_call_pays_the_latency_of_each_worker_it_contacts():
    # 3 micro-batches x 2 passes = 6 calls per layer. Worker 0: 0.05 s of link + 6 x 10 ms = 0.11 s; worker 1:
    # 0.1 s + 6 x 2 ms = 0.112 s, the layer's slowest. Worker 2 is contacted by no call: its 1 s latency costs
    # nothing. The master computes 0.3 s: the serial step is 0.412 s.
    problem = three_worker_problem(latencies_s=[0.01, 0.002, 1.0],
                                   training_step=TrainingStep(master_compute_s=0.3, micro_batches=3))
    assert problem.calls_per_layer == 6
    np.testing.assert_allclose(round_trip_times(problem, TABLE), [0.112])
    prediction = predict_step(problem, TABLE)
    assert prediction.round_trips_s == pytest.approx(0.112)
    assert prediction.step_s == prediction.serial_s == pytest.approx(0.412)
    # 20 ms on worker 0 makes it the slowest: 0.05 + 6 x 0.02 = 0.17 s
    slower = problem.model_copy(update={"latencies_s": [0.02, 0.002, 1.0]})
    assert predict_step(slower, TABLE).round_trips_s == pytest.approx(0.17)
    # forward only: 1 pass x 3 micro-batches, half the bytes: max(0.025 + 0.03, 0.05 + 0.006) = 0.056 s
    forward = problem.model_copy(update={"include_backward": False})
    assert predict_step(forward, TABLE).round_trips_s == pytest.approx(0.056)


def test_each_worker_computes_in_its_round_trip_whether_or_not_the_objective_counts_it():
    # Worker 0 computes 50 rows at 1.4 ms = 0.07 s: 0.05 + 0.07 = 0.12 s, over worker 1's 0.1 s.
    counted = three_worker_problem(compute_seconds_per_row=[1.4e-3, 0.0, 0.0])
    assert step_time(counted, TABLE) == pytest.approx(0.12)
    assert predict_step(counted, TABLE).round_trips_s == pytest.approx(0.12)
    # measured for the prediction alone: the objective is the paper's communication, the prediction the same 0.12 s
    for_prediction = counted.model_copy(update={"compute_in_objective": False})
    assert step_time(for_prediction, TABLE) == step_time(counted.communication_only(), TABLE) == pytest.approx(0.1)
    assert predict_step(for_prediction, TABLE).round_trips_s == pytest.approx(0.12)


def test_a_shared_link_still_bounds_the_round_trip():
    # A NIC at 16 kB/s each way carries both workers' 12800 bytes, 6400 each way at once: 0.4 s, more than
    # either worker with its latency.
    problem = three_worker_problem(latencies_s=[0.01, 0.01, 0.0], worker_nodes=["b", "b", "b"], master_node="a",
                                   shared_links=node_shared_links(["b", "b", "b"], "a", 16e3)[:1])
    assert predict_step(problem, TABLE).round_trips_s == pytest.approx(0.4)


def test_micro_batches_in_flight_overlap_the_master_with_the_round_trips():
    # C = 0.3 s, R = 4 micro-batches x 2 passes x 10 ms + 0.1 s = 0.18 s. Serial: 0.48 s. Two in flight: the
    # master is the busier, plus the last micro-batch's round trips: 0.3 + 0.18 / 4 = 0.345 s.
    step = TrainingStep(master_compute_s=0.3, micro_batches=4, in_flight=2)
    problem = three_worker_problem(latencies_s=[0.0, 0.01, 0.0], training_step=step)
    prediction = predict_step(problem, TABLE)
    assert prediction.serial_s == pytest.approx(0.48)
    assert prediction.step_s == prediction.overlapped_s == pytest.approx(0.345)
    # one micro-batch cannot overlap with itself, whatever in_flight says
    one = problem.model_copy(update={"training_step": step.model_copy(update={"micro_batches": 1})})
    assert predict_step(one, TABLE).step_s == pytest.approx(0.3 + 0.12)


def test_latency_and_the_training_step_leave_the_solvers_objective_and_placement_unchanged():
    probs = synthetic_probs(4, 8, 2, concentration=0.3, seed=3)
    plain = PlacementProblem(probs=probs, top_k=2, tokens_per_step=1024, hidden_size=128, capacities=[8] * 6,
                             bandwidths=[4e9, 3e9, 1.2e7, 1.2e7, 1.2e7, 1.2e7])
    richer = plain.model_copy(update={
        "latencies_s": [5e-3, 5e-3, 0.0, 0.0, 1e-3, 1e-3], "compute_seconds_per_row": [2e-6] * 6,
        "compute_in_objective": False, "training_step": TrainingStep(master_compute_s=0.1, micro_batches=2)})
    for solver in ("vela", "improved"):
        a, b = solve(plain, solver, seed=0), solve(richer, solver, seed=0)
        assert np.array_equal(a.as_array(), b.as_array())
        assert a.expected_step_time == b.expected_step_time
    assert predict_step(richer, a.as_array()).step_s > 0.1 + a.expected_step_time


@pytest.mark.parametrize("overrides, message", [
    (dict(latencies_s=[0.0, 0.0]), r"latencies_s has 2 entries but bandwidths has 3"),
    (dict(latencies_s=[0.0, -1e-3, 0.0]), r"latencies_s\[1\] = -0.001: give a finite latency >= 0"),
    (dict(training_step={"master_compute_s": float("nan")}), r"master_compute_s = nan"),
    (dict(training_step={"master_compute_s": 0.1, "micro_batches": 0}), r"micro_batches = 0: a step runs at least"),
])
def test_invalid_step_inputs_name_the_field_and_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        three_worker_problem(**overrides)
