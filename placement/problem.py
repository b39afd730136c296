"""The expert placement problem: what is placed, where, and how fast each link is.

A `PlacementProblem` holds everything the cost model and the solvers need:
the routing profile `probs: [num_layers, num_experts]` (probability that a
token uses expert e of layer l; each row sums to `top_k`), the tokens per
step, the hidden size and bits per element, and per worker the bandwidth to
the master (bytes/s) and the capacity (experts it can hold).

    problem = PlacementProblem(probs=probs, top_k=2, tokens_per_step=4096,
                               hidden_size=4096, bandwidths=[18.3e9] * 2 + [1.17e9] * 4,
                               capacities=[43] * 6)
    problem = PlacementProblem.from_file("problem.yaml")

Shared links: a worker's link to the master may cross resources that other
workers' links cross too (the master node's NIC, each node's uplink). Each is a
`SharedLink` with its own bandwidth and the workers whose rows cross it; the
cost model adds one term per shared link and layer (see `placement.cost`).
`node_shared_links` builds the usual ones (one NIC per node) from node info:

    links = node_shared_links(worker_nodes, "node0", 1.17e9)
    problem = PlacementProblem(..., worker_nodes=worker_nodes, master_node="node0", shared_links=links)

Without shared links (the default) the model is the paper's: independent links.

Data-parallel masters (`master_nodes`, vela-ray's `masters.count`): M masters
split every step's tokens equally, each sends its rows to the same workers, so each
master-worker link carries 1/M of a worker's rows, and a NIC carries the rows of the
(master, worker) pairs it separates. `node_shared_links(worker_nodes, ["node0",
"node1", "node2"], 1.17e9)` builds those NICs. A placement may give each master its
own table (`routes [M, L, E]`: replicated experts, each master using its nearest
copy); `placement.cost` evaluates both forms.

Traffic model: in the forward pass each (token, expert) row goes to its
expert's worker and the output comes back, b*H/8 bytes each way (the paper's
2*D_{n,l}); in the backward pass the output-grad goes out and the input-grad
comes back, the same size again. `include_backward=True` (the default) counts
both passes, so every expected time and byte count is twice the paper's
forward-only eq. 5-6; with False it matches the paper exactly. The factor is
applied in one place, `bytes_per_row`, which all times and bytes derive from.

Step prediction: besides what the placement decides, a training step pays each call's latency
(`latencies_s`, per worker: a layer calls its workers once per pass and micro-batch) and the master's
own compute (`training_step`); `placement.cost.predict_step` adds them to the objective's round trips.
Neither is in the solvers' objective: the latency a layer pays is its slowest contacted worker's, and
nearly every layer contacts every worker whatever the placement, so it is a constant for the decision;
the master's compute does not depend on the placement at all.

Every user error is a `ValueError` (pydantic's `ValidationError` is one)
whose message names the field, the offending value and the fix.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from placement.io import as_probs_matrix, read_problem_fields

ROW_SUM_RTOL = 1e-6
DUPLEX_DIRECTIONS = 2  # a shared link (a NIC) carries the step's two directions at once (`SharedLink`)


class SharedLink(BaseModel):
    """A link that the master traffic of several workers crosses, e.g. a node's NIC.

    In layer l it is busy for seconds_per_prob * (routing mass of its workers in l), where
    seconds_per_prob is half a worker link's communication part with this link's bandwidth
    (`PlacementProblem.shared_link_seconds_per_prob`): a layer waits for it as for a worker.

    Half, because a NIC is full duplex: the rows going out to some workers and the outputs coming back from
    others cross it at the same time, each direction at the full bandwidth, and a step's traffic is the same
    size each way. A worker's own link is not halved: its call's reply cannot start before its request has
    arrived. (Counting both directions against one bandwidth over-predicted the step of spread placements by up
    to 2x on the emulated cluster, whose veths are shaped per direction as real NICs are.)
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str
    """Display name, unique within a problem (e.g. `nic:node0`)."""
    bandwidth_bytes_per_s: float
    """Bandwidth of the shared resource in bytes/s, each direction (a NIC's rate, as `probe_shared` measures it)."""
    workers: list[int]
    """Indices of the workers whose rows to and from the master cross this link."""
    masters: list[list[int]] | None = None
    """With data-parallel masters: per listed worker, the masters (indices into
    `PlacementProblem.master_nodes`) whose rows to it cross this link; None: every master's."""

    @field_validator("bandwidth_bytes_per_s")
    @classmethod
    def _positive_bandwidth(cls, value: float, info: ValidationInfo) -> float:
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"shared link {info.data.get('name')!r} has bandwidth_bytes_per_s = {value!r}: give its "
                "positive, finite bandwidth in bytes/s (measure the NIC, e.g. with iperf)"
            )
        return value

    @field_validator("workers")
    @classmethod
    def _some_distinct_workers(cls, value: list[int], info: ValidationInfo) -> list[int]:
        name = info.data.get("name")
        if not value:
            raise ValueError(
                f"shared link {name!r} has no workers: list the indices of the workers whose traffic "
                "crosses it, or leave the link out"
            )
        repeated = sorted({worker for worker in value if value.count(worker) > 1})
        if repeated:
            raise ValueError(f"shared link {name!r} lists worker {repeated[0]} more than once: list each worker once")
        return value

    @model_validator(mode="after")
    def _masters_per_worker(self) -> "SharedLink":
        if self.masters is not None and len(self.masters) != len(self.workers):
            raise ValueError(f"shared link {self.name!r} has {len(self.masters)} master lists for "
                             f"{len(self.workers)} workers: give one list of masters per listed worker")
        return self


