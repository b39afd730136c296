"""LUFFY's sequence migration (`placement.sequences`): the heuristic on hand examples, and the simulator
against a count with plain loops, against `placement.cost` without migration, and in its limit cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from placement import PlacementProblem, migrate_sequences, node_shared_links, simulate_sequences
from placement.cost import cross_node_bytes, shared_link_times
from placement.sequences import attention_cost, contiguous_masters, default_capacity

UNLIMITED = 10**9


def test_attention_cost_is_eq_1_at_unit_speed():
    # 3 B L d^2 + 2 B L^2 d with B = 2, L = 6, d = 1: 36 + 144
    assert attention_cost(2, 6, 1) == 180
    assert attention_cost(0, 0, 4096) == 0


def test_a_sequence_served_on_node_1_moves_to_master_1_with_q_1():
    # masters on nodes 0, 1, 2; all 10 rows of the sequence ran on node 1. Traffic in rows: stay on
    # master 0 = 10 gathered across; master 1 = 0 + 5 residual rows; master 2 = 10 + 5
    assert migrate_sequences([5], [[0, 10, 0]], [0, 1, 2], q=1, current_S=[0]).tolist() == [1]
    # 6 of 10 rows on node 1: moving saves 6 - 4 = 2 gathered rows but moves 5 residual rows
    assert migrate_sequences([5], [[4, 6, 0]], [0, 1, 2], q=1, current_S=[0]).tolist() == [0]
    # the same with free moves
    assert migrate_sequences([5], [[4, 6, 0]], [0, 1, 2], q=1, current_S=[0],
                             residual_rows_per_token=0).tolist() == [1]


def test_with_q_2_and_unbalanced_loads_a_sequence_takes_its_second_candidate():
    # three sequences of 10 tokens, all served mostly on node 0. q=1: all stay on master 0.
    # q=2: equal lengths grow either master's attention time equally (eq. 1 is linear in B), so the
    # time after decides: s1 finds master 0 holding s0 and takes master 1, s2 finds them even.
    served = [[20, 0], [20, 0], [18, 2]]
    kwargs = dict(current_S=[0, 0, 0], capacity_tokens=UNLIMITED)
    assert migrate_sequences([10, 10, 10], served, [0, 1], q=1, **kwargs).tolist() == [0, 0, 0]
    assert migrate_sequences([10, 10, 10], served, [0, 1], q=2, **kwargs).tolist() == [0, 1, 0]


def test_capacity_keeps_loads_within_one_sequence_of_an_even_split():
    # 8 x 512 tokens, all served on master 0's node: ceil(4096 / 3) + 512 = 1878 tokens fit 3
    # sequences; master 0 takes 3, then the least-traffic master with room (ties: lower index)
    tokens, served = [512] * 8, [[1024, 0, 0]] * 8
    assert default_capacity(tokens, 3) == 1878
    master = migrate_sequences(tokens, served, [0, 1, 2], q=1, current_S=[0] * 8)
    assert np.bincount(master, minlength=3).tolist() == [3, 3, 2]


@pytest.mark.parametrize("seed", range(5))
def test_every_sequence_keeps_a_master_and_no_master_exceeds_its_capacity(seed):
    rng = np.random.default_rng(seed)
    num_sequences, num_masters = int(rng.integers(1, 12)), int(rng.integers(1, 5))
    tokens = rng.integers(1, 600, size=num_sequences)
    served = rng.integers(0, 300, size=(num_sequences, num_masters + 1))
    for q in (1, 2, num_masters + 3):
        master = migrate_sequences(tokens, served, list(range(num_masters)), q=q,
                                   current_S=rng.integers(0, num_masters, size=num_sequences))
        assert master.shape == (num_sequences,) and set(master.tolist()) <= set(range(num_masters))
        loads = np.bincount(master, weights=tokens, minlength=num_masters)
        assert loads.max() <= default_capacity(tokens, num_masters)


def test_short_sequences_gather_beside_short_ones_not_beside_a_long_one():
    # every master equally cheap (q = 2): the long one goes first, to master 0. A short one beside it
    # is padded to 100 tokens (growth T(1, 100)); on master 1 it grows T(1, 10), then T(2, 10) - T(1, 10)
    master = migrate_sequences([10, 100, 10], [[0, 0]] * 3, [0, 1], q=2, capacity_tokens=UNLIMITED)
    assert master.tolist() == [1, 0, 1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(capacity_tokens=4), r"capacity_tokens=4 is below the longest sequence \(5 tokens\)"),
    (dict(capacity_tokens=6), r"sequence \d \(5 tokens\) fits no master under capacity_tokens=6"),
    (dict(q=0), r"q = 0: give the number of candidate masters"),
    (dict(current_S=[0, 2, 0]), r"current_S \[0, 2, 0\] must give each of the 3 sequences a master 0..1"),
])
def test_bad_heuristic_inputs_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        migrate_sequences([5, 5, 5], [[1, 1], [1, 1], [1, 1]], [0, 1], **kwargs)


# --- the simulator ---------------------------------------------------------------------------------

NODES = ["a", "a", "b", "c", "c"]
MASTERS = ["a", "b", "c"]


def cluster(num_layers: int, num_experts: int, *, top_k: int = 2, tokens: int = 60,
            include_backward: bool = True, probs=None) -> PlacementProblem:
    probs = np.full((num_layers, num_experts), top_k / num_experts) if probs is None else probs
    return PlacementProblem(probs=probs, top_k=top_k, tokens_per_step=tokens, hidden_size=64,
                            bandwidths=[1e9] * len(NODES), capacities=[num_layers * num_experts] * len(NODES),
                            worker_nodes=NODES, master_nodes=MASTERS, include_backward=include_backward,
                            shared_links=node_shared_links(NODES, MASTERS, {"a": 1e9, "b": 2e9, "c": 5e9}))


def random_routing(rng: np.random.Generator, tokens: np.ndarray, num_layers: int, num_experts: int,
                   top_k: int = 2) -> np.ndarray:
    """[S, L, E] counts of each token's top-k distinct experts, drawn with a per-sequence skew."""
    counts = np.zeros((len(tokens), num_layers, num_experts), dtype=int)
    for s, layer in itertools.product(range(len(tokens)), range(num_layers)):
        skew = rng.dirichlet(np.full(num_experts, 0.5))
        for _ in range(tokens[s]):
            counts[s, layer, rng.choice(num_experts, top_k, replace=False, p=skew)] += 1
    return counts


