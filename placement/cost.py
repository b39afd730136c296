"""The cost model: expected communication time (and, if given, expert compute) and bytes of any placement, and
the training step it predicts.

A placement is `expert_to_worker: [num_layers, num_experts]` ints (worker of
expert e of layer l). With X[n,l,e] = 1 where expert_to_worker[l,e] == n:

    E[T_{n,l}] = passes * b*H / (4 * B_n) * sum_e X[n,l,e] * P[l,e] * K     (paper eq. 6)
    step time  = sum_l max_n E[T_{n,l}]                                      (paper eq. 7)

With `problem.shared_links` (links several workers' traffic crosses, such as
the master node's NIC), each shared link r with bandwidth B_r (each direction) is busy

    T_{r,l} = passes * b*H / (8 * B_r) * sum_{n in r} sum_e X[n,l,e] * P[l,e] * K

in layer l (half a worker link's term: a NIC carries rows out and outputs back at the same time, each
direction at B_r; `problem.SharedLink`), and a layer waits for it as for a worker:

    step time  = sum_l max(max_n E[T_{n,l}], max_r T_{r,l})

Without shared links this is eq. 7 exactly. Every evaluation of a placement
(solvers, reports, benchmarks) goes through `layer_times` here.

With `problem.compute_seconds_per_row` (c_n), E[T_{n,l}] also counts worker n's
arithmetic, c_n * K * sum_e X[n,l,e] * P[l,e]: the paper's model lets a fast link
attract more rows than the worker behind it can compute in that time.

With M data-parallel masters (`problem.master_nodes`) each master sends 1/M of the
rows: a master-worker link carries 1/M of what a lone master's would (B_n is the
slowest of worker n's master links), a NIC carries the rows of the (master, worker)
pairs it separates. A placement is then either one table for all masters, or
`routes [M, L, E]`, each master's own table (replicated experts: the workers hosting
an expert are those any master routes it to); with routes, worker n's link time is
that of its busiest master link (each at its own bandwidth, `problem.master_bandwidths`),
its compute that of all masters' rows.

The forward pass sends each (token, expert) row to its worker and gathers the
output back: b*H/8 bytes each way, b*H/4 per row, as in the paper. The
backward pass sends the output-grad and receives the input-grad, the same
size again, so with `problem.include_backward` (the default) `passes` is 2 and
every time and byte count here is doubled; with it off, only the forward pass
(the paper's eq. 5-6) is counted.

    report = cost_report(problem, expert_to_worker)
    report.step_time, report.worker_bytes, report.cross_node_bytes

The step prediction (`predict_step`) is what a training step takes, not only what placement minimises. Every
call a layer makes (one per pass and micro-batch: `problem.calls_per_layer`) also pays the latency lat_n of each
worker it contacts (`problem.latencies_s`), and each worker's compute counts whether or not the objective
counts it (`problem.compute_in_objective`):

    R_l = max(max_{n contacted in l} (calls * lat_n + (passes * b*H / (4 * B_n) + c_n) * K * sum_e X[n,l,e] * P[l,e]),
              max_r T_{r,l})
    serial step      = C + sum_l R_l                                         (C: the master's compute)
    overlapped step  = max(C, R) + min(C, R) / micro_batches                 (R = sum_l R_l)

The serial step is the master computing, then waiting on each layer's round trips in turn (what one
micro-batch at a time does). With several micro-batches in flight (`TrainingStep.in_flight` > 1) the master
computes one while another's rows are at the experts; the overlapped step is Johnson's two-machine flow
shop with each micro-batch one job (its compute, then its round trips), the master and the round trips each
busy with one at a time (the data plane carries one call at a time, and the same bytes cross the same
links): the step waits for the busier of the two, plus the first micro-batch's compute or the last one's
round trips, whichever is shorter. Optimistic where the master's threads contend (they share one interpreter).
Without latencies and `training_step` the serial step is `step_time` exactly.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from placement.problem import PlacementProblem


def check_table(
    expert_to_worker: Any,
    capacities: Sequence[int],
    *,
    shape: tuple[int, int] | None = None,
    source: str | None = None,
) -> np.ndarray:
    """Validate a [num_layers, num_experts] table of worker ids against per-worker capacities.

    The one placement validator: `check_expert_to_worker` (solvers, cost model),
    `Placement`'s own check and `Placement.check_fits` all come here, so a bad
    placement reads the same wherever it is caught. `shape`: the (num_layers,
    num_experts) it must have; `source`: where the table came from (a file),
    named at the start of every message. Returns the table as int64.
    """
    what = f"placement {source}" if source else "expert_to_worker"
    table = _as_table(expert_to_worker, what)
    if shape is not None and table.shape != tuple(shape):
        raise ValueError(
            f"{what} has shape {table.shape} but the problem is [num_layers, num_experts] = "
            f"{list(shape)}: solve again for this problem (vela place)"
        )
    num_workers = len(capacities)
    if table.min() < 0 or table.max() >= num_workers:
        bad = table.min() if table.min() < 0 else table.max()
        raise ValueError(f"{what} holds worker {bad} but there are only workers 0..{num_workers - 1}")
    counts = experts_per_worker(num_workers, table)
    over = np.flatnonzero(counts > np.asarray(capacities))
    if len(over):
        n = int(over[0])
        raise ValueError(
            f"{what} puts {counts[n]} experts on worker {n}, over its capacity {capacities[n]} "
            f"(capacities[{n}]): solve again for these capacities"
        )
    return table


def _as_table(expert_to_worker: Any, what: str) -> np.ndarray:
    """A non-empty 2-D int64 array of worker ids, or a ValueError naming `what`."""
    rows = expert_to_worker if isinstance(expert_to_worker, list) else None
    if rows is not None and len({len(row) if isinstance(row, list) else -1 for row in rows}) > 1:
        raise ValueError(f"{what} must be a non-empty [num_layers][num_experts] table; its rows differ in length")
    table = np.asarray(expert_to_worker)
    if table.ndim != 2 or table.size == 0:
        raise ValueError(
            f"{what} must be a non-empty [num_layers][num_experts] table of worker ids, got shape {table.shape}"
        )
    if not np.issubdtype(table.dtype, np.integer):
        raise ValueError(f"{what} must hold integer worker ids, got {table.dtype}")
    return table.astype(np.int64)


def check_expert_to_worker(problem: PlacementProblem, expert_to_worker: np.ndarray) -> np.ndarray:
    """`check_table` for a placement of `problem`: its shape, worker ids and capacities; int64 table.

    Also takes per-master `routes [M, L, E]` (M = problem.num_masters), whose capacity counts
    each expert a worker hosts once however many masters route to it."""
    shape = (problem.num_layers, problem.num_experts)
    routes = np.asarray(expert_to_worker)
    if routes.ndim != 3:
        return check_table(expert_to_worker, problem.capacities, shape=shape)
    if routes.shape != (problem.num_masters, *shape):
        raise ValueError(f"routes have shape {routes.shape} but the problem is [num_masters, num_layers, "
                         f"num_experts] = {[problem.num_masters, *shape]}")
    for table in routes:
        check_table(table, [problem.num_layers * problem.num_experts] * problem.num_workers, shape=shape)
    counts = experts_per_worker(problem.num_workers, routes)
    over = np.flatnonzero(counts > np.asarray(problem.capacities))
    if len(over):
        raise ValueError(f"routes host {counts[over[0]]} experts on worker {over[0]}, over its capacity "
                         f"{problem.capacities[over[0]]} (capacities[{over[0]}])")
    return routes.astype(np.int64)


def experts_per_worker(num_workers: int, expert_to_worker: np.ndarray) -> np.ndarray:
    """[num_workers] number of experts placed on each worker (routes [M, L, E]: distinct experts hosted)."""
    table = np.asarray(expert_to_worker)
    if table.ndim == 3:
        return hosted(table, num_workers).sum(axis=(1, 2))
    return np.bincount(np.ravel(table), minlength=num_workers)


def hosted(routes_MLE: np.ndarray, num_workers: int) -> np.ndarray:
    """[num_workers, L, E] bool: whether worker n hosts expert (l, e), i.e. some master routes it there."""
    routes_MLE = np.asarray(routes_MLE)
    out = np.zeros((num_workers, *routes_MLE.shape[1:]), dtype=bool)
    layers, experts = np.indices(routes_MLE.shape[1:])
    for table in routes_MLE:
        out[table, layers, experts] = True
    return out


def master_routes(problem: PlacementProblem, expert_to_worker: np.ndarray) -> np.ndarray:
    """[M, L, E] each master's table: `expert_to_worker` itself if it is per-master routes, else repeated."""
    table = np.asarray(expert_to_worker, dtype=np.int64)
    return table if table.ndim == 3 else np.broadcast_to(table, (problem.num_masters, *table.shape))


