"""The paper's rounding of a relaxed placement to a feasible one (Section IV-B).

    expert_to_worker = round_relaxed(x_relaxed, capacities)

1. Threshold: X > 0.5 becomes 1, anything else 0.
2. On each worker over its capacity, drop the assignments with the lowest
   relaxed values until it fits (ties: lower (layer, expert) index first).
3. Give every unassigned expert, in (layer, expert) row-major order, to the
   worker that still has room and has the highest relaxed value for it
   (ties: lowest worker index).

It is a pure function of its inputs so it can be checked on hand-made matrices.
"""

from __future__ import annotations

import numpy as np

UNASSIGNED = -1


def round_relaxed(x_relaxed: np.ndarray, capacities: list[int] | np.ndarray) -> np.ndarray:
    """Round X [num_workers, num_layers, num_experts] to expert_to_worker [num_layers, num_experts].

    capacities: [num_workers] experts each worker can hold; must sum to at least L * E.
    """
    x_relaxed = np.asarray(x_relaxed, dtype=np.float64)
    capacities = np.asarray(capacities, dtype=np.int64)
    if x_relaxed.ndim != 3 or x_relaxed.shape[0] != len(capacities):
        raise ValueError(
            f"x_relaxed must be [num_workers={len(capacities)}, num_layers, num_experts], "
            f"got shape {x_relaxed.shape}"
        )
    if capacities.sum() < x_relaxed[0].size:
        raise ValueError(
            f"capacities sum to {capacities.sum()} but {x_relaxed[0].size} experts must be placed"
        )
    flat_x = x_relaxed.reshape(len(capacities), -1)  # [N, L*E]
    # 1. threshold at 0.5 (argmax keeps one worker per expert even if columns do not sum to 1)
    assignment = np.where(flat_x.max(axis=0) > 0.5, flat_x.argmax(axis=0), UNASSIGNED)
    # 2. unload over-capacity workers, lowest relaxed value first
    for worker, capacity in enumerate(capacities):
        held = np.flatnonzero(assignment == worker)
        excess = len(held) - capacity
        if excess > 0:
            by_value = np.lexsort((held, flat_x[worker, held]))
            assignment[held[by_value[:excess]]] = UNASSIGNED
    # 3. unassigned experts, row-major, to the strongest-affinity worker with room
    room = capacities - np.bincount(assignment[assignment >= 0], minlength=len(capacities))
    for expert in np.flatnonzero(assignment == UNASSIGNED):
        worker = int(np.argmax(np.where(room > 0, flat_x[:, expert], -np.inf)))
        assignment[expert] = worker
        room[worker] -= 1
    return assignment.reshape(x_relaxed.shape[1:])
