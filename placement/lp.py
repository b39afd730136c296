"""The paper's LP relaxation, solved per worker class so it scales.

Direct formulation (the paper's, `direct=True`): variables X[n,l,e] in [0, 1]
and one lambda_l per layer,

    min sum_l lambda_l
    s.t. sum_n X[n,l,e] = 1                               every expert placed once
         sum_{l,e} X[n,l,e] <= C_n                        capacity
         s_n * sum_e X[n,l,e] * P[l,e] <= lambda_l        s_n = seconds per unit prob
         s_r * sum_{n in r} sum_e X[n,l,e] * P[l,e] <= lambda_l   one row per shared link r

(the last rows only with `problem.shared_links`; s_r = the link's seconds per unit prob).

Aggregated formulation (default): workers with the same bandwidth, capacity, compute speed
and shared links are interchangeable, so averaging any solution over the workers of a class
keeps it feasible (a shared link holds all of a class or none of it, so its load does not
change) and, the max being convex, does not raise its cost. The LP
therefore has an optimum that is symmetric within each class, and it suffices
to solve for Y[c,l,e] = sum_{n in c} X[n,l,e]:

    s.t. sum_c Y[c,l,e] = 1,  sum_{l,e} Y[c,l,e] <= m_c * C_c,
         (s_c / m_c) * sum_e Y[c,l,e] * P[l,e] <= lambda_l
         s_r * sum_{c in r} sum_e Y[c,l,e] * P[l,e] <= lambda_l

with the same optimal value (the LP bound). That is num_classes * L * E
variables instead of N * L * E: 2 * 58 * 256 rather than 64 * 58 * 256 for a
DeepSeek-V3-like cluster whose master node is faster than the rest.

The paper's rounding needs a per-worker relaxed matrix, and the symmetric one
(Y / m_c) is useless for it (every value <= 1/m_c <= 0.5 is rounded to 0).
`disaggregate` instead splits each class's share of a layer among its workers
by McNaughton's wrap-around rule, so each worker gets exactly the class
average load of that layer (the LP's time constraints still hold) and at most
one split expert per worker boundary, as in a vertex of the direct LP, while
keeping expert counts level. Per-worker capacities may still be exceeded by
a few slots, which the rounding's step 2 repairs.

    lower_bound, x_relaxed = solve_lp(problem)        # x_relaxed: [N, L, E]
"""

from __future__ import annotations

import functools
import os
import sys

import cvxpy as cp
import numpy as np
import scipy.sparse as sp

from placement.problem import PlacementProblem

TINY = 1e-9


def worker_classes(problem: PlacementProblem, *, direct: bool = False) -> list[np.ndarray]:
    """Workers grouped by (bandwidth, capacity, compute per row, shared links), each group sorted,
    groups by first member.

    With `direct`, every worker is its own class (the paper's formulation).
    """
    if direct:
        return [np.array([n]) for n in range(problem.num_workers)]
    compute = (problem.compute_seconds_per_row if problem.compute_in_objective else None) or [0.0] * problem.num_workers
    links = [tuple(column) for column in problem.shared_link_members.T]  # the shared links of each worker
    keys = list(zip(problem.bandwidths, problem.capacities, compute, links))
    classes: dict[tuple, list[int]] = {}
    for worker, key in enumerate(keys):
        classes.setdefault(key, []).append(worker)
    return [np.array(members) for members in classes.values()]


@functools.cache
def _first_highs_quietly() -> None:
    """Build this process's first HiGHS object with fd 1 on /dev/null, so its banner is not printed.

    HiGHS prints "Running HiGHS 1.16.0 ... Copyright ..." to fd 1 (bypassing sys.stdout) when a process
    builds its first `highspy.Highs`, before any option can be set: cvxpy's `verbose=False` (its
    default, passed on as `log_to_console`) and `output_flag` only reach the solve. Later objects and
    solves print nothing, so one quiet construction keeps every run's output free of it. (Here, not in
    `vela_ray.quiet`, because placement/ sits below vela_ray in the import layers and is used alone.)
    """
    import highspy  # cvxpy's HiGHS backend, a pinned dependency; imported here only to be built once

    sys.stdout.flush()
    saved_stdout = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        highspy.Highs()
    finally:
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
        os.close(devnull)