def routing_mass(probs_LE: np.ndarray, expert_to_worker_LE: np.ndarray, num_workers: int) -> np.ndarray:
    """[num_workers, num_layers] routing probability mass each worker serves per layer.

    Entry [n, l] = sum_e X[n,l,e] * P[l,e], the expected rows per token; a worker that holds
    no expert gets a row of zeros. The one place this sum is computed (cost model, local
    search, load metrics and the report all call it).
    """
    probs_LE = np.asarray(probs_LE, dtype=np.float64)
    table_LE = np.asarray(expert_to_worker_LE, dtype=np.int64)
    if table_LE.shape != probs_LE.shape:
        raise ValueError(f"expert_to_worker has shape {table_LE.shape} but the profile {probs_LE.shape}; "
                         "give the profile the placement was solved for")
    mass = np.zeros((num_workers, probs_LE.shape[0]))
    layers = np.broadcast_to(np.arange(probs_LE.shape[0])[:, None], probs_LE.shape)
    np.add.at(mass, (table_LE, layers), probs_LE)
    return mass


def master_mass(problem: PlacementProblem, expert_to_worker: np.ndarray) -> np.ndarray:
    """[M, num_workers, num_layers] `routing_mass` of each master's table."""
    return np.stack([routing_mass(problem.probs, table, problem.num_workers)
                     for table in master_routes(problem, expert_to_worker)])


