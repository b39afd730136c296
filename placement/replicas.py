"""Replicated experts: several copies of an expert, each master sending its rows to its nearest copy.

    table = solve(problem, "improved").as_array()           # one copy of every expert
    routes = replicate(problem, table, time_budget_s=5.0)   # [M, L, E], copies added in spare capacity
    routes = nearest_routes(problem, hosts)                 # hosts [N, L, E] bool -> routes [M, L, E]

With M data-parallel masters (`problem.master_nodes`) a placement may be per-master routes
`[M, L, E]`: master m sends its rows of expert (l, e) to worker routes[m, l, e]. Worker n hosts
(l, e) when some master routes it there, and capacity counts each hosted expert once
(`placement.cost`). A copy pays only when masters on different nodes use different copies: with
a master on every node and one copy per expert, (M-1)/M of all rows cross nodes whatever the
table. With one master a second copy would carry no rows, so `replicate` returns its table.

`replicate` is a descent on the exact objective (`placement.cost.step_time`): no move raises it.
A move re-routes one master's rows of one expert to another worker. It adds a copy when that
worker does not host the expert yet (it needs a free slot there), and drops the old copy when no
other master still uses it, so adding, moving and dropping copies are all such moves:

1. evaluate: per layer, every move (m, e, n) in one vectorised pass. A move changes only its
   layer, so its gain is that layer's time before minus after. Its balance gain is the drop of
   the layer's 4-norm of worker and shared-link times, (sum_r t_r^4)^(1/4).
2. descend: among the feasible moves that do not raise their layer's time, apply the one of
   largest balance gain; when none lowers the norm, the one of largest gain; stop when neither
   gains. Only the moved layer is evaluated again. Layer times are maxima over links, so one
   copy often gains nothing until a second one unloads the other links too: with a master per
   node and three equally busy NICs, a copy near one master unloads two of them. Taking the
   largest gain first would spend every slot on layers where one copy already pays, and never
   start such a layer. The norm counts every busy link, so it starts those pairs.
3. perturb: from the best routes so far, make a few random changes: re-route one master's rows
   of an expert to a worker that hosts it or has room, or swap two copies between workers (a
   full worker can trade a slot no single move frees). Descend again and keep the result only
   if it is strictly better (iterated local search, as `placement.search`). Stop at the time
   budget or after `patience` failures in a row.

The result never costs more than `table` (a final check returns `table` otherwise).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from placement.cost import check_expert_to_worker, master_mass, step_time
from placement.problem import PlacementProblem

DEFAULT_TIME_BUDGET_S = 10.0
IMPROVEMENT_RTOL = 1e-9  # a move must gain this fraction of the objective
BALANCE_NORM = 4  # the balance gain's norm: between the total (1) and the maximum (inf), the objective
DEFAULT_PATIENCE = 100  # failed perturbations in a row before stopping


def nearest_routes(problem: PlacementProblem, hosts: np.ndarray) -> np.ndarray:
    """[M, L, E] each master's route to a copy of every expert, given the copies `hosts [N, L, E]` (bool).

    The rule: a master uses a copy on its own node if there is one, else any copy (each one off
    its node crosses two NICs, its own and the copy's). Among those, it takes the one whose worker's time
    after taking the rows is smallest. That is `seconds_per_prob[n]` times the routing mass all
    masters have sent to n in this layer so far. Ties go to the lowest worker index. Experts go
    heaviest first (ties in expert order), masters in order for each. Without `worker_nodes`
    every copy counts as near.
    """
    hosts_NLE = np.asarray(hosts, dtype=bool)
    shape = (problem.num_workers, problem.num_layers, problem.num_experts)
    if hosts_NLE.shape != shape:
        raise ValueError(f"hosts has shape {hosts_NLE.shape} but the problem is [num_workers, num_layers, "
                         f"num_experts] = {list(shape)}")
    missing = np.argwhere(~hosts_NLE.any(axis=0))
    if len(missing):
        layer, expert = missing[0]
        raise ValueError(f"expert {expert} of layer {layer} has no copy in hosts: host every expert at least once")
    near_MN = _near(problem)
    layers = np.arange(problem.num_layers)
    routes = np.empty((problem.num_masters, problem.num_layers, problem.num_experts), dtype=np.int64)
    load_LN = np.zeros((problem.num_layers, problem.num_workers))  # mass routed so far, all masters
    order_LE = np.argsort(-problem.probs, axis=1, kind="stable")
    for rank in range(problem.num_experts):
        experts = order_LE[:, rank]
        prob_L = problem.probs[layers, experts]
        copies_LN = hosts_NLE[:, layers, experts].T
        for master in range(problem.num_masters):
            near_LN = copies_LN & near_MN[master]
            allowed_LN = np.where(near_LN.any(axis=1, keepdims=True), near_LN, copies_LN)
            after_LN = problem.seconds_per_prob * (load_LN + prob_L[:, None])
            chosen = np.argmin(np.where(allowed_LN, after_LN, np.inf), axis=1)
            routes[master, layers, experts] = chosen
            load_LN[layers, chosen] += prob_L
    return routes


def _near(problem: PlacementProblem) -> np.ndarray:
    """[M, N] whether worker n is on master m's node (all True without node info)."""
    if problem.worker_nodes is None or problem.masters[0] is None:
        return np.ones((problem.num_masters, problem.num_workers), dtype=bool)
    return np.array([[node == master for node in problem.worker_nodes] for master in problem.masters])


def replicate(
    problem: PlacementProblem,
    table: np.ndarray,
    *,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    seed: int = 0,
    patience: int = DEFAULT_PATIENCE,
) -> np.ndarray:
    """Routes [M, L, E] from the one-copy `table [L, E]`, with copies where they lower the step time.

    See the module docstring. With one master it returns `table[None]` unchanged, because a copy
    that carries no rows gains nothing. `seed` drives the perturbations.
    """
    if np.ndim(table) != 2:
        raise ValueError(f"replicate starts from a one-copy table [num_layers, num_experts], got shape "
                         f"{np.shape(table)}: give e.g. solve(problem, 'improved').as_array()")
    table = check_expert_to_worker(problem, table)
    start = np.broadcast_to(table, (problem.num_masters, *table.shape)).copy()
    if problem.num_masters == 1:
        return start
    deadline = time.perf_counter() + time_budget_s
    rng = np.random.default_rng(seed)
    # 1-2. evaluate every move, descend
    best = _State.start(problem, start)
    best.descend(deadline)
    # 3. perturb and descend again, keeping strict improvements
    failures = 0
    while failures < patience and time.perf_counter() < deadline:
        trial = best.copy()
        trial.perturb(rng)
        trial.descend(deadline)
        if trial.objective() < best.objective() * (1 - IMPROVEMENT_RTOL):
            best, failures = trial, 0
        else:
            failures += 1
    routes = best.routes.copy()
    return routes if step_time(problem, routes) <= step_time(problem, table) else start


@dataclass
class _State:
    """Routes, their per-master routing mass and each layer's candidate moves (axes: M, E, N per layer)."""

    probs: np.ndarray  # [L, E]
    link_s: np.ndarray  # [M, N] seconds per unit of master m's routing mass on its link to worker n
    compute_s: np.ndarray  # [N] seconds per unit of routing mass (all masters' mean) on worker n
    shared_s: np.ndarray  # [R] seconds per unit of routing mass through shared link r
    crossings: np.ndarray  # [R, M, N] 1.0 where master m's rows to worker n cross shared link r
    capacities: np.ndarray  # [N]
    routes: np.ndarray  # [M, L, E] worker each master sends each expert's rows to
    uses: np.ndarray  # [N, L, E] masters routing (l, e) to worker n (hosted: > 0)
    counts: np.ndarray  # [N] experts hosted
    mass: np.ndarray  # [M, N, L] routing mass master m sends worker n in layer l
    gain: np.ndarray  # [L, M*E*N] step-time gain of each move (-inf: not a move)
    balance_gain: np.ndarray  # [L, M*E*N] drop of the layer's 4-norm of times
    needs_slot: np.ndarray  # [L, M*E*N] the move adds a copy
    target: np.ndarray  # [M*E*N] worker a move sends to
    now: np.ndarray  # [L] each layer's time

    @classmethod
    def start(cls, problem: PlacementProblem, routes: np.ndarray) -> _State:
        num_masters, num_layers, num_experts = routes.shape
        num_workers = problem.num_workers
        uses = np.zeros((num_workers, num_layers, num_experts), dtype=np.int64)
        layers, experts = np.indices((num_layers, num_experts))
        for table in routes:
            np.add.at(uses, (table, layers, experts), 1)
        moves = num_masters * num_experts * num_workers
        state = cls(problem.probs, problem.master_link_seconds_per_prob, problem.compute_seconds_per_prob,
                    problem.shared_link_seconds_per_prob, problem.shared_link_crossings,
                    np.asarray(problem.capacities), routes, uses, (uses > 0).sum(axis=(1, 2)),
                    master_mass(problem, routes), np.empty((num_layers, moves)), np.empty((num_layers, moves)),
                    np.empty((num_layers, moves), dtype=bool), np.tile(np.arange(num_workers), moves // num_workers),
                    np.empty(num_layers))
        for layer in range(num_layers):
            state.evaluate(layer)
        return state

    def copy(self) -> _State:
        arrays = ("routes", "uses", "counts", "mass", "gain", "balance_gain", "needs_slot", "now")
        return _State(**{**self.__dict__, **{name: getattr(self, name).copy() for name in arrays}})

    def times(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """([N] worker times, [R] shared-link times) of one layer (`placement.cost.layer_times`'s terms)."""
        mass_MN = self.mass[:, :, layer]
        workers = (self.link_s * mass_MN).max(axis=0) + self.compute_s * mass_MN.mean(axis=0)
        links = self.shared_s * np.einsum("rmn,mn->r", self.crossings, mass_MN) / len(mass_MN)
        return workers, links

    def objective(self) -> float:
        return float(self.now.sum())

    def evaluate(self, layer: int) -> None:
        """Fill `gain`, `balance_gain`, `needs_slot` of every move (m, e, n) of `layer`, in one pass."""
        mass_MN = self.mass[:, :, layer]
        num_masters, num_workers = mass_MN.shape
        workers, links = self.times(layer)
        before = self.now[layer] = max(workers.max(), links.max(initial=0.0))
        masters = np.arange(num_masters)[:, None, None]
        source = self.routes[:, layer, :, None]  # [M, E, 1]
        target = np.arange(num_workers)[None, None, :]  # [1, 1, N]
        prob = self.probs[layer][None, :, None]  # [1, E, 1]
        # 1. the source and target workers' times after the move (only master m's link and mass change)
        others = _max_of_others(self.link_s * mass_MN)  # [M, N] the other masters' busiest link to n
        mean = mass_MN.mean(axis=0)
        link = self.link_s[masters, source], self.link_s[masters, target]
        source_after = (np.maximum(link[0] * (mass_MN[masters, source] - prob), others[masters, source])
                        + self.compute_s[source] * (mean[source] - prob / num_masters))
        target_after = (np.maximum(link[1] * (mass_MN[masters, target] + prob), others[masters, target])
                        + self.compute_s[target] * (mean[target] + prob / num_masters))
        # 2. the slowest other worker, and every shared link after the move: [R, M, E, N]
        rest = _max_excluding(workers, source, target)
        shift = self.crossings[:, masters, target] - self.crossings[:, masters, source]
        links_after = links[:, None, None, None] + self.shared_s[:, None, None, None] * prob / num_masters * shift
        slowest_link = links_after.max(axis=0, initial=0.0)
        after = np.maximum(np.maximum(rest, source_after), np.maximum(target_after, slowest_link))
        # 3. gains, and the drop of the layer's norm of times
        p = BALANCE_NORM
        powers = (workers ** p).sum() + (links ** p).sum()
        powers_after = (powers - workers[source] ** p - workers[target] ** p + source_after ** p + target_after ** p
                        + (links_after ** p - links[:, None, None, None] ** p).sum(axis=0))
        balance = powers ** (1 / p) - np.maximum(powers_after, 0.0) ** (1 / p)
        is_move = source != target
        self.gain[layer] = np.where(is_move, before - after, -np.inf).ravel()
        self.balance_gain[layer] = np.where(is_move, balance, -np.inf).ravel()
        self.needs_slot[layer] = (self.uses[:, layer, :].T[None] == 0).repeat(num_masters, axis=0).ravel()

    def best_move(self) -> tuple[int, int] | None:
        """(layer, flat move) to apply next (module docstring, 2.), or None."""
        feasible = ~self.needs_slot | (self.counts < self.capacities)[self.target]
        gain = np.where(feasible, self.gain, -np.inf)
        threshold = IMPROVEMENT_RTOL * self.objective()
        for key in (np.where(gain >= 0.0, self.balance_gain, -np.inf), gain):
            layer, move = np.unravel_index(np.argmax(key), key.shape)
            if key[layer, move] > threshold:
                return int(layer), int(move)
        return None

    def apply(self, layer: int, move: int) -> None:
        """Re-route master m's rows of expert e of `layer` to worker n (flat move m*E*N + e*N + n)."""
        num_experts, num_workers = self.probs.shape[1], len(self.capacities)
        master, rest = divmod(move, num_experts * num_workers)
        expert, target = divmod(rest, num_workers)
        source = self.routes[master, layer, expert]
        prob = self.probs[layer, expert]
        self.routes[master, layer, expert] = target
        self.mass[master, source, layer] -= prob
        self.mass[master, target, layer] += prob
        self.uses[source, layer, expert] -= 1
        self.uses[target, layer, expert] += 1
        self.counts[source] -= self.uses[source, layer, expert] == 0
        self.counts[target] += self.uses[target, layer, expert] == 1
        self.evaluate(layer)

    def descend(self, deadline: float) -> None:
        while time.perf_counter() < deadline:
            move = self.best_move()
            if move is None:
                return
            self.apply(*move)

    def perturb(self, rng: np.random.Generator, num_changes: int = 3) -> None:
        """A few random changes: re-route one master's rows of an expert to a worker that hosts it or has
        room, or swap two copies on different workers (every master using one moves to the other's worker)."""
        num_masters, num_layers, num_experts = self.routes.shape
        for _ in range(num_changes):
            master, layer, expert = (int(rng.integers(size)) for size in (num_masters, num_layers, num_experts))
            if rng.random() < 0.5:
                allowed = (self.uses[:, layer, expert] > 0) | (self.counts < self.capacities)
                self.reroute(master, layer, expert, int(rng.choice(np.flatnonzero(allowed))))
                continue
            source = self.routes[master, layer, expert]
            other = rng.choice(np.argwhere((self.uses > 0) & (np.arange(len(self.counts)) != source)[:, None, None]))
            worker, other_layer, other_expert = (int(i) for i in other)
            if self.uses[worker, layer, expert] == 0 and self.uses[source, other_layer, other_expert] == 0:
                for m in np.flatnonzero(self.routes[:, layer, expert] == source):
                    self.reroute(int(m), layer, expert, worker, check_room=False)
                for m in np.flatnonzero(self.routes[:, other_layer, other_expert] == worker):
                    self.reroute(int(m), other_layer, other_expert, int(source), check_room=False)

    def reroute(self, master: int, layer: int, expert: int, worker: int, *, check_room: bool = True) -> None:
        """`apply` by (master, layer, expert, worker); a no-op when it already goes there."""
        if worker == self.routes[master, layer, expert]:
            return
        assert not check_room or self.uses[worker, layer, expert] > 0 or self.counts[worker] < self.capacities[worker]
        num_experts, num_workers = self.probs.shape[1], len(self.capacities)
        self.apply(layer, (master * num_experts + expert) * num_workers + worker)


def _max_of_others(mass_MN: np.ndarray) -> np.ndarray:
    """[M, N] max over the other masters m' != m of mass_MN[m', n] (0 with one master)."""
    num_masters = len(mass_MN)
    if num_masters == 1:
        return np.zeros_like(mass_MN)
    masked = np.where(np.eye(num_masters, dtype=bool)[:, :, None], -np.inf, mass_MN[None])  # [M, M', N]
    return masked.max(axis=1)


def _max_excluding(times_N: np.ndarray, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Slowest time among workers other than `first` and `second` (broadcast together); 0 if none."""
    order = np.argsort(-times_N, kind="stable")[:3]
    top = np.pad(times_N[order], (0, 3 - len(order)))
    workers = np.pad(order, (0, 3 - len(order)), constant_values=-1)
    first, second = np.broadcast_arrays(first, second)
    keep = (workers != first[..., None]) & (workers != second[..., None])
    return np.where(keep, top, 0.0).max(axis=-1)
