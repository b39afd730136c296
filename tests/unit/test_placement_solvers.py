"""Placement solvers: optimality on tiny instances, invariants, the paper's rounding, the LP."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from placement import (
    SOLVERS,
    Placement,
    PlacementProblem,
    round_relaxed,
    sequential_table,
    solve,
    solve_lp,
    synthetic_probs,
)
from placement.cost import cost_report
from placement.greedy import greedy_placement
from placement.lp import disaggregate, solve_class_lp, worker_classes

FAST_BUDGET_S = 0.5


def random_problem(rng: np.random.Generator, num_layers: int, num_experts: int, num_workers: int,
                   *, slack: int = 0, num_classes: int | None = None, compute: bool = False) -> PlacementProblem:
    """Random skew, top_k, bandwidth classes and capacities with `slack` spare slots in all;
    with `compute`, per-worker compute times per row of the same order as the communication."""
    top_k = int(rng.integers(1, min(3, num_experts) + 1))
    probs = synthetic_probs(num_layers, num_experts, top_k, concentration=float(rng.choice([0.3, 1.0, 5.0])),
                            seed=int(rng.integers(1 << 30)))
    speeds = rng.choice([1e9, 3e9, 18e9], size=num_classes or num_workers)
    bandwidths = [float(speeds[n % len(speeds)]) for n in range(num_workers)]
    slots = num_layers * num_experts + slack
    capacities = [slots // num_workers + (n < slots % num_workers) for n in range(num_workers)]
    compute_per_row = [float(rng.choice([0.0, 2e-7, 2e-6])) for _ in range(num_workers)] if compute else None
    return PlacementProblem(probs=probs, top_k=top_k, tokens_per_step=1024, hidden_size=512,
                            bandwidths=bandwidths, capacities=capacities, compute_seconds_per_row=compute_per_row)


def recount_step_time(problem: PlacementProblem, expert_to_worker) -> float:
    """sum_l max_n (passes * b*H/(4*B_n) + c_n) * sum_e X[n,l,e] * P[l,e] * K, with plain loops."""
    total = 0.0
    for layer in range(problem.num_layers):
        slowest = 0.0
        for worker in range(problem.num_workers):
            rows = sum(problem.probs[layer][e] * problem.tokens_per_step
                       for e in range(problem.num_experts) if expert_to_worker[layer][e] == worker)
            seconds = (2 if problem.include_backward else 1) * problem.bits_per_element * problem.hidden_size \
                / (4 * problem.bandwidths[worker]) * rows
            seconds += (problem.compute_seconds_per_row or [0.0] * problem.num_workers)[worker] * rows
            slowest = max(slowest, seconds)
        total += slowest
    return total


def brute_force_optimum(problem: PlacementProblem) -> float:
    """Best step time over every capacity-respecting assignment."""
    best = float("inf")
    for flat in itertools.product(range(problem.num_workers), repeat=problem.num_layers * problem.num_experts):
        if all(flat.count(n) <= c for n, c in enumerate(problem.capacities)):
            assignment = np.reshape(flat, problem.probs.shape)
            best = min(best, recount_step_time(problem, assignment))
    return best


def check_feasible(problem: PlacementProblem, placement: Placement) -> None:
    table = placement.expert_to_worker
    assert len(table) == problem.num_layers and all(len(row) == problem.num_experts for row in table)
    for worker, held in enumerate(placement.worker_to_experts):
        assert len(held) <= problem.capacities[worker]
        assert all(table[layer][expert] == worker for layer, expert in held)
    assert sum(len(held) for held in placement.worker_to_experts) == problem.num_layers * problem.num_experts


# --- optimality on tiny instances ---------------------------------------------------------


def test_lp_bound_below_brute_force_optimum_below_every_solver_and_improved_usually_optimal():
    rng = np.random.default_rng(0)
    optimal_hits, trials = 0, 20
    for trial in range(trials):
        problem = random_problem(rng, 2, 3, 2 + trial % 2, slack=trial % 3, compute=trial % 2 == 1)
        optimum = brute_force_optimum(problem)
        placements = {name: solve(problem, name, seed=trial, time_budget_s=FAST_BUDGET_S) for name in SOLVERS}
        assert placements["vela"].lower_bound <= optimum * (1 + 1e-6)
        for placement in placements.values():
            assert placement.expected_step_time >= optimum * (1 - 1e-9)
        optimal_hits += placements["improved"].expected_step_time <= optimum * (1 + 1e-9)
    assert optimal_hits >= 0.9 * trials


# --- invariants on random instances ------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_every_solver_places_each_expert_once_within_capacity_and_costs_what_it_claims(seed):
    rng = np.random.default_rng(100 + seed)
    problem = random_problem(rng, int(rng.integers(1, 6)), int(rng.integers(1, 9)), int(rng.integers(1, 7)),
                             slack=int(rng.integers(0, 5)), num_classes=int(rng.integers(1, 4)), compute=seed % 2 == 1)
    placements = {name: solve(problem, name, seed=seed, time_budget_s=FAST_BUDGET_S) for name in SOLVERS}
    for placement in placements.values():
        check_feasible(problem, placement)
        assert placement.expected_step_time == pytest.approx(recount_step_time(problem, placement.expert_to_worker))
    assert placements["improved"].expected_step_time <= placements["vela"].expected_step_time * (1 + 1e-12)
    assert placements["improved"].lower_bound == pytest.approx(placements["vela"].lower_bound)


def test_improved_is_clearly_better_than_vela_on_a_tight_mixtral_like_cluster():
    # the paper's cluster: 2 workers next to the master at 18.3 GB/s, 4 across Ethernet at 1.17 GB/s
    problem = PlacementProblem(
        probs=synthetic_probs(32, 8, 2, concentration=2.0, seed=0), top_k=2, tokens_per_step=4096,
        hidden_size=4096, bandwidths=[18.3e9] * 2 + [1.17e9] * 4, capacities=[43] * 6,
    )
    vela = solve(problem, "vela")
    improved = solve(problem, "improved", time_budget_s=1.0)
    assert improved.expected_step_time <= 0.92 * vela.expected_step_time
    assert improved.lower_bound <= improved.expected_step_time


def test_compute_aware_placement_stops_the_fast_link_from_taking_more_rows_than_its_worker_computes():
    # Paper cluster at Mixtral scale: a row's forward+backward through one expert is ~1 GFLOP, ~15 us on
    # a V100, 8x its intra-node transfer (1.8 us) and half its cross-node one (28 us), so the paper's
    # communication-only model overloads w0 and w1.
    fields = dict(probs=synthetic_probs(32, 8, 2, concentration=2.0, seed=0), top_k=2, tokens_per_step=4096,
                  hidden_size=4096, bandwidths=[18.3e9] * 2 + [1.17e9] * 4, capacities=[64] * 6)
    with_compute = PlacementProblem(**fields, compute_seconds_per_row=[15e-6] * 6)
    comm_only = PlacementProblem(**fields)
    np.testing.assert_array_equal(with_compute.communication_only().seconds_per_prob, comm_only.seconds_per_prob)
    aware = solve(with_compute, "improved", time_budget_s=1.0)
    paper = solve(comm_only, "improved", time_budget_s=1.0)
    true_time = lambda placement: recount_step_time(with_compute, placement.expert_to_worker)  # noqa: E731
    assert aware.expected_step_time == pytest.approx(true_time(aware))
    assert true_time(aware) <= 0.93 * true_time(paper)  # observed 0.89
    fast_bytes = lambda placement: sum(cost_report(with_compute, placement.as_array()).worker_bytes[:2])  # noqa: E731
    assert fast_bytes(aware) < 0.9 * fast_bytes(paper)  # observed 0.86


@pytest.mark.parametrize("seed", range(3))
def test_aggregated_lp_with_compute_times_splits_classes_by_speed_and_keeps_the_bound(seed):
    rng = np.random.default_rng(300 + seed)
    problem = random_problem(rng, 4, 6, 6, slack=3, num_classes=1)  # one bandwidth and capacity ...
    problem = problem.model_copy(update={"compute_seconds_per_row": [1e-7, 1e-7, 1e-7, 3e-6, 3e-6, 3e-6]})
    assert len(worker_classes(problem)) == 2  # ... but two compute speeds
    aggregated, _ = solve_lp(problem)
    direct, _ = solve_lp(problem, direct=True)
    assert aggregated == pytest.approx(direct, rel=1e-6)
    assert solve(problem, "vela").expected_step_time >= aggregated * (1 - 1e-9)


def test_improved_respects_its_time_budget_roughly():
    problem = random_problem(np.random.default_rng(7), 16, 16, 8, num_classes=2)
    placement = solve(problem, "improved", time_budget_s=0.3)
    assert placement.solve_seconds < 0.3 + 1.0  # the LP and greedy start are not interruptible


# --- edge cases ---------------------------------------------------------------------------


def test_a_single_worker_gets_everything_and_meets_the_bound():
    problem = PlacementProblem(probs=synthetic_probs(3, 4, 2, concentration=1.0, seed=0), top_k=2,
                               tokens_per_step=64, hidden_size=64, bandwidths=[1e9], capacities=[12])
    for name in SOLVERS:
        placement = solve(problem, name, time_budget_s=FAST_BUDGET_S)
        assert placement.expert_to_worker == [[0] * 4] * 3
    assert solve(problem, "vela").gap == pytest.approx(0.0, abs=1e-6)


def test_a_single_expert_per_layer_and_zero_probability_experts_are_placed():
    one_expert = PlacementProblem(probs=[[1.0], [1.0]], top_k=1, tokens_per_step=8, hidden_size=8,
                                  bandwidths=[1e9, 2e9], capacities=[1, 1])
    unused = PlacementProblem(probs=[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]], top_k=1, tokens_per_step=8,
                              hidden_size=8, bandwidths=[1e9, 2e9], capacities=[3, 3])
    for problem in (one_expert, unused):
        for name in SOLVERS:
            check_feasible(problem, solve(problem, name, time_budget_s=FAST_BUDGET_S))
    # the faster worker should take the busy expert: 1.0 at 2 GB/s is the best layer-0 time
    assert solve(unused, "improved").expert_to_worker[0][0] == 1


def test_sequential_puts_expert_e_on_worker_e_mod_n_and_passes_on_when_full():
    problem = PlacementProblem(probs=np.full((2, 3), 1 / 3), top_k=1, tokens_per_step=8, hidden_size=8,
                               bandwidths=[1e9, 1e9], capacities=[3, 3])
    # layer 0: e0->0, e1->1, e2->0; layer 1: e0->0 (worker 0 now full), e1->1, e2->0 is full -> 1
    assert solve(problem, "sequential").expert_to_worker == [[0, 1, 0], [0, 1, 1]]


def test_random_is_seeded():
    problem = random_problem(np.random.default_rng(3), 4, 6, 3, slack=3)
    assert solve(problem, "random", seed=1).expert_to_worker == solve(problem, "random", seed=1).expert_to_worker
    assert solve(problem, "random", seed=1).expert_to_worker != solve(problem, "random", seed=2).expert_to_worker


def test_unknown_solver_lists_the_choices():
    with pytest.raises(ValueError, match="unknown solver 'best': choose one of sequential, random, vela, improved"):
        solve(PlacementProblem.uniform(1, 2, 1, 2), "best")


# --- the paper's rounding on hand-made relaxed matrices -------------------------------------


def test_rounding_step_1_thresholds_at_one_half():
    # expert:   e0   e1   e2
    x = np.array([[[0.9, 0.2, 0.6]],    # worker 0
                  [[0.1, 0.8, 0.4]]])   # worker 1
    # > 0.5: e0 -> 0, e1 -> 1, e2 -> 0; both workers within capacity 2, nothing else to do
    np.testing.assert_array_equal(round_relaxed(x, [2, 2]), [[0, 1, 0]])


def test_rounding_step_2_drops_the_lowest_relaxed_values_from_full_workers():
    x = np.array([[[0.9, 0.2, 0.6]], [[0.1, 0.8, 0.4]]])
    # step 1 gives worker 0 {e0: 0.9, e2: 0.6} but its capacity is 1: drop e2 (lowest).
    # step 3: e2 goes to the only worker with room, worker 1.
    np.testing.assert_array_equal(round_relaxed(x, [1, 2]), [[0, 1, 1]])


def test_rounding_step_2_breaks_ties_by_lower_index_first():
    x = np.array([[[0.7, 0.7, 0.7]], [[0.3, 0.3, 0.3]]])
    # worker 0 gets all three at 0.7, capacity 2: drop the lowest index, e0, which goes to worker 1
    np.testing.assert_array_equal(round_relaxed(x, [2, 1]), [[1, 0, 0]])


def test_rounding_step_3_assigns_in_row_major_order_by_affinity_among_workers_with_room():
    # layer 0: e0 = [0.40, 0.35, 0.25] (no value > 0.5), e1 = [0.6, 0.3, 0.1] -> worker 0
    # layer 1: e0 = [0.45, 0.45, 0.10] (exactly tied, none > 0.5), e1 = [0.1, 0.2, 0.7] -> worker 2
    x = np.array([
        [[0.40, 0.60], [0.45, 0.10]],  # worker 0, capacity 1
        [[0.35, 0.30], [0.45, 0.20]],  # worker 1, capacity 1
        [[0.25, 0.10], [0.10, 0.70]],  # worker 2, capacity 2
    ])
    # step 3, (0, 0) first: worker 0 is full (holds (0, 1)), so the best with room is worker 1 (0.35).
    # then (1, 0): workers 0 and 1 are full, so it goes to worker 2 despite its 0.10.
    np.testing.assert_array_equal(round_relaxed(x, [1, 1, 2]), [[1, 0], [2, 2]])


def test_rounding_value_of_exactly_one_half_is_not_rounded_up():
    x = np.array([[[0.5]], [[0.5]]])
    # neither worker gets it in step 1; step 3 ties go to the lowest worker index
    np.testing.assert_array_equal(round_relaxed(x, [1, 1]), [[0]])


def test_rounding_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match=r"x_relaxed must be \[num_workers=3"):
        round_relaxed(np.zeros((2, 1, 1)), [1, 1, 1])
    with pytest.raises(ValueError, match="capacities sum to 1 but 2 experts"):
        round_relaxed(np.zeros((1, 1, 2)), [1])


# --- the LP: aggregated over worker classes vs the paper's direct formulation ------------------


@pytest.mark.parametrize("seed", range(6))
def test_aggregated_lp_bound_equals_direct_lp_bound(seed):
    rng = np.random.default_rng(200 + seed)
    problem = random_problem(rng, int(rng.integers(2, 7)), int(rng.integers(3, 10)), int(rng.integers(3, 9)),
                             slack=int(rng.integers(0, 6)), num_classes=int(rng.integers(1, 4)))
    assert len(worker_classes(problem)) < problem.num_workers  # classes really repeat
    aggregated, _ = solve_lp(problem)
    direct, _ = solve_lp(problem, direct=True)
    assert aggregated == pytest.approx(direct, rel=1e-6)


def test_disaggregated_relaxation_is_a_feasible_split_with_the_same_loads():
    problem = random_problem(np.random.default_rng(5), 6, 12, 8, slack=4, num_classes=2)
    classes = worker_classes(problem)
    bound, shares = solve_class_lp(problem, classes)
    x_relaxed = disaggregate(problem, classes, shares)
    np.testing.assert_allclose(x_relaxed.sum(axis=0), 1.0, atol=1e-7)  # every expert placed once
    assert x_relaxed.min() >= 0.0
    for members, class_share in zip(classes, shares):
        np.testing.assert_allclose(x_relaxed[members].sum(axis=0), class_share, atol=1e-7)
        loads = np.einsum("nle,le->nl", x_relaxed[members], problem.probs)
        # wrap-around gives every member the class average load in every layer
        np.testing.assert_allclose(loads - loads.mean(axis=0), 0.0, atol=1e-7)
    times = problem.seconds_per_prob[:, None] * np.einsum("nle,le->nl", x_relaxed, problem.probs)
    assert times.max(axis=0).sum() == pytest.approx(bound, rel=1e-6)


def test_greedy_places_heaviest_first_where_its_layer_finishes_earliest():
    problem = PlacementProblem(probs=[[0.6, 0.3, 0.1]], top_k=1, tokens_per_step=8, hidden_size=8,
                               bandwidths=[1e9, 4e9], capacities=[2, 2])
    # time per unit probability: worker 0 costs 1, worker 1 costs 1/4.
    # 0.6 -> worker 1 (0.15 < 0.6); 0.3 -> worker 1 (0.15 + 0.075 = 0.225 < 0.3), now full;
    # 0.1 -> worker 0, the only one with room.
    np.testing.assert_array_equal(greedy_placement(problem), [[1, 1, 0]])


# --- the plan: JSON round trip and fit checks ------------------------------------------------


def test_placement_round_trips_through_json_and_checks_the_problem(tmp_path):
    problem = random_problem(np.random.default_rng(9), 3, 4, 3, slack=2)
    placement = solve(problem, "improved", time_budget_s=FAST_BUDGET_S)
    placement.to_json(tmp_path / "placement.json")
    loaded = Placement.from_json(tmp_path / "placement.json", problem)
    assert loaded == placement
    assert loaded.worker_to_experts == placement.worker_to_experts
    np.testing.assert_array_equal(loaded.as_array(), placement.as_array())

    other = random_problem(np.random.default_rng(9), 3, 5, 3, slack=2)
    wrong_shape = r"placement\.json is for 3 layers x 4 experts on 3 workers, but the problem has 3 layers x 5"
    with pytest.raises(ValueError, match=wrong_shape):
        Placement.from_json(tmp_path / "placement.json", other)


def test_placement_rejects_tables_that_break_capacity_or_worker_ids():
    fields = dict(num_workers=2, capacities=[1, 1], solver="vela", expected_step_time=1.0)
    with pytest.raises(ValueError, match="puts 2 experts on worker 0, over its capacity 1"):
        Placement(expert_to_worker=[[0, 0]], **fields)
    with pytest.raises(ValueError, match=r"holds worker 2 but there are only workers 0..1"):
        Placement(expert_to_worker=[[0, 2]], **fields)
    with pytest.raises(ValueError, match="non-empty"):
        Placement(expert_to_worker=[[0], [0, 1]], **fields)
    with pytest.raises(ValueError, match="non-empty"):
        Placement(expert_to_worker=[], **fields)


def test_check_fits_names_the_file_it_was_given():
    problem = PlacementProblem.uniform(2, 4, 2, 2)  # capacity 4 each
    placement = solve(problem, "sequential")
    placement.check_fits(problem, source="p.json")
    three_workers = PlacementProblem.uniform(2, 4, 2, 3)
    with pytest.raises(ValueError, match=r"^placement p.json is for 2 layers x 4 experts on 2 workers, but the "
                                         r"problem has 2 layers x 4 experts on 3 workers: solve again"):
        placement.check_fits(three_workers, source="p.json")
    tighter = problem.model_copy(update={"capacities": [3, 5]})
    with pytest.raises(ValueError, match=r"^placement p.json puts 4 experts on worker 0, over its capacity 3"):
        placement.check_fits(tighter, source="p.json")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", r"not valid JSON: .* at line 1, column 2"),
        ("[1, 2]", r"must be a JSON object"),
        ('{"expert_to_worker": [[0, 0]], "num_workers": 2, "capacities": [1, 1], "solver": "x", '
         '"expected_step_time": 1.0}', r"puts 2 experts on worker 0"),
        # a missing field, named (what pydantic says about it is pydantic's wording, not checked)
        ('{"expert_to_worker": [[0, 1]], "num_workers": 2, "capacities": [1, 1]}', r"placement\.json: solver: "),
    ],
)
def test_placement_from_json_errors_are_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "placement.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as caught:
        Placement.from_json(path)
    assert str(caught.value).startswith(f"placement {path}: ") and "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="does not exist"):
        Placement.from_json(tmp_path / "missing.json")


def test_sequential_table_is_expert_e_on_worker_e_mod_n_in_every_layer():
    np.testing.assert_array_equal(sequential_table(2, 5, 3), [[0, 1, 2, 0, 1], [0, 1, 2, 0, 1]])
    assert sequential_table(1, 2, 4).tolist() == [[0, 1]]  # more workers than experts: some hold none
    with pytest.raises(ValueError, match="num_workers must be at least 1, got 0"):
        sequential_table(1, 2, 0)


def test_sequential_solver_is_the_table_whenever_capacities_allow():
    problem = PlacementProblem.uniform(3, 8, 2, 3, capacity=9)  # e mod 3 puts 9, 9, 6 experts
    np.testing.assert_array_equal(solve(problem, "sequential").as_array(), sequential_table(3, 8, 3))