def worker_layer_probs(problem: PlacementProblem, expert_to_worker: np.ndarray) -> np.ndarray:
    """[num_workers, num_layers] `routing_mass` of a placement of `problem` (averaged over masters'
    routes: the rows per token a worker serves)."""
    if np.ndim(expert_to_worker) == 2:
        return routing_mass(problem.probs, expert_to_worker, problem.num_workers)
    return master_mass(problem, expert_to_worker).mean(axis=0)


def layer_worker_times(problem: PlacementProblem, expert_to_worker: np.ndarray) -> np.ndarray:
    """[num_workers, num_layers] expected seconds E[T_{n,l}] per training step."""
    if np.ndim(expert_to_worker) == 2:
        return problem.seconds_per_prob[:, None] * worker_layer_probs(problem, expert_to_worker)
    mass = master_mass(problem, expert_to_worker)  # [M, N, L]
    links = problem.master_link_seconds_per_prob[:, :, None] * mass  # each master's link to each worker
    return links.max(axis=0) + problem.compute_seconds_per_prob[:, None] * mass.mean(axis=0)


def shared_link_times(problem: PlacementProblem, expert_to_worker: np.ndarray) -> np.ndarray:
    """[num_shared_links, num_layers] seconds T_{r,l} each shared link is busy per layer and step."""
    if np.ndim(expert_to_worker) == 2:
        mass = worker_layer_probs(problem, expert_to_worker)
        return problem.shared_link_seconds_per_prob[:, None] * (problem.shared_link_members @ mass)
    mass = master_mass(problem, expert_to_worker)  # [M, N, L]
    crossed = np.einsum("rmn,mnl->rl", problem.shared_link_crossings, mass) / problem.num_masters
    return problem.shared_link_seconds_per_prob[:, None] * crossed


