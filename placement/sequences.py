"""Sequence migration (LUFFY, Chen et al., Sec. IV): a sequence continues where its rows were served.

With M data-parallel masters, each holds some of a step's sequences. In MoE layer l a sequence's
master sends each token's top-k rows to the experts' workers and gathers the outputs back. LUFFY
lets the sequence continue (combine, then the next attention) on another master: one on the node
that served most of its rows, balanced by attention load. The gather then returns the rows to the
new master, and the sequence's residual hidden states (one row of H elements per token) move there
when the node changes. The backward pass follows the same path in reverse, so it moves the same
bytes again. The math is unchanged; only bytes move differently.

    master_S = migrate_sequences(tokens_S, served_SN, master_node_M, q=1, current_S=master_S)
    traffic = simulate_sequences(problem, counts_SLE, tokens_S, expert_to_worker, q=1)   # q=None: stay
    traffic.cross_node_bytes, traffic.nic_seconds, traffic.masters

`migrate_sequences` is Algorithm 1. What the paper leaves open, and what is chosen here:
  * traffic (step 1) counts the rows served off a master's node, which cross in the gather, plus
    the residual move. LUFFY's experts are on GPUs, where the residual is not counted. Here it is
    `residual_rows_per_token` rows per token (1: a hidden state is one row);
  * the order of the sequences is not given. They go longest first: the longest one sets a master's
    padded length, and shorter ones then join it at no padding cost (the paper gathers similar lengths);
  * lines 5-6 read "s_ij = T_att(B_j<-i, L_j<-i) [-] T_att(B_j, L_j); migrate to the j* with maximum
    s_ij", while the text says "the minimum cost growth". This module takes the minimum growth,
    with ties going to the master whose attention time after is smallest (for sequences of equal
    length every master's growth is equal, so this tie rule is what balances the counts), then to
    the master with less traffic;
  * loads are rebuilt from empty for every layer (all sequences are placed again);
  * "if it has sufficient capacity": a master holds at most `capacity_tokens` tokens ("more short
    sequences but less long ones"). The default, ceil(total / M) + the longest sequence, is the
    least that this greedy always fits. When no candidate has room, the sequence goes to the
    master with the least traffic that has room (the paper does not say);
  * eq. 1 is used at unit speed, T_att(B, L) = 3 B L d^2 + 2 B L^2 d. The paper's own example (a
    length-11 sequence does better next to two of length 6 than next to one of length 1) does
    not follow from eq. 1, which prefers the single short one. Eq. 1 is followed here.

`simulate_sequences` counts cross-node bytes per layer for given routing. Per (sequence, layer,
expert) there are counts[s, l, e] rows. The sequence's master routes them with its own table (its
`routes[m]`, the nearest copy). A row crosses nodes in the dispatch when its worker's node is not
its master's, and in the gather when that node is not the next master's. With `problem.bytes_per_row`
the bytes of one row's round trip (both directions, both passes), each one-way crossing of a row or
residual is half of it. A transfer between two nodes loads both nodes' NICs (`nic:<node>` in
`problem.shared_links`, as `node_shared_links` names them). A layer waits for its busiest NIC, as
in `placement.cost`. Without migration and with each master's rows in proportion to `problem.probs`,
the result equals `placement.cost`'s cross-node bytes and NIC times.

Shape legend: S = sequences, L = layers, E = experts, M = masters, W = workers, N = nodes.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, computed_field

from placement.cost import check_expert_to_worker, master_routes
from placement.problem import PlacementProblem


def attention_cost(num_sequences: int, longest: int, hidden_size: int) -> int:
    """LUFFY's eq. 1 at unit speed: 3 B L d^2 + 2 B L^2 d, for B sequences padded to length L.
    Returns a Python int, so ties compare exactly."""
    b, length, d = int(num_sequences), int(longest), int(hidden_size)
    return 3 * b * length * d * d + 2 * b * length * length * d


def default_capacity(tokens_S: Sequence[int], num_masters: int) -> int:
    """ceil(total tokens / M) + the longest sequence: the least with which the greedy always fits
    (the least loaded master holds under total / M tokens before any placement)."""
    tokens_S = np.asarray(tokens_S, dtype=np.int64)
    return -(-int(tokens_S.sum()) // num_masters) + int(tokens_S.max(initial=0))


def migrate_sequences(
    tokens_S: Sequence[int],
    served_SN: np.ndarray,
    master_node_M: Sequence[int],
    *,
    q: int = 1,
    current_S: Sequence[int] | None = None,
    residual_rows_per_token: float = 1.0,
    hidden_size: int = 4096,
    capacity_tokens: int | Sequence[int] | None = None,
    capacity_sequences: Sequence[int] | None = None,
) -> np.ndarray:
    """[S] the master of each sequence for the next layer (LUFFY's Algorithm 1; module docstring).

    tokens_S: [S] tokens of each sequence. served_SN: [S, N] rows of sequence s whose expert ran
    on node n in this layer. master_node_M: [M] node (column of served_SN) of each master.
    current_S: [S] master each sequence is on now; a move to another node costs
    `residual_rows_per_token` rows per token (None: moves are free). hidden_size: d of eq. 1.
    capacity_tokens: the most tokens a master takes (None: `default_capacity`), or [M] one per master (a
    runtime whose masters keep their batch sizes gives each exactly its share: `SequenceMigration`).
    capacity_sequences: [M] the most sequences each master takes (None: no limit). A runtime whose masters
    keep their batch shapes passes its slot counts, so sequences of unequal lengths still fill every slot.
    """
    tokens_S = np.asarray(tokens_S, dtype=np.int64)
    served_SN = np.asarray(served_SN, dtype=np.float64)
    master_node_M = np.asarray(master_node_M, dtype=np.int64)
    num_sequences, num_masters = len(tokens_S), len(master_node_M)
    _check_inputs(tokens_S, served_SN, master_node_M, q, current_S)
    capacity_M = _capacities(tokens_S, num_masters, capacity_tokens)
    # 1. traffic of continuing on each master: rows served off its node, plus the residual move
    traffic_SM = served_SN.sum(axis=1, keepdims=True) - served_SN[:, master_node_M]
    stay_SM = np.zeros((num_sequences, num_masters), dtype=bool)
    if current_S is not None:
        current_S = np.asarray(current_S, dtype=np.int64)
        moves_SM = master_node_M[None, :] != master_node_M[current_S][:, None]
        traffic_SM = traffic_SM + residual_rows_per_token * tokens_S[:, None] * moves_SM
        stay_SM[np.arange(num_sequences), current_S] = True
    # 2. candidates: the q masters of least traffic (ties: the current master, then the lower index)
    index_SM = np.broadcast_to(np.arange(num_masters), (num_sequences, num_masters))
    order_SM = np.lexsort((index_SM, ~stay_SM, traffic_SM), axis=-1)
    # 3. place sequences longest first where the attention time grows least, within capacity
    slots_M = [num_sequences] * num_masters if capacity_sequences is None else [int(c) for c in capacity_sequences]
    if len(slots_M) != num_masters or sum(slots_M) < num_sequences:
        raise ValueError(f"capacity_sequences {list(slots_M)} must give each of the {num_masters} masters a count, "
                         f"{num_sequences} in all at least")
    return _assign(tokens_S, order_SM, q, hidden_size, capacity_M, slots_M)


def _capacities(tokens_S: np.ndarray, num_masters: int, capacity_tokens: int | Sequence[int] | None) -> list[int]:
    """[M] the most tokens each master takes."""
    if capacity_tokens is None:
        return [default_capacity(tokens_S, num_masters)] * num_masters
    capacity_M = [int(c) for c in np.broadcast_to(np.asarray(capacity_tokens, dtype=np.int64), (num_masters,))]
    if len(tokens_S) and max(capacity_M) < tokens_S.max():
        raise ValueError(f"capacity_tokens={capacity_tokens} is below the longest sequence ({tokens_S.max()} "
                         f"tokens): raise it, or leave it None for {default_capacity(tokens_S, num_masters)}")
    return capacity_M


def _assign(tokens_S: np.ndarray, order_SM: np.ndarray, q: int, hidden_size: int, capacity_M: list[int],
            slots_M: list[int] | None = None) -> np.ndarray:
    """Algorithm 1, lines 3-7: [S] masters, given each sequence's masters in order of traffic."""
    num_sequences, num_masters = order_SM.shape
    count_M, longest_M, load_M = [0] * num_masters, [0] * num_masters, [0] * num_masters
    slots_M = slots_M or [num_sequences] * num_masters
    master_S = np.empty(num_sequences, dtype=np.int64)
    for s in np.argsort(-tokens_S, kind="stable"):
        length = int(tokens_S[s])
        room = [int(m) for m in order_SM[s] if load_M[m] + length <= capacity_M[m] and count_M[m] < slots_M[m]]
        if not room:
            capacity = capacity_M[0] if len(set(capacity_M)) == 1 else capacity_M
            raise ValueError(f"sequence {s} ({length} tokens) fits no master under capacity_tokens={capacity} "
                             f"(loads {load_M}): raise it, or leave it None for "
                             f"{default_capacity(tokens_S, num_masters)}")
        candidates = [m for m in room if m in order_SM[s, :q]] or room[:1]
        # (growth of the master's attention time, its time after, rank in traffic order)
        after = [attention_cost(count_M[m] + 1, max(longest_M[m], length), hidden_size) for m in candidates]
        keys = [(time - attention_cost(count_M[m], longest_M[m], hidden_size), time, room.index(m))
                for m, time in zip(candidates, after)]
        chosen = candidates[keys.index(min(keys))]
        master_S[s] = chosen
        count_M[chosen] += 1
        longest_M[chosen] = max(longest_M[chosen], length)
        load_M[chosen] += length
    return master_S


def _check_inputs(tokens_S: np.ndarray, served_SN: np.ndarray, master_node_M: np.ndarray, q: int,
                  current_S: Sequence[int] | None) -> None:
    if served_SN.ndim != 2 or served_SN.shape[0] != len(tokens_S):
        raise ValueError(f"served_SN has shape {served_SN.shape} but there are {len(tokens_S)} sequences: give "
                         "[num_sequences, num_nodes] rows served per node")
    if not len(master_node_M) or master_node_M.min() < 0 or master_node_M.max() >= served_SN.shape[1]:
        raise ValueError(f"master_node_M {master_node_M.tolist()} must name at least one master, each by a node "
                         f"0..{served_SN.shape[1] - 1} (a column of served_SN)")
    if not isinstance(q, (int, np.integer)) or q < 1:
        raise ValueError(f"q = {q!r}: give the number of candidate masters per sequence, an integer >= 1")
    if current_S is not None and (len(current_S) != len(tokens_S) or
                                  any(not 0 <= m < len(master_node_M) for m in current_S)):
        raise ValueError(f"current_S {list(current_S)} must give each of the {len(tokens_S)} sequences a master "
                         f"0..{len(master_node_M) - 1}")


def contiguous_masters(num_sequences: int, num_masters: int) -> np.ndarray:
    """[S] master of each sequence when masters take contiguous shares of the batch (sizes as
    `np.array_split`'s, like `vela_ray.training.replicas.shard_rows`: they differ by at most one)."""
    sizes = [len(part) for part in np.array_split(np.arange(num_sequences), num_masters)]
    return np.repeat(np.arange(num_masters), sizes)


class SequenceTraffic(BaseModel):
    """Cross-node traffic of one step's sequences, per MoE layer (forward and backward)."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    dispatch_bytes: list[float]
    """[L] bytes of rows sent to (and input-grads back from) workers on another node than their master's."""
    gather_bytes: list[float]
    """[L] bytes of outputs gathered to (and output-grads from) a master on another node than their worker's."""
    residual_bytes: list[float]
    """[L] bytes of residual hidden states (and their grads) moved to the next master's node after layer l."""
    nic_bytes: dict[str, list[float]]
    """{node: [L] bytes through its NIC}: a transfer between two nodes counts at both."""
    layer_nic_seconds: list[float] | None
    """[L] seconds of the layer's busiest NIC (None: the problem has no `nic:<node>` shared links)."""
    masters: list[list[int]]
    """[L + 1, S] master of each sequence in layer l (the last row: after the last layer)."""

    @computed_field
    @property
    def cross_node_bytes(self) -> float:
        """Dispatch, gather and residual bytes across nodes, all layers."""
        return float(sum(self.dispatch_bytes) + sum(self.gather_bytes) + sum(self.residual_bytes))

    @computed_field
    @property
    def nic_seconds(self) -> float | None:
        """Sum over layers of the busiest NIC's seconds (None without NIC links)."""
        return None if self.layer_nic_seconds is None else float(sum(self.layer_nic_seconds))

    @computed_field
    @property
    def moved_share(self) -> float:
        """Share of (sequence, layer) pairs after which the sequence changes master."""
        masters = np.asarray(self.masters)
        return float((masters[1:] != masters[:-1]).mean()) if masters.size else 0.0


def simulate_sequences(
    problem: PlacementProblem,
    counts_SLE: np.ndarray,
    tokens_S: Sequence[int],
    expert_to_worker: np.ndarray,
    *,
    q: int | None = None,
    initial_S: Sequence[int] | None = None,
    residual_rows_per_token: float = 1.0,
    capacity_tokens: int | None = None,
) -> SequenceTraffic:
    """Cross-node bytes and NIC time of one step's sequences, without (q=None) or with migration.

    counts_SLE: [S, L, E] rows of sequence s routed to expert e of layer l (each [s, l] sums to
    top_k * tokens_S[s]). expert_to_worker: a table [L, E] or per-master routes [M, L, E].
    initial_S: [S] master of each sequence in layer 0 (None: `contiguous_masters`).
    q, residual_rows_per_token, capacity_tokens: as in `migrate_sequences`; the residual bytes
    are `residual_rows_per_token` half-rows per moved token.
    """
    routes_MLE = master_routes(problem, check_expert_to_worker(problem, expert_to_worker))
    counts_SLE, tokens_S = _check_counts(problem, counts_SLE, tokens_S)
    nodes, worker_node_W, master_node_M = _node_indices(problem)
    master_S = contiguous_masters(len(tokens_S), problem.num_masters) if initial_S is None else np.asarray(initial_S)
    one_way = problem.bytes_per_row / 2  # a row or residual crossing once, in both passes
    num_layers, sequences = problem.num_layers, np.arange(len(tokens_S))
    dispatch, gather, residual = np.zeros(num_layers), np.zeros(num_layers), np.zeros(num_layers)
    flow_LNN = np.zeros((num_layers, len(nodes), len(nodes)))  # one-way crossings from node to node
    path = [master_S.tolist()]
    for layer in range(num_layers):
        # 1. dispatch: each sequence's rows go to the workers its master's table names
        row_node_SE = worker_node_W[routes_MLE[master_S, layer]]
        served_SN = np.zeros((len(tokens_S), len(nodes)))
        np.add.at(served_SN, (sequences[:, None], row_node_SE), counts_SLE[:, layer])
        # 2. the next master: stay, or LUFFY's choice
        next_S = master_S if q is None else migrate_sequences(
            tokens_S, served_SN, master_node_M, q=q, current_S=master_S,
            residual_rows_per_token=residual_rows_per_token, hidden_size=problem.hidden_size,
            capacity_tokens=capacity_tokens)
        # 3. count the crossings: dispatch from the master, gather to the next one, residual between them
        here, there = master_node_M[master_S], master_node_M[next_S]
        np.add.at(flow_LNN[layer], (here[:, None].repeat(len(nodes), 1), np.arange(len(nodes))), served_SN)
        np.add.at(flow_LNN[layer], (np.arange(len(nodes)), there[:, None].repeat(len(nodes), 1)), served_SN)
        np.add.at(flow_LNN[layer], (here, there), residual_rows_per_token * tokens_S)
        dispatch[layer] = (served_SN.sum() - served_SN[sequences, here].sum()) * one_way
        gather[layer] = (served_SN.sum() - served_SN[sequences, there].sum()) * one_way
        residual[layer] = residual_rows_per_token * tokens_S[here != there].sum() * one_way
        master_S = next_S
        path.append(master_S.tolist())
    return _traffic(problem, nodes, flow_LNN * one_way, dispatch, gather, residual, path)


def _check_counts(problem: PlacementProblem, counts_SLE: np.ndarray,
                  tokens_S: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    counts_SLE = np.asarray(counts_SLE, dtype=np.float64)
    tokens_S = np.asarray(tokens_S, dtype=np.int64)
    shape = (len(tokens_S), problem.num_layers, problem.num_experts)
    if counts_SLE.shape != shape:
        raise ValueError(f"counts_SLE has shape {counts_SLE.shape} but [num_sequences, num_layers, num_experts] "
                         f"is {list(shape)}: give one count per sequence, layer and expert of the problem")
    rows_SL = counts_SLE.sum(axis=2)
    bad = np.argwhere(np.abs(rows_SL - problem.top_k * tokens_S[:, None]) > 1e-9 * max(1, problem.top_k))
    if len(bad):
        s, layer = bad[0]
        raise ValueError(f"sequence {s} routes {rows_SL[s, layer]:g} rows in layer {layer}, not top_k * tokens = "
                         f"{problem.top_k} * {tokens_S[s]}: give every token's top-k choices")
    return counts_SLE, tokens_S


def _node_indices(problem: PlacementProblem) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(nodes, [W] node index of each worker, [M] node index of each master), masters' nodes first."""
    if problem.worker_nodes is None or problem.masters[0] is None:
        raise ValueError("simulating sequences needs worker_nodes and master_nodes (or master_node): give the node "
                         "of every worker and master")
    nodes = list(dict.fromkeys([*problem.masters, *problem.worker_nodes]))
    return (nodes, np.array([nodes.index(n) for n in problem.worker_nodes]),
            np.array([nodes.index(n) for n in problem.masters]))


def _traffic(problem: PlacementProblem, nodes: list[str], flow_LNN: np.ndarray, dispatch: np.ndarray,
             gather: np.ndarray, residual: np.ndarray, path: list[list[int]]) -> SequenceTraffic:
    """The report: per-NIC bytes from the node-to-node flows, and each layer's busiest NIC."""
    cross_LNN = flow_LNN * (1 - np.eye(len(nodes)))
    leaving_LN, entering_LN = cross_LNN.sum(axis=2), cross_LNN.sum(axis=1)
    through_LN = leaving_LN + entering_LN
    bandwidth = {link.name.removeprefix("nic:"): link.bandwidth_bytes_per_s
                 for link in problem.shared_links if link.name.startswith("nic:")}
    seconds = None
    if bandwidth:
        missing = [n for i, n in enumerate(nodes) if n not in bandwidth and through_LN[:, i].any()]
        if missing:
            raise ValueError(f"node {missing[0]!r} carries cross-node bytes but has no 'nic:{missing[0]}' shared link: "
                             "build the links with node_shared_links(worker_nodes, master_nodes, bandwidth)")
        nic_N = np.array([bandwidth.get(n, math.inf) for n in nodes])
        # a NIC carries both directions at once, each at its bandwidth (`problem.SharedLink`): its busier one
        seconds = (np.maximum(leaving_LN, entering_LN) / nic_N).max(axis=1, initial=0.0).tolist()
    return SequenceTraffic(dispatch_bytes=dispatch.tolist(), gather_bytes=gather.tolist(),
                           residual_bytes=residual.tolist(),
                           nic_bytes={n: through_LN[:, i].tolist() for i, n in enumerate(nodes)},
                           layer_nic_seconds=seconds, masters=path)
