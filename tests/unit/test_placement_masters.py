"""Data-parallel masters in the placement problem: each master sends 1/M of the rows, NICs carry the
(master, worker) pairs they separate, and per-master routes (replicated experts) cost what they should."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from placement import SOLVERS, PlacementProblem, cost_report, node_shared_links, solve, step_time, synthetic_probs
from placement.cost import check_expert_to_worker, cross_node_bytes, experts_per_worker

FAST_BUDGET_S = 0.5


def masters_problem(rng: np.random.Generator, num_layers: int, num_experts: int, worker_nodes: list[str],
                    master_nodes: list[str], *, slack: int = 0, compute: bool = False,
                    per_master: bool = False) -> PlacementProblem:
    """Random skew and bandwidths; one NIC per node of a random bandwidth. With `per_master`, each master's
    own links: 18 GB/s to the workers on its node, a random slower one to the others."""
    top_k = int(rng.integers(1, min(2, num_experts) + 1))
    probs = synthetic_probs(num_layers, num_experts, top_k, concentration=float(rng.choice([0.3, 1.0])),
                            seed=int(rng.integers(1 << 30)))
    num_workers, slots = len(worker_nodes), num_layers * num_experts + slack
    nodes = sorted(set(worker_nodes) | set(master_nodes))
    bandwidths = [float(rng.choice([1e9, 3e9, 18e9])) for _ in range(num_workers)]
    links = None
    if per_master:
        links = [[18e9 if at == node else float(rng.choice([1e9, 2e9])) for node in worker_nodes]
                 for at in master_nodes]
        bandwidths = np.min(links, axis=0).tolist()
    return PlacementProblem(
        probs=probs, top_k=top_k, tokens_per_step=1024, hidden_size=512,
        bandwidths=bandwidths, master_bandwidths=links,
        capacities=[slots // num_workers + (n < slots % num_workers) for n in range(num_workers)],
        worker_nodes=worker_nodes, master_nodes=master_nodes,
        compute_seconds_per_row=[float(rng.uniform(0, 2e-7)) for _ in range(num_workers)] if compute else None,
        shared_links=node_shared_links(worker_nodes, master_nodes,
                                       {node: float(rng.choice([1e9, 2e9, 5e9])) for node in nodes}),
    )


def recount(problem: PlacementProblem, routes) -> float:
    """Step time with plain loops over (master, worker) pairs, NIC crossings derived from the nodes.

    Master m sends K/M * P[l, e] rows of expert e to the worker its table names; a (master, worker)
    link takes passes * b*H / (4 * B_n) per row, a worker waits for its busiest master link plus its
    compute of every master's rows; a node's NIC carries the rows of each pair it separates, half of them
    each way at once."""
    def per_row(bandwidth: float) -> float:
        return problem.passes * problem.bits_per_element * problem.hidden_size / (4 * bandwidth)

    masters, nodes = problem.masters, problem.worker_nodes
    compute = problem.compute_seconds_per_row or [0.0] * problem.num_workers
    nic = {link.name.removeprefix("nic:"): link.bandwidth_bytes_per_s for link in problem.shared_links}
    total = 0.0
    for layer in range(problem.num_layers):
        rows = {(m, n): 0.0 for m in range(len(masters)) for n in range(problem.num_workers)}
        for m, e in itertools.product(range(len(masters)), range(problem.num_experts)):
            rows[m, routes[m][layer][e]] += problem.tokens_per_step / len(masters) * problem.probs[layer][e]
        links = problem.master_bandwidths or [problem.bandwidths] * len(masters)
        slowest = max(max(rows[m, n] * per_row(links[m][n]) for m in range(len(masters)))
                      + compute[n] * sum(rows[m, n] for m in range(len(masters)))
                      for n in range(problem.num_workers))
        for node, bandwidth in nic.items():
            through = sum(r for (m, n), r in rows.items() if (masters[m] == node) != (nodes[n] == node))
            slowest = max(slowest, through * per_row(bandwidth) / 2)
        total += slowest
    return total


def brute_force_optimum(problem: PlacementProblem) -> float:
    """Best step time over every capacity-respecting table shared by all masters (loops: tiny problems)."""
    best = np.inf
    for flat in itertools.product(range(problem.num_workers), repeat=problem.num_layers * problem.num_experts):
        table = np.reshape(flat, problem.probs.shape)
        if (np.bincount(table.ravel(), minlength=problem.num_workers) <= problem.capacities).all():
            best = min(best, recount(problem, [table] * problem.num_masters))
    return best


def test_two_masters_worked_by_hand():
    # masters and one worker each on nodes a and b; expert 0 (60% of rows) on w0, expert 1 on w1
    problem = PlacementProblem(
        probs=[[0.6, 0.4]], top_k=1, tokens_per_step=1000, hidden_size=1000, bandwidths=[4e9, 4e9],
        capacities=[1, 1], worker_nodes=["a", "b"], master_nodes=["a", "b"],
        shared_links=node_shared_links(["a", "b"], ["a", "b"], 0.5e9))  # 1 GB/s of both directions
    assert [(link.name, link.workers, link.masters) for link in problem.shared_links] == [
        ("nic:a", [0, 1], [[1], [0]]), ("nic:b", [0, 1], [[1], [0]])]
    bytes_per_row = 2 * 2 * 16 * 1000 / 8  # forward and backward, out and back, bf16
    # each NIC carries master b's 300 rows to w0 and master a's 200 rows to w1
    assert step_time(problem, [[0, 1]]) == pytest.approx(500 * bytes_per_row / 1e9)
    # the links: master a -> w0 carries 300 rows at 4 GB/s, less than the NIC
    assert cost_report(problem, [[0, 1]]).layer_times == pytest.approx([500 * bytes_per_row / 1e9])
    total, per_node = cross_node_bytes(problem, [[0, 1]])
    assert per_node == pytest.approx({"a": 300 * bytes_per_row, "b": 200 * bytes_per_row})
    assert total == pytest.approx(500 * bytes_per_row)
    # one master on a: its NIC carries all 400 rows of w1, w0's 600 rows stay on the node
    one = problem.model_copy(update={"master_nodes": None, "master_node": "a",
                                     "shared_links": node_shared_links(["a", "b"], "a", 0.5e9)})
    assert step_time(one, [[0, 1]]) == pytest.approx(max(400 * bytes_per_row / 1e9, 600 * bytes_per_row / 4e9))


@pytest.mark.parametrize("seed", range(6))
def test_cost_model_equals_a_count_over_master_worker_pairs(seed):
    rng = np.random.default_rng(seed)
    problem = masters_problem(rng, 3, 4, ["a", "a", "b", "c"], ["a", "b", "c"], slack=6, compute=seed % 2 == 1,
                              per_master=seed >= 3)
    table = rng.integers(0, problem.num_workers, size=problem.probs.shape)
    assert step_time(problem, table) == pytest.approx(recount(problem, [table] * 3), rel=1e-12)
    routes = rng.integers(0, problem.num_workers, size=(3, *problem.probs.shape))  # each master its own copy
    if (experts_per_worker(problem.num_workers, routes) <= problem.capacities).all():
        check_expert_to_worker(problem, routes)
    assert step_time(problem, routes) == pytest.approx(recount(problem, routes), rel=1e-12)
    assert step_time(problem, np.stack([table] * 3)) == pytest.approx(step_time(problem, table), rel=1e-12)


def test_lp_bound_below_brute_force_optimum_below_every_solver_with_a_master_per_node():
    rng = np.random.default_rng(7)
    for trial in range(6):
        problem = masters_problem(rng, 2, 3, ["a", "b", "b"], ["a", "b"], slack=trial % 2)
        optimum = brute_force_optimum(problem)
        placements = {name: solve(problem, name, seed=trial, time_budget_s=FAST_BUDGET_S) for name in SOLVERS}
        assert placements["vela"].lower_bound <= optimum * (1 + 1e-6)
        for name, placement in placements.items():
            assert placement.expected_step_time == pytest.approx(recount(problem, [placement.as_array()] * 2))
            assert placement.expected_step_time >= optimum * (1 - 1e-9), name
        assert placements["improved"].expected_step_time <= optimum * (1 + 1e-9)  # observed: every trial


def test_replicas_count_once_against_capacity_and_must_fit():
    problem = PlacementProblem(probs=[[0.5, 0.5]], top_k=1, tokens_per_step=8, hidden_size=8,
                               bandwidths=[1e9, 1e9], capacities=[2, 1], master_nodes=["a", "b"])
    routes = np.array([[[0, 1]], [[0, 0]]])  # both masters use w0's copy of expert 0; expert 1 on w0 and w1
    assert experts_per_worker(2, routes).tolist() == [2, 1]
    check_expert_to_worker(problem, routes)
    with pytest.raises(ValueError, match=r"routes host 2 experts on worker 1, over its capacity 1"):
        check_expert_to_worker(problem, np.array([[[1, 1]], [[0, 0]]]))
    with pytest.raises(ValueError, match=r"routes have shape \(3, 1, 2\).*\[2, 1, 2\]"):
        check_expert_to_worker(problem, np.zeros((3, 1, 2), dtype=int))


def test_with_a_master_on_every_node_and_no_replicas_every_table_sends_the_same_share_across_nodes():
    # Each worker's rows come from every master; (M-1)/M of them from another node, wherever the expert
    # is: only replicas (a copy near each master) or sequence migration cut a master-per-node cluster's
    # cross-node bytes, the table alone cannot.
    rng = np.random.default_rng(3)
    nodes = ["n0", "n0", "n1", "n1", "n2", "n2"]
    problem = masters_problem(rng, 4, 8, nodes, ["n0", "n1", "n2"], slack=4)
    total_bytes = problem.num_layers * problem.top_k * problem.tokens_per_step * problem.bytes_per_row
    for table in (rng.integers(0, 6, size=(4, 8)), solve(problem, "improved", time_budget_s=FAST_BUDGET_S).as_array()):
        assert cross_node_bytes(problem, table)[0] == pytest.approx(2 / 3 * total_bytes)
    hot = np.argmax(problem.probs[0])
    routes = np.stack([np.where(np.arange(8) == hot, n0_worker, table[0])[None].repeat(4, 0)
                       for n0_worker in (0, 2, 4)])  # layer 0's hot expert copied to each node
    routes[:, 1:] = table[1:]
    saved = cross_node_bytes(problem, table)[0] - cross_node_bytes(problem, routes)[0]
    copies_cross = sum(node != master for node, master in zip([nodes[w] for w in (0, 2, 4)], ["n0", "n1", "n2"]))
    assert copies_cross == 0
    moved_before = problem.probs[0, hot] * problem.tokens_per_step * problem.bytes_per_row * 2 / 3
    assert saved == pytest.approx(moved_before)  # the hot expert's rows no longer cross


@pytest.mark.parametrize("fields, message", [
    (dict(master_nodes=["a", "b"], master_bandwidths=[[1e9, 1e9]]), r"master_bandwidths is \[1, 2\] but there are 2"),
    (dict(master_nodes=["a", "b"], master_bandwidths=[[2e9, 2e9], [3e9, 2e9]]),
     r"bandwidths must be master_bandwidths' column minima"),
    (dict(master_nodes=[]), r"master_nodes is empty"),
    (dict(master_nodes=["a", "b"], master_node="b"), r"master_node 'b' is not master_nodes\[0\] \('a'\)"),
    (dict(master_nodes=["a"], shared_links=[dict(name="x", bandwidth_bytes_per_s=1e9, workers=[0],
                                                 masters=[[1]])]),
     r"shared_links\[0\] \('x'\) names master 1 but there are 1 masters"),
    (dict(shared_links=[dict(name="x", bandwidth_bytes_per_s=1e9, workers=[0, 1], masters=[[0]])]),
     r"shared link 'x' has 1 master lists for 2 workers"),
])
def test_invalid_masters_are_one_line_naming_the_field(fields, message):
    base = dict(probs=[[0.5, 0.5]], top_k=1, tokens_per_step=8, hidden_size=8, bandwidths=[1e9, 1e9],
                capacities=[1, 1])
    with pytest.raises(ValueError, match=message):
        PlacementProblem(**{**base, **fields})
