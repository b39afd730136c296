"""DeepSeek's EPLB (expert-parallel load balancer) as a baseline for replicated placements.

    routes = eplb_routes(problem)                         # [M, L, E], each master to its nearest copy
    copies = eplb_copies(probs, eplb_slots(problem), worker_nodes)   # [N, L, E] copies per worker

EPLB (github.com/deepseek-ai/EPLB, `rebalance_experts`) balances each GPU's expert load, i.e.
its compute. It never looks at links or at where tokens come from. Per layer:

1. pack expert groups onto nodes, the same number per node (balanced packing: heaviest first,
   each to the lightest node that still has room; ties go to the lowest index);
2. within each node, fill the node's physical slots: one copy of each of its experts, then
   each extra copy to the expert with the highest load per copy;
3. pack the node's physical experts (each carrying load / copies of its expert) onto the
   node's GPUs by the same balanced packing, with as many as each GPU has slots.

When the groups do not divide among the nodes (EPLB: `num_groups % num_nodes != 0`), it uses
its global policy: steps 2 and 3 over all GPUs as one node (Mixtral's 8 experts, each its own
group, on 3 nodes). This rewrite also takes that path when a node has fewer slots in a layer
than the experts step 1 would give it. With equal slots it puts the same copies on every GPU as
EPLB's `rebalance_experts` (checked on 300 random instances, both policies, while writing it).

Slots (`eplb_slots`): EPLB gives every GPU the same number of physical experts of every layer,
`num_replicas / num_gpus`. We give each worker min_n(C_n) // L slots per layer, a multiple of
N per layer, when that holds every expert. Otherwise, when capacities are too tight for it
(Mixtral's 32 layers x 8 experts with 43 slots per worker: 1 per layer, 6 < 8), every layer
gets exactly E slots and no redundant copy. The slots of a layer are dealt one at a time to
the worker with the most capacity left (ties: lowest index). The few spare slots then stay
empty; EPLB's per-layer slots have no use for them.

Two copies of one expert on one GPU count as one hosted copy carrying both loads.
`eplb_routes` then routes each master's rows to its nearest copy (`nearest_routes`). A copy no
master picks carries no rows in this model and drops out of the routes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from placement.problem import PlacementProblem
from placement.replicas import nearest_routes


def eplb_routes(problem: PlacementProblem, *, num_groups: int | None = None) -> np.ndarray:
    """[M, L, E] EPLB's copies of every expert (module docstring), each master routed to its nearest copy.

    num_groups: expert groups of the model (DeepSeek-V3: 8). None means each expert is its own group.
    """
    copies = eplb_copies(problem.probs, eplb_slots(problem), problem.worker_nodes, num_groups=num_groups)
    return nearest_routes(problem, copies > 0)


def eplb_slots(problem: PlacementProblem) -> np.ndarray:
    """[N, L] EPLB's physical slots of worker n in layer l, from our per-worker capacities (module docstring)."""
    num_workers, num_layers, num_experts = problem.num_workers, problem.num_layers, problem.num_experts
    per_layer = min(problem.capacities) // num_layers
    if per_layer * num_workers >= num_experts:
        return np.full((num_workers, num_layers), per_layer, dtype=np.int64)
    left = np.array(problem.capacities, dtype=np.int64)
    slots = np.zeros((num_workers, num_layers), dtype=np.int64)
    for layer in range(num_layers):
        for _ in range(num_experts):
            worker = int(np.argmax(left))
            slots[worker, layer] += 1
            left[worker] -= 1
    return slots


