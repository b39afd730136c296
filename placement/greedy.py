"""Greedy construction: heaviest experts first, each where it finishes earliest.

    expert_to_worker = greedy_placement(problem)

Longest-processing-time-first list scheduling applied to the step objective:
experts of all layers are taken in descending routing probability (ties in
row-major (layer, expert) order) and each goes to the worker with room on
which its layer's time after adding it is smallest (ties: the worker with the
most room left, then the lowest index). With shared links a worker's time
after adding it is the later of its own and that of each shared link it is
behind (a worker behind a busy NIC finishes when the NIC does). Heavy experts so land on fast, idle
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
    link_seconds = problem.shared_link_seconds_per_prob  # [R]
    members = problem.shared_link_members  # [R, N] share of each worker's rows crossing link r
    link_times = np.zeros((len(link_seconds), problem.num_layers))  # [R, L]
    room = np.array(problem.capacities, dtype=np.int64)
    assignment = np.empty(problem.probs.size, dtype=np.int64)
    probs = problem.probs.ravel()
    for flat in np.argsort(-probs, kind="stable"):
        layer = flat // problem.num_experts
        finish = times[:, layer] + seconds * probs[flat]
        if len(link_seconds):  # each worker's busiest shared link, had it taken the expert
            link_after = link_times[:, layer, None] + (link_seconds * probs[flat])[:, None] * members  # [R, N]
            finish = np.maximum(finish, np.where(members > 0, link_after, 0.0).max(axis=0))
        finish = np.where(room > 0, finish, np.inf)
        candidates = np.flatnonzero(finish == finish.min())
        worker = int(candidates[np.argmax(room[candidates])])
        assignment[flat] = worker
        times[worker, layer] += seconds[worker] * probs[flat]
        if len(link_seconds):
            link_times[:, layer] += link_seconds * members[:, worker] * probs[flat]
        room[worker] -= 1
    return assignment.reshape(problem.probs.shape)