class TrainingStep(BaseModel):
    """How a training step runs, besides the traffic the placement decides: what `placement.cost.predict_step`
    adds to the round trips (measured before training, by the runtime's placer)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    master_compute_s: float
    """Seconds per step the master computes (forward and backward of its micro-batches, experts excluded)."""
    micro_batches: int = 1
    """Micro-batches per step (`training.batch_size / micro_batch_size`): each calls every layer's workers once
    per pass, and pays their latency each time."""
    in_flight: int = 1
    """Micro-batches run at once (`training.overlap.micro_batches_in_flight`): above 1 the master computes one
    while another's rows are at the experts."""

    @field_validator("master_compute_s")
    @classmethod
    def _non_negative_seconds(cls, value: float) -> float:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"master_compute_s = {value!r}: give the master's finite seconds >= 0 per step")
        return value

    @field_validator("micro_batches", "in_flight")
    @classmethod
    def _at_least_one(cls, value: int, info: ValidationInfo) -> int:
        if value < 1:
            raise ValueError(f"{info.field_name} = {value}: a step runs at least one micro-batch")
        return value


class PlacementProblem(BaseModel):
    """One placement problem: L MoE layers of E experts onto N workers."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", arbitrary_types_allowed=True, use_attribute_docstrings=True
    )

    probs: np.ndarray
    """[num_layers, num_experts] float64: P[l, e] = probability a token uses expert e of layer l."""
    top_k: int
    """Experts each token uses per layer; every row of `probs` sums to it."""
    tokens_per_step: int
    """K: tokens entering each MoE layer per training step (batch size x sequence length)."""
    hidden_size: int
    """H: elements per token row sent to an expert."""
    bits_per_element: int = 16
    """b: bits per element of a row (16 for bf16/fp16)."""
    bandwidths: list[float]
    """B_n: master-to-worker-n bandwidth in bytes/s, one per worker."""
    capacities: list[int]
    """C_n: number of experts worker n can hold, one per worker."""
    worker_names: list[str] | None = None
    """Display name per worker (defaults to `w0`, `w1`, ...)."""
    worker_nodes: list[str] | None = None
    """Node id per worker; with `master_node`, lets the cost model count cross-node bytes."""
    master_node: str | None = None
    """Node id of the master (it may be a node that hosts no worker)."""
    master_nodes: list[str] | None = None
    """Node of each data-parallel master (they split each step's tokens equally); None: one master on
    `master_node`. With several, `bandwidths[n]` is worker n's slowest master link."""
    master_bandwidths: list[list[float]] | None = None
    """[num_masters][num_workers] bytes/s of each master's link to each worker (a master reaches the
    workers beside it faster than the others); None: `bandwidths` for every master. Its column minima
    must be `bandwidths`: one table shared by all masters waits for its slowest link, per-master routes
    for each master's own."""
    include_backward: bool = True
    """Count the backward pass too (output-grads out, input-grads back): doubles times and bytes."""
    compute_seconds_per_row: list[float] | None = None
    """c_n: seconds worker n spends on the arithmetic of one routed row per step (forward and backward),
    added to its communication time; None: the paper's communication-only model."""
    compute_in_objective: bool = True
    """Whether the solvers minimise `compute_seconds_per_row` too (`placement.cost_model: communication+compute`);
    False: it is there for the step prediction alone (`placement.cost.predict_step`), the objective the paper's."""
    latencies_s: list[float] | None = None
    """Seconds each call to worker n costs besides its bytes (the probe's fitted latency), one per worker: the
    step prediction's, not the objective's (module docstring); None: no latency."""
    training_step: TrainingStep | None = None
    """The master's compute and micro-batches per step, for the step prediction; None: round trips alone, of
    one micro-batch."""
    shared_links: list[SharedLink] = []
    """Links several workers' traffic shares (NICs; see `node_shared_links`); empty: the paper's independent links."""

    # --- field checks ---------------------------------------------------------

    @field_validator("probs", mode="before")
    @classmethod
    def _probs_as_matrix(cls, value: Any) -> np.ndarray:
        probs = as_probs_matrix(value)  # the same check as profile files get
        probs.setflags(write=False)
        return probs

    @field_serializer("probs")
    def _probs_as_lists(self, probs: np.ndarray) -> list[list[float]]:
        return probs.tolist()  # JSON (a run summary carries its problem); the validator reads it back

    @field_validator("top_k", "tokens_per_step", "hidden_size", "bits_per_element")
    @classmethod
    def _positive(cls, value: int, info) -> int:
        if value <= 0:
            raise ValueError(f"{info.field_name} must be a positive integer, got {value}")
        return value

    @field_validator("bandwidths")
    @classmethod
    def _positive_bandwidths(cls, value: list[float]) -> list[float]:
        if not value:
            raise ValueError("bandwidths is empty: give one bandwidth (bytes/s) per worker")
        for worker, bandwidth in enumerate(value):
            if not (math.isfinite(bandwidth) and bandwidth > 0):
                raise ValueError(
                    f"bandwidths[{worker}] = {bandwidth!r}: worker {worker} needs a positive, "
                    "finite bandwidth to the master (measure it, e.g. with iperf)"
                )
        return value

    @field_validator("compute_seconds_per_row")
    @classmethod
    def _non_negative_compute(cls, value: list[float] | None) -> list[float] | None:
        for worker, seconds in enumerate(value or []):
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(
                    f"compute_seconds_per_row[{worker}] = {seconds!r}: give a finite time >= 0 per row "
                    "(time one expert's forward+backward on that worker), or leave the field out"
                )
        return value

    @field_validator("latencies_s")
    @classmethod
    def _non_negative_latencies(cls, value: list[float] | None) -> list[float] | None:
        for worker, seconds in enumerate(value or []):
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"latencies_s[{worker}] = {seconds!r}: give a finite latency >= 0 in seconds "
                                 "(the link probe's fitted intercept), or leave the field out")
        return value

    @field_validator("capacities")
    @classmethod
    def _non_negative_capacities(cls, value: list[int]) -> list[int]:
        for worker, capacity in enumerate(value):
            if capacity < 0:
                raise ValueError(
                    f"capacities[{worker}] = {capacity}: a worker holds zero or more experts"
                )
        return value

    # --- cross-field checks ---------------------------------------------------

    @model_validator(mode="after")
    def _consistent(self) -> PlacementProblem:
        self._check_rows_sum_to_top_k()
        self._check_worker_lists()
        self._check_total_capacity()
        self._check_shared_links()
        self._check_masters()
        return self

    def _check_masters(self) -> None:
        if self.master_bandwidths is not None:
            self._check_master_bandwidths()
        if self.master_nodes is None:
            return
        if not self.master_nodes:
            raise ValueError("master_nodes is empty: give the node of each master, or leave it out for one")
        if self.master_node is not None and self.master_node != self.master_nodes[0]:
            raise ValueError(f"master_node {self.master_node!r} is not master_nodes[0] "
                             f"({self.master_nodes[0]!r}): leave master_node out with several masters")

    def _check_rows_sum_to_top_k(self) -> None:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts}): "
                "a token cannot use more experts than a layer has"
            )
        row_sums = self.probs.sum(axis=1)
        bad = np.flatnonzero(np.abs(row_sums - self.top_k) > ROW_SUM_RTOL * self.top_k)
        if len(bad):
            layer = int(bad[0])
            raise ValueError(
                f"probs row {layer} sums to {row_sums[layer]:.6g}, expected top_k={self.top_k}: "
                "each layer's probabilities must sum to top_k (scale the row, or load counts "
                "with placement.io.load_profile, which normalises them)"
            )

    def _check_worker_lists(self) -> None:
        num_workers = len(self.bandwidths)
        for name in ("capacities", "worker_names", "worker_nodes", "compute_seconds_per_row", "latencies_s"):
            values = getattr(self, name)
            if values is not None and len(values) != num_workers:
                raise ValueError(
                    f"{name} has {len(values)} entries but bandwidths has {num_workers}: "
                    "give exactly one per worker"
                )

    def _check_total_capacity(self) -> None:
        needed = self.num_layers * self.num_experts
        total = sum(self.capacities)
        if total < needed:
            raise ValueError(
                f"capacities sum to {total} but {needed} experts ({self.num_layers} layers x "
                f"{self.num_experts}) must be placed: need {needed - total} more expert slots "
                "(raise capacities or add workers)"
            )

    def _check_shared_links(self) -> None:
        seen: dict[str, int] = {}
        for index, link in enumerate(self.shared_links):
            outside = [worker for worker in link.workers if not 0 <= worker < self.num_workers]
            if outside:
                raise ValueError(
                    f"shared_links[{index}] ({link.name!r}) lists worker {outside[0]} but there are only workers "
                    f"0..{self.num_workers - 1}: give indices into bandwidths"
                )
            if link.name in seen:
                raise ValueError(
                    f"shared_links[{seen[link.name]}] and shared_links[{index}] are both named {link.name!r}: "
                    "give each shared link its own name"
                )
            seen[link.name] = index
            bad = [m for masters in link.masters or [] for m in masters if not 0 <= m < self.num_masters]
            if bad:
                raise ValueError(f"shared_links[{index}] ({link.name!r}) names master {bad[0]} but there are "
                                 f"{self.num_masters} masters: give indices into master_nodes")

    def _check_master_bandwidths(self) -> None:
        links = np.asarray(self.master_bandwidths, dtype=np.float64)
        if links.shape != (self.num_masters, self.num_workers):
            raise ValueError(f"master_bandwidths is {list(links.shape)} but there are {self.num_masters} masters "
                             f"and {self.num_workers} workers: give one row per master, one entry per worker")
        if not (np.isfinite(links).all() and (links > 0).all()):
            raise ValueError("master_bandwidths holds a bandwidth that is not positive and finite: measure each link")
        if not np.allclose(links.min(axis=0), self.bandwidths, rtol=1e-9):
            raise ValueError("bandwidths must be master_bandwidths' column minima (each worker's slowest master "
                             "link): set bandwidths to them")

    # --- shapes and derived values ---------------------------------------------

    @property
    def num_layers(self) -> int:
        return int(self.probs.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.probs.shape[1])

    @property
    def num_workers(self) -> int:
        return len(self.bandwidths)

    @property
    def num_masters(self) -> int:
        return len(self.master_nodes) if self.master_nodes else 1

    @property
    def masters(self) -> list[str | None]:
        """Node of each master: `master_nodes`, or the one `master_node`."""
        return list(self.master_nodes) if self.master_nodes else [self.master_node]

    @property
    def names(self) -> list[str]:
        """Display name per worker: `worker_names` or `w0`, `w1`, ..."""
        return list(self.worker_names or [f"w{n}" for n in range(self.num_workers)])

    @property
    def passes(self) -> int:
        """Round trips per row and step: 2 with the backward pass, 1 forward only."""
        return 2 if self.include_backward else 1

    @property
    def bytes_per_row(self) -> float:
        """Bytes moved per (token, expert) row per step: b*H/8 each way, times `passes`."""
        return self.passes * 2 * self.bits_per_element * self.hidden_size / 8

    @property
    def seconds_per_prob(self) -> np.ndarray:
        """[num_workers] seconds one unit of routing probability costs on worker n per layer.

        E[T_{n,l}] = seconds_per_prob[n] * sum_e X[n,l,e] * P[l,e], i.e. K * (passes * b*H/(4*M*B_n) + c_n):
        the paper's communication time (each of M masters' links carries 1/M of the rows), plus the
        worker's compute when `compute_seconds_per_row` is set (both grow with the rows a worker
        serves, so the LP stays linear).
        """
        return self.link_seconds_per_prob + self.compute_seconds_per_prob

    @property
    def link_seconds_per_prob(self) -> np.ndarray:
        """[num_workers] `seconds_per_prob`'s communication part: K * passes * b*H / (4 * M * B_n)."""
        return self.tokens_per_step * self.bytes_per_row / (self.num_masters * np.asarray(self.bandwidths))

    @property
    def master_link_seconds_per_prob(self) -> np.ndarray:
        """[num_masters, num_workers] `link_seconds_per_prob` of each master's own link to each worker."""
        links = np.asarray(self.master_bandwidths if self.master_bandwidths is not None
                           else [self.bandwidths] * self.num_masters, dtype=np.float64)
        return self.tokens_per_step * self.bytes_per_row / (self.num_masters * links)

    @property
    def compute_seconds_per_prob(self) -> np.ndarray:
        """[num_workers] `seconds_per_prob`'s compute part: K * c_n (zeros without compute, or with compute
        left out of the objective: `compute_in_objective`)."""
        if self.compute_seconds_per_row is None or not self.compute_in_objective:
            return np.zeros(self.num_workers)
        return self.tokens_per_step * np.asarray(self.compute_seconds_per_row, dtype=np.float64)

    @property
    def calls_per_layer(self) -> int:
        """Calls each MoE layer makes to each of its workers per step: one per pass and micro-batch."""
        return self.passes * (self.training_step.micro_batches if self.training_step else 1)

    @property
    def latency_seconds(self) -> np.ndarray:
        """[num_workers] `latencies_s` (zeros without them)."""
        return np.zeros(self.num_workers) if self.latencies_s is None else np.asarray(self.latencies_s, dtype=np.float64)

    @property
    def shared_link_seconds_per_prob(self) -> np.ndarray:
        """[num_shared_links] seconds one unit of routing probability of its workers costs each shared link per layer.

        T_{r,l} = shared_link_seconds_per_prob[r] * sum_{n in r} sum_e X[n,l,e] * P[l,e], i.e.
        K * passes * b*H / (8 * B_r): `seconds_per_prob`'s communication part at the shared bandwidth, halved
        for the two directions the link carries at once (`SharedLink`).
        """
        bandwidths = np.array([link.bandwidth_bytes_per_s for link in self.shared_links], dtype=np.float64)
        return self.tokens_per_step * self.bytes_per_row / (DUPLEX_DIRECTIONS * bandwidths)

    @property
    def shared_link_members(self) -> np.ndarray:
        """[num_shared_links, num_workers] share of worker n's master traffic that crosses shared link r:
        1.0 or 0.0 with one master; with M masters, the share of masters whose rows to n cross r
        (all masters sending the same rows to n)."""
        return self.shared_link_crossings.mean(axis=1)

    @property
    def shared_link_crossings(self) -> np.ndarray:
        """[num_shared_links, num_masters, num_workers] 1.0 where master m's rows to worker n cross link r."""
        crossings = np.zeros((len(self.shared_links), self.num_masters, self.num_workers))
        for index, link in enumerate(self.shared_links):
            for position, worker in enumerate(link.workers):
                masters = link.masters[position] if link.masters is not None else slice(None)
                crossings[index, masters, worker] = 1.0
        return crossings

    def communication_only(self) -> PlacementProblem:
        """This problem under the paper's cost model (no compute term), e.g. to report communication time."""
        return self.model_copy(update={"compute_seconds_per_row": None})

    # --- constructors ------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path) -> PlacementProblem:
        """Read a problem from YAML or JSON (format: `placement.io`); errors name the file."""
        fields = read_problem_fields(path)
        try:
            return build_problem(**fields)
        except ValueError as err:
            raise ValueError(f"problem file {path}: {err}") from None

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        num_experts: int,
        top_k: int,
        num_workers: int,
        *,
        bandwidth: float = 10e9,
        capacity: int | None = None,
        tokens_per_step: int = 4096,
        hidden_size: int = 4096,
        **fields: Any,
    ) -> PlacementProblem:
        """Uniform routing (P = top_k / E) on identical workers.

        `capacity` defaults to ceil(L * E / N), the tightest that fits.
        """
        if capacity is None:
            capacity = -(-num_layers * num_experts // num_workers)
        return cls(
            probs=np.full((num_layers, num_experts), top_k / num_experts),
            top_k=top_k,
            tokens_per_step=tokens_per_step,
            hidden_size=hidden_size,
            bandwidths=[bandwidth] * num_workers,
            capacities=[capacity] * num_workers,
            **fields,
        )


def build_problem(**fields: Any) -> PlacementProblem:
    """`PlacementProblem(**fields)`, with validation errors as one plain ValueError.

    `field: what is wrong and how to fix it`, without pydantic's echo of the
    whole input (for command-line users): on the same line when there is one
    error (the usual case), one indented line each when there are several.
    """
    try:
        return PlacementProblem(**fields)
    except ValidationError as err:
        lines = [
            f"{'.'.join(str(part) for part in error['loc']) or 'problem'}: "
            f"{error['msg'].removeprefix('Value error, ')}"
            for error in err.errors()
        ]
        separator = " " if len(lines) == 1 else "\n  "
        raise ValueError("invalid placement problem:" + separator + separator.join(lines)) from None


def node_shared_links(
    worker_nodes: list[str], master_node: str | list[str], nic_bandwidth_bytes_per_s: float | dict[str, float]
) -> list[SharedLink]:
    """One shared link per NIC that master traffic crosses: the masters' nodes', then each other node's.

    worker_nodes: [num_workers] node of each worker; master_node: the master's node (it may host
    no worker), or the node of each data-parallel master (`PlacementProblem.master_nodes`).
    A row crosses the NICs of both its master's node and its worker's node when they differ, so
    each NIC (`nic:<node>`, masters' nodes first, then worker nodes in order of first appearance)
    carries, for every worker, the rows of the masters on the other side of it. With one master
    that is: the master's NIC carries the rows of every worker off the master's node, each other
    node's NIC its own workers' rows. There are no links when every master and worker share a node.

    nic_bandwidth_bytes_per_s: one bandwidth for every NIC, or {node: bytes/s} with an entry for
    every node a link is made for.
    """
    masters = [master_node] if isinstance(master_node, str) else list(master_node)
    nodes = list(dict.fromkeys([*masters, *worker_nodes]))
    links = []
    for node in nodes:
        crossing = {n: [m for m, at in enumerate(masters) if (at == node) != (worker_node == node)]
                    for n, worker_node in enumerate(worker_nodes)}
        crossing = {n: ms for n, ms in crossing.items() if ms}
        if crossing:
            links.append((node, crossing))
    if isinstance(nic_bandwidth_bytes_per_s, dict):
        missing = [node for node, _ in links if node not in nic_bandwidth_bytes_per_s]
        if missing:
            raise ValueError(
                f"nic_bandwidth_bytes_per_s has no entry for node {missing[0]!r}: give one for every node "
                f"whose NIC master traffic crosses ({', '.join(node for node, _ in links)}), or one number for all"
            )
    return [
        SharedLink(name=f"nic:{node}", workers=list(crossing),
                   bandwidth_bytes_per_s=(nic_bandwidth_bytes_per_s[node] if isinstance(nic_bandwidth_bytes_per_s, dict)
                                          else nic_bandwidth_bytes_per_s),
                   masters=None if len(masters) == 1 else list(crossing.values()))
        for node, crossing in links
    ]


def synthetic_probs(
    num_layers: int, num_experts: int, top_k: int, *, concentration: float, seed: int = 0
) -> np.ndarray:
    """[num_layers, num_experts] skewed routing probabilities, for tests and benchmarks.

    Per layer, expert popularity is drawn from a symmetric Dirichlet with the
    given `concentration` (small: a few experts take most tokens; large: close
    to uniform) and scaled so the row sums to top_k, capping each probability
    at 1 (a token uses an expert at most once) and spreading the excess over
    the uncapped experts.
    """
    rng = np.random.default_rng(seed)
    popularity = rng.dirichlet(np.full(num_experts, concentration), size=num_layers)
    return np.array([_scale_capped(row, top_k) for row in popularity])


def _scale_capped(weights: np.ndarray, top_k: int) -> np.ndarray:
    """Scale weights [E] to sum to top_k with every entry at most 1."""
    probs = np.zeros_like(weights)
    order = np.argsort(-weights, kind="stable")
    for capped in range(top_k + 1):
        rest = order[capped:]
        scaled = weights[rest] * (top_k - capped) / max(weights[rest].sum(), np.finfo(float).tiny)
        if scaled.max(initial=0.0) <= 1.0:
            probs[order[:capped]] = 1.0
            probs[rest] = scaled
            return probs
    raise AssertionError("unreachable: capping top_k experts always fits")
