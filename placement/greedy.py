"""Greedy construction: heaviest experts first, each where it finishes earliest.

    expert_to_worker = greedy_placement(problem)

Longest-processing-time-first list scheduling applied to the step objective:
experts of all layers are taken in descending routing probability (ties in
row-major (layer, expert) order) and each goes to the worker with room on
which its layer's time after adding it is smallest (ties: the worker with the
most room left, then the lowest index). Heavy experts so land on fast, idle
workers while there is still room there, and light experts fill what is left.
It ignores the LP, costs O(L * E * N), and at scale it is usually far closer to
the LP bound than the paper's rounding; `improved` uses it as a second
starting point.
"""

from __future__ import annotations

import numpy as np

from placement.problem import PlacementProblem


def greedy_placement(problem: PlacementProblem) -> np.ndarray:
    """expert_to_worker [num_layers, num_experts] by heaviest-first list scheduling."""
    seconds = problem.seconds_per_prob  # [N]
    times = np.zeros((problem.num_workers, problem.num_layers))  # [N, L]
    room = np.array(problem.capacities, dtype=np.int64)
    assignment = np.empty(problem.probs.size, dtype=np.int64)
    probs = problem.probs.ravel()
    for flat in np.argsort(-probs, kind="stable"):
        layer = flat // problem.num_experts
        finish = np.where(room > 0, times[:, layer] + seconds * probs[flat], np.inf)
        candidates = np.flatnonzero(finish == finish.min())
        worker = int(candidates[np.argmax(room[candidates])])
        assignment[flat] = worker
        times[worker, layer] += seconds[worker] * probs[flat]
        room[worker] -= 1
    return assignment.reshape(problem.probs.shape)