def loop_count(problem: PlacementProblem, counts, tokens, routes, q, residual_rows_per_token=1.0,
               capacity_tokens=None):
    """(dispatch, gather, residual [L], {node: [L]} NIC bytes, [L] NIC seconds, path) with plain loops,
    one row and one pass at a time (the heuristic itself is `migrate_sequences`)."""
    nodes, masters = sorted(set(NODES)), problem.masters
    half_row = problem.bits_per_element * problem.hidden_size / 8  # one row crossing once in one pass
    nic = {link.name.removeprefix("nic:"): link.bandwidth_bytes_per_s for link in problem.shared_links}
    master = list(contiguous_masters(len(tokens), problem.num_masters))
    dispatch, gather, residual = ([0.0] * problem.num_layers for _ in range(3))
    through = {n: [0.0] * problem.num_layers for n in nodes}
    leaving, entering = ({n: [0.0] * problem.num_layers for n in nodes} for _ in range(2))
    path = [master]

    def cross(layer, source, target, amount, into):
        if source != target:
            into[layer] += amount
            through[source][layer] += amount
            through[target][layer] += amount
            leaving[source][layer] += amount
            entering[target][layer] += amount

    for layer in range(problem.num_layers):
        served = [[0] * len(nodes) for _ in tokens]
        for s, e in itertools.product(range(len(tokens)), range(problem.num_experts)):
            served[s][nodes.index(NODES[routes[master[s]][layer][e]])] += counts[s][layer][e]
        following = master if q is None else list(migrate_sequences(
            tokens, served, [nodes.index(m) for m in masters], q=q, current_S=master,
            residual_rows_per_token=residual_rows_per_token, hidden_size=problem.hidden_size,
            capacity_tokens=capacity_tokens))
        for s, e in itertools.product(range(len(tokens)), range(problem.num_experts)):
            worker_node = NODES[routes[master[s]][layer][e]]
            for _row, _pass in itertools.product(range(counts[s][layer][e]), range(problem.passes)):
                cross(layer, masters[master[s]], worker_node, half_row, dispatch)
                cross(layer, worker_node, masters[following[s]], half_row, gather)
        for s in range(len(tokens)):
            for _token, _pass in itertools.product(range(tokens[s]), range(problem.passes)):
                cross(layer, masters[master[s]], masters[following[s]], residual_rows_per_token * half_row, residual)
        master = following
        path.append(master)
    # a NIC carries both directions at once: its busier one
    seconds = [max(max(leaving[n][layer], entering[n][layer]) / nic[n] for n in nodes)
               for layer in range(problem.num_layers)]
    return dispatch, gather, residual, through, seconds, path


