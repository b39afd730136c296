"""Local search that improves a feasible placement without ever making it worse.

    better = improve(problem, expert_to_worker, time_budget_s=1.0, seed=0)

The objective is the cost model's expected step time, sum_l max_n E[T_{n,l}]
(with shared links, sum_l max(max_n E[T_{n,l}], max_r T_{r,l}); `placement.cost`).
Only the slowest worker or shared link of a layer (its bottleneck) counts for
that layer, so the search only tries to take load off bottlenecks:

1. descend: for each pending layer, slowest first, take the experts on its
   bottleneck worker (or on the workers behind its bottleneck shared link),
   heaviest first, and evaluate in one vectorised pass every move of the
   expert to a worker with room and every swap with another worker's expert,
   of this layer or of any other (a cross-layer swap trades capacity between
   layers). Apply the best one if it lowers the objective and mark the layers
   it touched pending; a layer leaves the queue when its bottleneck cannot be
   unloaded.
2. perturb: from the best placement so far, swap a few random bottleneck
   experts with random experts elsewhere, descend from the touched layers, and
   keep the result only if it is strictly better (iterated local search).
   Stop at the time budget or after `patience` perturbations in a row fail.
3. polish: a final descent over all layers, so the result is a local optimum
   whenever the budget allows.

Every step keeps each expert on exactly one worker and every worker within
capacity, and the returned placement is never worse than the input. Shared
links add an [R, N] term per evaluated move and an [R, K] term per swap pass
(K candidate partners); a problem without them skips both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from placement.cost import routing_mass
from placement.problem import PlacementProblem

IMPROVEMENT_RTOL = 1e-9  # a move must gain this fraction of the objective
DEFAULT_PATIENCE = 20  # failed perturbations in a row before stopping


@dataclass
class _State:
    """Mutable search state; times are in units of the fastest worker's link."""

    probs: np.ndarray  # [L, E]
    weight: np.ndarray  # [N] seconds per unit probability / the fastest worker's
    capacities: np.ndarray  # [N]
    assignment: np.ndarray  # [L, E] worker of each expert
    times: np.ndarray  # [N, L] weight[n] * routing mass of worker n in layer l
    counts: np.ndarray  # [N] experts per worker
    link_weight: np.ndarray  # [R] shared link seconds per unit probability / the fastest worker's
    members: np.ndarray  # [R, N] 1.0 where worker n is behind shared link r
    link_times: np.ndarray  # [R, L] link_weight[r] * routing mass of link r's workers in layer l

    @classmethod
    def start(cls, problem: PlacementProblem, expert_to_worker: np.ndarray) -> _State:
        unit = problem.seconds_per_prob.min()
        weight = problem.seconds_per_prob / unit
        assignment = np.array(expert_to_worker, dtype=np.int64)
        mass = routing_mass(problem.probs, assignment, problem.num_workers)
        counts = np.bincount(assignment.ravel(), minlength=problem.num_workers)
        capacities = np.asarray(problem.capacities)
        link_weight = problem.shared_link_seconds_per_prob / unit
        members = problem.shared_link_members
        return cls(problem.probs, weight, capacities, assignment, weight[:, None] * mass, counts,
                   link_weight, members, link_weight[:, None] * (members @ mass))

    @property
    def has_links(self) -> bool:
        return len(self.link_weight) > 0

    def layer_max(self) -> np.ndarray:
        """[L] each layer's time: its slowest worker or shared link."""
        if not self.has_links:
            return self.times.max(axis=0)
        return np.maximum(self.times.max(axis=0), self.link_times.max(axis=0))

    def objective(self) -> float:
        return float(self.layer_max().sum())

    def copy(self) -> _State:
        return _State(self.probs, self.weight, self.capacities, self.assignment.copy(),
                      self.times.copy(), self.counts.copy(), self.link_weight, self.members,
                      self.link_times.copy())

    def link_shift(self, source: int) -> np.ndarray:
        """[R, N] +1 where worker n is behind shared link r and `source` is not, -1 the reverse, else 0.

        Moving probability q from `source` to n changes link r's time by link_weight[r] * q * shift[r, n].
        """
        return self.members - self.members[:, [source]]

    def is_bottleneck(self, layer: int) -> np.ndarray:
        """[N] whether worker n's experts of `layer` carry its time: its slowest worker unless a
        shared link is slower, and the workers behind every shared link as slow as the layer."""
        slowest = int(self.times[:, layer].argmax())
        mask = np.zeros(len(self.weight), dtype=bool)
        if not self.has_links:
            mask[slowest] = True
            return mask
        layer_time = max(self.times[slowest, layer], self.link_times[:, layer].max())
        mask[slowest] = self.times[slowest, layer] >= layer_time
        return mask | self.members[self.link_times[:, layer] >= layer_time].any(axis=0)

    def move(self, layer: int, expert: int, worker: int) -> None:
        """Put expert (layer, expert) on `worker`, updating times (of workers and shared links) and counts."""
        source = self.assignment[layer, expert]
        prob = self.probs[layer, expert]
        self.times[source, layer] -= self.weight[source] * prob
        self.times[worker, layer] += self.weight[worker] * prob
        self.counts[source] -= 1
        self.counts[worker] += 1
        self.assignment[layer, expert] = worker
        if self.has_links:
            self.link_times[:, layer] += self.link_weight * prob * (self.members[:, worker] - self.members[:, source])