def solve_class_lp(problem: PlacementProblem, classes: list[np.ndarray]) -> tuple[float, np.ndarray]:
    """Solve the LP over worker classes; return (lower bound in seconds, Y [C, L, E]).

    Y[c, l, e] is the fraction of expert e of layer l placed on class c.
    """
    num_layers, num_experts = problem.probs.shape
    seconds = problem.seconds_per_prob
    unit = seconds.min()  # solve in units of the fastest link for conditioning
    weight = np.array([seconds[c[0]] / unit / len(c) for c in classes])  # [C]
    slots = np.array([problem.capacities[c[0]] * len(c) for c in classes], dtype=float)
    # prob_by_layer: [L*E, L] sparse, column l holds P[l, :] in layer l's rows
    rows = np.arange(num_layers * num_experts)
    prob_by_layer = sp.csr_matrix(
        (problem.probs.ravel(), (rows, rows // num_experts)), shape=(rows.size, num_layers)
    )
    # 1. variables: class shares and per-layer time bounds
    share = cp.Variable((len(classes), rows.size), nonneg=True)
    layer_bound = cp.Variable(num_layers)
    # 2. constraints: placed once, capacity, every class and shared link under its layer's bound
    class_mass = share @ prob_by_layer  # [C, L]
    bound_rows = cp.reshape(layer_bound, (1, num_layers), order="C")
    constraints = [
        cp.sum(share, axis=0) == 1,
        cp.sum(share, axis=1) <= slots,
        sp.diags(weight) @ class_mass <= np.ones((len(classes), 1)) @ bound_rows,
    ]
    if problem.shared_links:
        # link r carries the classes inside it: [R, C] seconds per unit of class mass
        link_weight = problem.shared_link_seconds_per_prob / unit
        class_in_link = problem.shared_link_members[:, [c[0] for c in classes]]
        link_load = sp.csr_matrix(link_weight[:, None] * class_in_link) @ class_mass  # [R, L]
        constraints.append(link_load <= np.ones((len(problem.shared_links), 1)) @ bound_rows)
    # 3. solve
    lp = cp.Problem(cp.Minimize(cp.sum(layer_bound)), constraints)
    _first_highs_quietly()
    lp.solve(solver=cp.HIGHS)
    if lp.status != cp.OPTIMAL:
        raise RuntimeError(f"placement LP ended with status {lp.status!r}")
    shares = np.clip(share.value, 0.0, 1.0).reshape(len(classes), num_layers, num_experts)
    return float(lp.value) * unit, shares


def disaggregate(
    problem: PlacementProblem, classes: list[np.ndarray], shares: np.ndarray
) -> np.ndarray:
    """Split class shares Y [C, L, E] into a per-worker relaxed X [N, L, E].

    Per class and layer, the class's experts are poured into its workers in
    wrap-around order, each worker filled to the class average load before the
    next (so each gets exactly that load). The pouring order alternates heavy
    and light experts so that the load poured so far stays proportional to the
    expert count, which makes every worker's share of experts about equal too;
    the worker holding the most experts so far takes the share with the fewest.
    Zero-probability experts go whole to the worker holding the fewest.
    """
    x_relaxed = np.zeros((problem.num_workers, problem.num_layers, problem.num_experts))
    for members, class_shares in zip(classes, shares):
        held = np.zeros(len(members))  # relaxed expert count held so far, per member
        for layer in range(problem.num_layers):
            split = _wrap_around(class_shares[layer], problem.probs[layer], len(members))
            split = split[np.argsort(split.sum(axis=1), kind="stable")]  # fewest experts first
            split[np.argsort(-held, kind="stable")] = split.copy()  # ... to the fullest worker
            _place_loadless(split, class_shares[layer], problem.probs[layer], held)
            x_relaxed[members, layer] = split
            held += split.sum(axis=1)
    return x_relaxed


def _wrap_around(share: np.ndarray, probs: np.ndarray, num_members: int) -> np.ndarray:
    """[m, E] split of one layer's class share [E] with equal load per member."""
    split = np.zeros((num_members, len(share)))
    loaded = np.flatnonzero((share > TINY) & (probs > TINY))
    if len(loaded) == 0:
        return split
    target = float(share[loaded] @ probs[loaded]) / num_members
    slot, filled = 0, 0.0
    for expert in _balanced_order(share[loaded], probs[loaded]):
        expert = loaded[expert]
        remaining, prob = float(share[expert]), float(probs[expert])
        while remaining > TINY:
            last = slot == num_members - 1
            take = remaining if last else min(remaining, (target - filled) / prob)
            split[slot, expert] += take
            remaining -= take
            filled += take * prob
            if not last and filled >= target * (1 - TINY):
                slot, filled = slot + 1, 0.0
    return split


def _balanced_order(share: np.ndarray, probs: np.ndarray) -> list[int]:
    """Order items so the load taken so far tracks mean load x count taken so far.

    Take the heaviest remaining item while the prefix is at or below the mean
    load per unit count, the lightest otherwise.
    """
    by_weight = np.argsort(-probs, kind="stable")
    mean = float(share @ probs) / float(share.sum())
    heavy, light = 0, len(by_weight) - 1
    load = count = 0.0
    order = []
    while heavy <= light:
        take_heavy = load <= mean * count
        item = by_weight[heavy] if take_heavy else by_weight[light]
        heavy, light = (heavy + 1, light) if take_heavy else (heavy, light - 1)
        load += share[item] * probs[item]
        count += share[item]
        order.append(int(item))
    return order


def _place_loadless(split: np.ndarray, share: np.ndarray, probs: np.ndarray, held: np.ndarray) -> None:
    """Give each zero-probability expert of the layer whole to the member holding fewest."""
    for expert in np.flatnonzero((share > TINY) & (probs <= TINY)):
        split[np.argmin(held + split.sum(axis=1)), expert] = share[expert]


def solve_lp(problem: PlacementProblem, *, direct: bool = False) -> tuple[float, np.ndarray]:
    """The LP bound (seconds per step) and a per-worker relaxed placement X [N, L, E].

    `direct` solves the paper's N * L * E formulation instead of the class-aggregated
    one; both give the same bound (up to solver tolerance).
    """
    classes = worker_classes(problem, direct=direct)
    lower_bound, shares = solve_class_lp(problem, classes)
    if direct:
        return lower_bound, shares
    return lower_bound, disaggregate(problem, classes, shares)