def layer_times(problem: PlacementProblem, expert_to_worker: np.ndarray) -> np.ndarray:
    """[num_layers] expected seconds of each layer: its slowest worker or shared link."""
    slowest_worker = layer_worker_times(problem, expert_to_worker).max(axis=0)
    return np.maximum(slowest_worker, shared_link_times(problem, expert_to_worker).max(axis=0, initial=0.0))


def step_time(problem: PlacementProblem, expert_to_worker: np.ndarray) -> float:
    """Expected seconds per step: sum_l max(max_n E[T_{n,l}], max_r T_{r,l}) (module docstring)."""
    return float(layer_times(problem, expert_to_worker).sum())


def round_trip_times(problem: PlacementProblem, expert_to_worker: np.ndarray) -> np.ndarray:
    """[num_layers] seconds per step the master waits on each layer's experts: its slowest contacted worker's
    latencies + link + compute, or its slowest shared link (module docstring; `layer_times` with the latency,
    and with every worker's compute).

    Latency is no term of the objective: a layer waits for its slowest contacted worker, and with top-k routing
    nearly every layer contacts every worker whatever the placement, so the decision would not change."""
    counted = problem if problem.compute_in_objective else problem.model_copy(update={"compute_in_objective": True})
    contacted = worker_layer_probs(problem, expert_to_worker) > 0  # [N, L]
    latency = problem.calls_per_layer * problem.latency_seconds[:, None] * contacted
    slowest_worker = (layer_worker_times(counted, expert_to_worker) + latency).max(axis=0)
    return np.maximum(slowest_worker, shared_link_times(problem, expert_to_worker).max(axis=0, initial=0.0))


class StepPrediction(BaseModel):
    """The training step the cost model predicts for a placement (`predict_step`), in seconds."""

    model_config = ConfigDict(frozen=True)

    master_s: float
    """C: the master's compute per step (`TrainingStep.master_compute_s`; 0 without it)."""
    round_trips_s: float
    """R: the step's waits on the experts, sum_l R_l (`round_trip_times`)."""
    micro_batches: int = 1
    in_flight: int = 1

    @property
    def serial_s(self) -> float:
        """One micro-batch at a time: C + R."""
        return self.master_s + self.round_trips_s

    @property
    def overlapped_s(self) -> float:
        """Several in flight: max(C, R) + min(C, R) / micro_batches (module docstring)."""
        busier, other = max(self.master_s, self.round_trips_s), min(self.master_s, self.round_trips_s)
        return busier + other / self.micro_batches

    @property
    def step_s(self) -> float:
        """The step this job runs: overlapped when more than one micro-batch is in flight, else serial."""
        return self.overlapped_s if min(self.in_flight, self.micro_batches) > 1 else self.serial_s


def predict_step(problem: PlacementProblem, expert_to_worker: np.ndarray) -> StepPrediction:
    """The training step of a placement of `problem`: the master's compute and the round trips (module docstring)."""
    step = problem.training_step
    round_trips = float(round_trip_times(problem, check_expert_to_worker(problem, expert_to_worker)).sum())
    if step is None:
        return StepPrediction(master_s=0.0, round_trips_s=round_trips)
    return StepPrediction(master_s=step.master_compute_s, round_trips_s=round_trips,
                          micro_batches=step.micro_batches, in_flight=step.in_flight)


def worker_bytes(problem: PlacementProblem, expert_to_worker: np.ndarray) -> np.ndarray:
    """[num_workers] expected bytes exchanged between master and each worker per step."""
    mass = worker_layer_probs(problem, expert_to_worker).sum(axis=1)
    return mass * problem.tokens_per_step * problem.bytes_per_row