@pytest.mark.parametrize("seed, include_backward", [(0, True), (1, True), (2, False)])
def test_simulator_equals_a_count_with_plain_loops(seed, include_backward):
    rng = np.random.default_rng(seed)
    problem = cluster(3, 4, include_backward=include_backward)
    tokens = rng.integers(2, 9, size=5)
    counts = random_routing(rng, tokens, 3, 4)
    routes = rng.integers(0, len(NODES), size=(3, 3, 4))  # each master its own copy
    for q in (None, 1, 2):
        report = simulate_sequences(problem, counts, tokens, routes, q=q)
        dispatch, gather, residual, through, seconds, path = loop_count(problem, counts, tokens, routes, q)
        assert report.dispatch_bytes == pytest.approx(dispatch)
        assert report.gather_bytes == pytest.approx(gather)
        assert report.residual_bytes == pytest.approx(residual)
        assert report.nic_bytes == {n: pytest.approx(v) for n, v in through.items()}
        assert report.layer_nic_seconds == pytest.approx(seconds)
        assert report.masters == [list(map(int, m)) for m in path]
        assert report.cross_node_bytes == pytest.approx(sum(dispatch) + sum(gather) + sum(residual))
        if q is None:
            assert report.residual_bytes == [0.0] * 3 and report.moved_share == 0.0


def test_a_moved_sequence_pays_its_residual_once_per_token_and_pass():
    # one sequence of 4 tokens on master a, both rows of every token served on node c (worker 3):
    # it moves to master c after layer 0; in layer 1 nothing crosses
    problem = cluster(2, 4, tokens=4)
    counts = np.zeros((1, 2, 4), dtype=int)
    counts[0, :, 0] = counts[0, :, 1] = 4
    table = np.array([[3, 4, 0, 1], [3, 4, 0, 1]])
    report = simulate_sequences(problem, counts, [4], table, q=1)
    half_row = 2 * 16 * 64 / 8  # forward and backward, one way
    assert report.masters == [[0], [2], [2]]
    assert report.dispatch_bytes == [8 * half_row, 0.0]
    assert report.gather_bytes == [0.0, 0.0]
    assert report.residual_bytes == [4 * half_row, 0.0]
    stay = simulate_sequences(problem, counts, [4], table)
    assert stay.cross_node_bytes == 2 * 2 * 8 * half_row
    assert report.nic_bytes["a"] == [12 * half_row, 0.0] and report.nic_bytes["b"] == [0.0, 0.0]


def test_without_migration_the_simulator_is_the_cost_model():
    # each master's sequence routes exactly K / M * P[l, e] rows: the expected traffic of placement.cost
    probs = np.array([[0.5, 0.25, 0.75, 0.5], [1.0, 0.5, 0.25, 0.25]])
    problem = cluster(2, 4, tokens=3 * 8, probs=probs)
    counts = np.broadcast_to(8 * probs, (3, 2, 4))
    table = np.array([[0, 2, 3, 4], [1, 3, 2, 0]])
    report = simulate_sequences(problem, counts, [8, 8, 8], table)
    assert report.cross_node_bytes == pytest.approx(cross_node_bytes(problem, table)[0])
    assert report.layer_nic_seconds == pytest.approx(shared_link_times(problem, table).max(axis=0))