def eplb_copies(
    probs: np.ndarray, slots: np.ndarray, worker_nodes: Sequence[str] | None = None, *, num_groups: int | None = None
) -> np.ndarray:
    """[N, L, E] copies of expert e of layer l on worker n by EPLB's hierarchical balancing.

    probs: [L, E] expert load (routing probability: rows per token); slots: [N, L] physical
    experts worker n holds of layer l (each layer's sum at least E); worker_nodes: [N] node of
    each worker (None: one node); num_groups: expert groups (None: E, each expert its own).
    """
    probs, slots = np.asarray(probs, dtype=np.float64), np.asarray(slots, dtype=np.int64)
    num_layers, num_experts = probs.shape
    groups = num_experts if num_groups is None else num_groups
    if groups < 1 or num_experts % groups:
        raise ValueError(f"num_groups = {num_groups} does not divide the {num_experts} experts: give a divisor "
                         "of num_experts (the model's expert groups), or None")
    short = np.flatnonzero(slots.sum(axis=0) < num_experts)
    if len(short):
        raise ValueError(f"layer {short[0]} has {slots[:, short[0]].sum()} slots for {num_experts} experts: "
                         "give every layer at least one slot per expert")
    nodes = list(dict.fromkeys(worker_nodes or ["all"] * len(slots)))
    node_workers = [np.flatnonzero(np.asarray(worker_nodes or ["all"] * len(slots)) == node) for node in nodes]
    copies = np.zeros((len(slots), num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        copies[:, layer] = _layer_copies(probs[layer], slots[:, layer], node_workers, groups)
    return copies


def _layer_copies(load_E: np.ndarray, slots_N: np.ndarray, node_workers: list[np.ndarray], groups: int) -> np.ndarray:
    """[N, E] copies per worker of one layer: groups to nodes, copies within nodes, copies to GPUs."""
    num_experts, num_nodes = len(load_E), len(node_workers)
    # 1. groups to nodes (or all GPUs as one node: EPLB's global policy)
    experts_of_node = [np.arange(num_experts)]
    hierarchical = num_nodes > 1 and groups % num_nodes == 0
    if hierarchical:
        node_of_group = balanced_packing(load_E.reshape(groups, -1).sum(axis=1), [groups // num_nodes] * num_nodes)
        node_of_expert = np.repeat(node_of_group, num_experts // groups)
        experts_of_node = [np.flatnonzero(node_of_expert == node) for node in range(num_nodes)]
        hierarchical = all(slots_N[w].sum() >= len(e) for w, e in zip(node_workers, experts_of_node))
    if not hierarchical:
        node_workers, experts_of_node = [np.arange(len(slots_N))], [np.arange(num_experts)]
    copies = np.zeros((len(slots_N), num_experts), dtype=np.int64)
    for workers, experts in zip(node_workers, experts_of_node):
        # 2. copies within the node
        physical = replicate_physical(load_E[experts], int(slots_N[workers].sum()))  # indices into experts
        count = np.bincount(physical, minlength=len(experts))
        # 3. physical experts to the node's GPUs
        gpu = balanced_packing((load_E[experts] / count)[physical], slots_N[workers])
        np.add.at(copies, (workers[gpu], experts[physical]), 1)
    return copies


def balanced_packing(weights: np.ndarray, pack_sizes: Sequence[int]) -> np.ndarray:
    """[num_items] pack of each item: heaviest first, each to the lightest pack with room (ties: lowest index).

    pack_sizes: [num_packs] items each pack takes; they sum to the number of items (EPLB: all equal).
    With one item per pack, item i goes to pack i, as in EPLB.
    """
    room = np.array(pack_sizes, dtype=np.int64)
    assert room.sum() == len(weights), "pack sizes must sum to the number of items"
    if (room == 1).all():
        return np.arange(len(room))
    packs = np.empty(len(weights), dtype=np.int64)
    pack_load = np.zeros(len(room))
    for item in np.argsort(-np.asarray(weights), kind="stable"):
        pack = int(np.argmin(np.where(room > 0, pack_load, np.inf)))
        packs[item] = pack
        pack_load[pack] += weights[item]
        room[pack] -= 1
    return packs


def replicate_physical(weights: np.ndarray, num_physical: int) -> np.ndarray:
    """[num_physical] item of each physical copy: every item once, then each extra copy (in the order
    they are made) to the item of highest weight per copy (ties: lowest index)."""
    count = np.ones(len(weights), dtype=np.int64)
    physical = list(range(len(weights)))
    for _ in range(num_physical - len(weights)):
        item = int(np.argmax(weights / count))
        physical.append(item)
        count[item] += 1
    return np.array(physical, dtype=np.int64)