def improve(
    problem: PlacementProblem,
    expert_to_worker: np.ndarray,
    *,
    time_budget_s: float,
    seed: int = 0,
    patience: int = DEFAULT_PATIENCE,
) -> np.ndarray:
    """Return a placement [L, E] no worse than `expert_to_worker` (see module docstring)."""
    deadline = time.perf_counter() + time_budget_s
    rng = np.random.default_rng(seed)
    all_layers = range(problem.num_layers)
    best = _State.start(problem, expert_to_worker)
    # 1. descend from the start
    _descend(best, all_layers, deadline)
    # 2. perturb and descend again, keeping strict improvements only
    failures = 0
    while failures < patience and time.perf_counter() < deadline:
        trial = best.copy()
        touched = _perturb(trial, rng)
        _descend(trial, touched, deadline)
        if trial.objective() < best.objective() * (1 - IMPROVEMENT_RTOL):
            best, failures = trial, 0
        else:
            failures += 1
    # 3. polish
    _descend(best, all_layers, deadline)
    return best.assignment


def _descend(state: _State, layers, deadline: float) -> None:
    """Unload bottlenecks of pending layers, slowest first, until none can be."""
    pending = set(int(layer) for layer in layers)
    while pending and time.perf_counter() < deadline:
        layer_max = state.layer_max()
        layer = max(pending, key=lambda candidate: layer_max[candidate])
        touched = _unload_bottleneck(state, layer)
        if touched:
            pending.update(touched)
        else:
            pending.discard(layer)


def _unload_bottleneck(state: _State, layer: int) -> tuple[int, ...]:
    """Apply the best improving move or swap of an expert off the layer's bottleneck.

    Returns the layers it changed (empty if nothing improves).
    """
    layer_max = state.layer_max()
    top = _top3(state.times)
    experts = np.flatnonzero(state.is_bottleneck(layer)[state.assignment[layer]])
    for expert in experts[np.argsort(-state.probs[layer, experts], kind="stable")]:
        touched = _apply_best_move(state, layer, int(expert), layer_max, top)
        if touched:
            return touched
    return ()


def _apply_best_move(state: _State, layer: int, expert: int, layer_max, top) -> tuple[int, ...]:
    """Apply the best move or swap of one expert if it improves; return the layers changed."""
    source = int(state.assignment[layer, expert])
    prob = state.probs[layer, expert]
    # 1. this layer's new maximum if the expert alone went to each worker
    rest_here = _rest_of_layer(*(part[layer] for part in top), source, len(state.weight))
    taker_after = state.times[:, layer] + state.weight * prob
    source_after = state.times[source, layer] - state.weight[source] * prob
    layer_after = np.maximum(np.maximum(rest_here, taker_after), source_after)
    if state.has_links:  # each shared link after the move, slowest per taker
        links_after = state.link_times[:, [layer]] + state.link_weight[:, None] * prob * state.link_shift(source)
        layer_after = np.maximum(layer_after, links_after.max(axis=0))
    move_gain = layer_max[layer] - layer_after
    move_gain[source] = -np.inf
    # 2. the best move to a worker with room, and the best swap
    with_room = np.where(state.counts < state.capacities, move_gain, -np.inf)
    move_to = int(np.argmax(with_room))
    swap_gain, swap_with = _best_swap(state, layer, expert, move_gain > 0, rest_here, layer_max, top)
    # 3. apply the better one if it gains enough
    if max(with_room[move_to], swap_gain) <= IMPROVEMENT_RTOL * layer_max.sum():
        return ()
    if with_room[move_to] >= swap_gain:
        state.move(layer, expert, move_to)
        return (layer,)
    other_layer, other_expert = divmod(swap_with, state.probs.shape[1])
    state.move(layer, expert, int(state.assignment[other_layer, other_expert]))
    state.move(other_layer, other_expert, source)
    return (layer, other_layer)