@pytest.mark.parametrize("seed", range(4))
def test_with_q_1_and_free_moves_the_gather_never_exceeds_staying(seed):
    # the gather to the next master is what Algorithm 1 minimises: at most the gather back to the
    # current master, which equals its dispatch
    rng = np.random.default_rng(seed)
    problem = cluster(4, 4)
    tokens = rng.integers(2, 9, size=6)
    counts = random_routing(rng, tokens, 4, 4)
    table = rng.integers(0, len(NODES), size=(4, 4))
    report = simulate_sequences(problem, counts, tokens, table, q=1, residual_rows_per_token=0,
                                capacity_tokens=UNLIMITED)
    assert np.all(np.array(report.gather_bytes) <= np.array(report.dispatch_bytes) + 1e-9)
    assert sum(report.residual_bytes) == 0


def test_with_q_1_free_moves_and_each_sequence_on_one_node_migration_cuts_dispatch_and_gather():
    # sequence s always uses experts on node s (the same table in every layer): after layer 0 it sits
    # on that node, so only layer 0's dispatch crosses (for the sequences that start elsewhere)
    problem = cluster(3, 6)
    table = np.array([[0, 1, 2, 2, 3, 4]] * 3)  # experts 0-1 on a, 2-3 on b, 4-5 on c
    counts = np.zeros((3, 3, 6), dtype=int)
    for s, experts in enumerate([(4, 5), (0, 1), (2, 3)]):
        counts[s, :, list(experts)] = 5
    stay = simulate_sequences(problem, counts, [5, 5, 5], table)
    move = simulate_sequences(problem, counts, [5, 5, 5], table, q=1, residual_rows_per_token=0,
                              capacity_tokens=UNLIMITED)
    targeted = lambda r: sum(r.dispatch_bytes) + sum(r.gather_bytes)  # noqa: E731
    assert targeted(move) < targeted(stay)
    assert move.masters[1:] == [[2, 0, 1]] * 3
    assert sum(move.dispatch_bytes[1:]) + sum(move.gather_bytes) == 0


def test_with_every_expert_on_every_node_nothing_crosses_and_migration_saves_nothing():
    problem = cluster(2, 4)
    local = {"a": 0, "b": 2, "c": 3}
    routes = np.stack([np.full((2, 4), local[node]) for node in MASTERS])
    rng = np.random.default_rng(5)
    tokens = rng.integers(2, 9, size=4)
    counts = random_routing(rng, tokens, 2, 4)
    stay = simulate_sequences(problem, counts, tokens, routes)
    assert stay.cross_node_bytes == stay.nic_seconds == 0
    for residual in (1.0, 0.0):  # q = 1: staying costs nothing, so no sequence moves
        move = simulate_sequences(problem, counts, tokens, routes, q=1, residual_rows_per_token=residual)
        assert move.cross_node_bytes == move.nic_seconds == move.moved_share == 0
    # q = 2 trades traffic for attention balance (the paper's Fig. 10a): here it can only cost
    balanced = simulate_sequences(problem, counts, tokens, routes, q=2)
    assert balanced.cross_node_bytes >= stay.cross_node_bytes


def test_an_empty_batch_moves_nothing():
    report = simulate_sequences(cluster(2, 4), np.zeros((0, 2, 4)), [], np.zeros((2, 4), dtype=int), q=1)
    assert report.cross_node_bytes == 0 and report.masters == [[], [], []]


@pytest.mark.parametrize("change, message", [
    (dict(counts=np.ones((1, 2, 4))), r"sequence 0 routes 4 rows in layer 0, not top_k \* tokens = 2 \* 3"),
    (dict(counts=np.ones((1, 3, 4))), r"counts_SLE has shape \(1, 3, 4\) but .* is \[1, 2, 4\]"),
    (dict(problem=dict(worker_nodes=None, shared_links=[])), r"needs worker_nodes and master_nodes"),
])
def test_bad_simulator_inputs_name_the_value(change, message):
    problem = cluster(2, 4)
    if "problem" in change:
        problem = problem.model_copy(update=change["problem"])
    counts = change.get("counts", np.full((1, 2, 4), 1.5))
    with pytest.raises(ValueError, match=message):
        simulate_sequences(problem, counts, [3], np.zeros((2, 4), dtype=int))


def test_a_capacity_per_master_bounds_each_master_on_its_own():
    # every sequence would rather continue on master 1, which has room for one: the others stay on master 0
    master = migrate_sequences([5, 5, 5], [[0, 9]] * 3, [0, 1], q=1, capacity_tokens=[10, 5])
    assert master.tolist() == [1, 0, 0]