def cross_node_bytes(
    problem: PlacementProblem, expert_to_worker: np.ndarray
) -> tuple[float, dict[str, float]]:
    """Expected bytes per step between masters and workers on different nodes.

    Returns (total, {worker node: bytes}) over the nodes whose workers exchange rows with a master
    on another node (one master: the nodes that are not `master_node`).
    """
    if problem.worker_nodes is None or problem.masters[0] is None:
        missing = "worker_nodes" if problem.worker_nodes is None else "master_node"
        raise ValueError(
            f"cross-node bytes need both worker_nodes and master_node; {missing} is not set "
            "(give the node of every worker and of the master, e.g. --nodes and --master-node)"
        )
    mass = master_mass(problem, expert_to_worker).sum(axis=2)  # [M, N] rows per token, per master
    row_bytes = problem.tokens_per_step * problem.bytes_per_row / problem.num_masters
    per_node: dict[str, float] = {}
    for master_node, master_share in zip(problem.masters, mass):
        for node, share in zip(problem.worker_nodes, master_share):
            if node != master_node:
                per_node[node] = per_node.get(node, 0.0) + float(share) * row_bytes
    return float(sum(per_node.values())), per_node


class CostReport(BaseModel):
    """Summary of one placement under the cost model (all per training step)."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    step_time: float
    """Expected seconds: sum_l of the layer's slowest worker or shared link (communication, plus compute
    if the problem has it)."""
    layer_times: list[float]
    """[num_layers] expected seconds of each layer (its slowest worker or shared link)."""
    worker_experts: list[int]
    """[num_workers] experts placed on each worker."""
    worker_bytes: list[float]
    """[num_workers] expected bytes between the master and each worker."""
    worker_busy_share: list[float]
    """[num_workers] sum_l E[T_{n,l}] / step_time: how busy each worker's link is."""
    bottleneck_layers: list[int]
    """[num_workers] layers in which this worker is the slowest (ties: the lowest worker, then workers
    before shared links)."""
    cross_node_bytes: float | None
    """Expected bytes to workers off the master's node (None without node info)."""
    cross_node_bytes_per_node: dict[str, float] | None
    """The same split by node."""
    shared_link_busy_share: dict[str, float] = {}
    """{shared link name: sum_l T_{r,l} / step_time}; empty without shared links."""
    shared_link_bottleneck_layers: dict[str, int] = {}
    """{shared link name: layers in which it is slower than every worker and earlier shared link}."""


def cost_report(problem: PlacementProblem, expert_to_worker: np.ndarray) -> CostReport:
    """Evaluate a placement: times, bytes, busy shares and cross-node traffic."""
    assignment = check_expert_to_worker(problem, expert_to_worker)
    # workers then shared links: [N + R, L] seconds, the layer's time is its column's max
    times = np.vstack([layer_worker_times(problem, assignment), shared_link_times(problem, assignment)])
    total = float(layer_times(problem, assignment).sum())
    busy = times.sum(axis=1) / total if total > 0 else 0 * times.sum(axis=1)
    bottlenecks = np.bincount(times.argmax(axis=0), minlength=len(times))
    cross, per_node = None, None
    if problem.worker_nodes is not None and problem.masters[0] is not None:
        cross, per_node = cross_node_bytes(problem, assignment)
    names = [link.name for link in problem.shared_links]
    num_workers = problem.num_workers
    return CostReport(
        step_time=total,
        layer_times=times.max(axis=0).tolist(),
        worker_experts=experts_per_worker(num_workers, assignment).tolist(),
        worker_bytes=worker_bytes(problem, assignment).tolist(),
        worker_busy_share=busy[:num_workers].tolist(),
        bottleneck_layers=bottlenecks[:num_workers].tolist(),
        cross_node_bytes=cross,
        cross_node_bytes_per_node=per_node,
        shared_link_busy_share=dict(zip(names, busy[num_workers:].tolist())),
        shared_link_bottleneck_layers=dict(zip(names, bottlenecks[num_workers:].tolist())),
    )