def _top3(times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the three slowest workers and their times: ([L, 3], [L, 3]), padded with -1 / 0."""
    num_workers, num_layers = times.shape
    padded = np.vstack([times, np.zeros((3, num_layers))])
    order = np.argsort(-padded, axis=0, kind="stable")[:3].T  # [L, 3]
    workers = np.where(order < num_workers, order, -1)
    return workers, np.take_along_axis(padded.T, order, axis=1)


def _rest_of_layer(top_workers: np.ndarray, top_times: np.ndarray, source: int, num_workers: int) -> np.ndarray:
    """[N] slowest time of one layer among workers other than `source` and n, for each n.

    top_workers, top_times: [3] the layer's three slowest workers (from `_top3`).
    """
    keep = top_workers != source
    workers, times = top_workers[keep], top_times[keep]
    rest = np.full(num_workers, times[0])
    if workers[0] >= 0:
        rest[workers[0]] = times[1]
    return rest


def _max_excluding(top_workers, top_times, layers, first, second) -> np.ndarray:
    """Slowest time in each of `layers` among workers other than `first` and `second`."""
    workers, times = top_workers[layers], top_times[layers]
    keep = (workers != np.reshape(first, (-1, 1))) & (workers != np.reshape(second, (-1, 1)))
    return np.where(keep, times, 0.0).max(axis=1)


def _best_swap(state, layer, expert, takes, rest_here, layer_max, top) -> tuple[float, int]:
    """(gain, flat index) of the best swap of (layer, expert) with an expert on another worker.

    takes: [N] whether worker n could take the expert without reaching this
    layer's maximum. Cross-layer partners are only sought on those workers: a
    swap that does not help this layer is found from the partner's layer
    instead, if it helps there. rest_here: [N] from `_rest_of_layer`.
    """
    num_experts = state.probs.shape[1]
    source = state.assignment[layer, expert]
    prob = state.probs[layer, expert]
    w_src = state.weight[source]
    # 1. candidates: this layer's experts elsewhere, other layers' experts on takers
    flat_workers = state.assignment.ravel()
    is_candidate = takes[flat_workers]
    is_candidate[layer * num_experts:(layer + 1) * num_experts] = state.assignment[layer] != source
    candidates = np.flatnonzero(is_candidate)
    if len(candidates) == 0:
        return -np.inf, -1
    partner = flat_workers[candidates]
    partner_prob = state.probs.ravel()[candidates]
    partner_layer = candidates // num_experts
    same = partner_layer == layer
    w_dst = state.weight[partner]
    # 2. this layer: source sheds prob (takes partner's back if same layer), partner the reverse
    src_here = state.times[source, layer] - w_src * prob + same * w_src * partner_prob
    dst_here = state.times[partner, layer] + w_dst * prob - same * w_dst * partner_prob
    here = np.maximum(np.maximum(rest_here[partner], src_here), dst_here)
    # 3. partner's layer (cross-layer swaps only): partner's worker sheds, source takes
    dst_there = state.times[partner, partner_layer] - w_dst * partner_prob
    src_there = state.times[source, partner_layer] + w_src * partner_prob
    rest_there = _max_excluding(*top, partner_layer, source, partner)
    there = np.maximum(np.maximum(rest_there, dst_there), src_there)
    # 4. shared links: net prob (prob - partner's if same layer) moves source -> partner here,
    #    the partner's prob moves back there: [R, K] link times after, slowest per candidate
    if state.has_links:
        shift = state.link_shift(source)[:, partner] * state.link_weight[:, None]
        links_here = state.link_times[:, [layer]] + shift * (prob - same * partner_prob)
        links_there = state.link_times[:, partner_layer] - shift * partner_prob
        here = np.maximum(here, links_here.max(axis=0))
        there = np.maximum(there, links_there.max(axis=0))
    gain = layer_max[layer] - here
    gain = np.where(same, gain, gain + (layer_max[partner_layer] - there))
    best = int(np.argmax(gain))
    return float(gain[best]), int(candidates[best])


def _perturb(state: _State, rng: np.random.Generator, num_swaps: int = 3) -> set[int]:
    """Swap a few bottleneck experts with random experts on other workers; return layers touched."""
    num_layers, num_experts = state.probs.shape
    touched: set[int] = set()
    for _ in range(num_swaps):
        layer = int(rng.integers(num_layers))
        bottleneck = state.is_bottleneck(layer)
        mine = np.flatnonzero(bottleneck[state.assignment[layer]])
        others = np.flatnonzero(~bottleneck[state.assignment.ravel()])
        if len(mine) == 0 or len(others) == 0:
            continue
        expert = int(rng.choice(mine))
        source = int(state.assignment[layer, expert])
        other_layer, other_expert = divmod(int(rng.choice(others)), num_experts)
        state.move(layer, expert, int(state.assignment[other_layer, other_expert]))
        state.move(other_layer, other_expert, source)
        touched.update((layer, other_layer))
    return touched
