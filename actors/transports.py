"""Transports over Ray actors: move one MoE layer's rows to the ExpertManagers and back.

All backends implement `vela_ray.model.transport.Transport` and pass the same
conformance suite (tests/ray/test_transport_conformance.py):

- `collective_transport(...)` (the default, `data_plane.transport: collective`): forms
  torch.distributed groups with the ExpertManagers through Ray once, then rows travel
  point-to-point with no Ray task per layer (`vela_ray.model.collective.CollectiveTransport`):
  headers over gloo, the rows themselves over NCCL when the master and every worker have
  a GPU of their own. Its ranks need TCP to each other, beyond Ray's ports.
  Every master process (data-parallel masters, tensor-parallel ranks) forms planes of its own with
  the same workers (`master=`, `num_masters=`; `master_transport` picks the transport for one).
- `RayObjectRefTransport`: one `.remote` call per worker with rows, then one
  `ray.get` for all; tensors travel as Ray objects, so it works wherever Ray does, and
  with several masters, whose sequence migration it relays rows for (`transport.RowRelay`).

A Ray compiled-graph transport lived here until the collective plane beat it on the
same fan-out (0.58x its round trip, `benchmarks/data_plane.py`, results of commit
4d4c48f): one concept, one place.

    transport = RayObjectRefTransport(handles, link_tiers(master_node, nodes))
    outputs = transport.forward({0: ForwardRequest(...), 2: ForwardRequest(...)})
"""

from __future__ import annotations

import logging
from typing import Hashable, Sequence

import ray
import torch

from vela_ray.errors import ClusterError, first_line
from vela_ray.model.collective import Backend, CollectiveTransport, form_data_plane, make_group, make_store
from vela_ray.model.traffic import LinkTier
from vela_ray.model.transport import ForwardRequest, request_kwargs

logger = logging.getLogger(__name__)


def data_plane_env(inline_bytes: int, zero_copy_tensors: bool) -> dict[str, str]:
    """Environment variables for the processes that move rows (the master and the ExpertManagers).

    Both are read when a Ray worker process starts, so they go into the actors' runtime_env:
    `inline_bytes` > 0 lets results and arguments up to that size ride inside the task RPC
    (no object store create/seal/fetch); zero-copy tensors skip torch's pickling copy.
    On 2 cores, a forward+backward fan-out to 6 workers with 118-270 KiB each drops from 64 ms to
    36 ms (`python benchmarks/data_plane.py`, benchmarks/results/data_plane.json).
    """
    env = {}
    if inline_bytes:
        env["RAY_max_direct_call_object_size"] = str(inline_bytes)
    if zero_copy_tensors:
        env["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] = "1"
    return env


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the host with its own storage: pickling a view would ship its whole base tensor, and a
    GPU tensor would need a GPU on the other side."""
    if tensor.device.type != "cpu":
        return tensor.cpu()
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


def _check_tiers(handles: Sequence, worker_tiers: Sequence[LinkTier]) -> list[LinkTier]:
    if len(worker_tiers) != len(handles):
        raise ValueError(f"worker_tiers has {len(worker_tiers)} entries for {len(handles)} workers; "
                         "give one tier per handle (vela_ray.model.traffic.link_tiers)")
    return list(worker_tiers)


class RayObjectRefTransport:
    """One remote call per worker with rows, then one `ray.get` for all of them."""

    def __init__(self, handles: Sequence, worker_tiers: Sequence[LinkTier], timeout_s: float | None = None,
                 zero_copy: bool = False):
        """`zero_copy`: this process pickles tensors zero-copy (`data_plane_env`), so a view ships
        only its own bytes and needs no compacting copy first."""
        self.handles = list(handles)
        self.num_workers = len(self.handles)
        self.tiers = _check_tiers(self.handles, worker_tiers)
        self.timeout_s = timeout_s
        self._compact = (lambda t: t.cpu()) if zero_copy else compact

    def forward(self, requests: dict[int, ForwardRequest]) -> dict[int, torch.Tensor]:
        refs = {
            w: self.handles[w].forward_rows.remote(
                req.layer, self._compact(req.expert_ids), self._compact(req.rows), req.key,
                **{k: self._compact(v) if isinstance(v, torch.Tensor) else v for k, v in request_kwargs(req).items()})
            for w, req in requests.items()
        }
        return self._get(refs)

    def backward(self, key: Hashable, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        refs = {w: self.handles[w].backward_rows.remote(key, self._compact(grad)) for w, grad in grads.items()}
        return self._get(refs)

    def collect(self, key: Hashable, master: int, workers: list[int]) -> dict[int, torch.Tensor]:
        """`RowRelay`: the held rows travel from each worker straight to this process."""
        return self._get({w: self.handles[w].collect_rows.remote(key, master) for w in workers})

    def deposit(self, key: Hashable, master: int, grads: dict[int, torch.Tensor]) -> None:
        """`RowRelay`: waits until every worker has them, so the sender's backward (another process's call,
        which Ray does not order after this one) finds them."""
        self._get({w: self.handles[w].backward_rows.remote(key, self._compact(g), master) for w, g in grads.items()})

    def worker_tiers(self) -> list[LinkTier]:
        return self.tiers

    def close(self) -> None:
        """Nothing to release; here so all Ray transports close the same way."""

    def describe(self) -> str:
        return "object_ref"

    def _get(self, refs: dict[int, ray.ObjectRef]) -> dict[int, torch.Tensor]:
        values = ray.get(list(refs.values()), timeout=self.timeout_s)
        return dict(zip(refs, values))


def collective_transport(handles: Sequence, worker_tiers: Sequence[LinkTier], timeout_s: float = 300.0,
                         join_timeout_s: float = 120.0, device: str | torch.device = "cpu",
                         data_backend: Backend | None = None, master: int = 0,
                         num_masters: int = 1) -> CollectiveTransport:
    """Form the collective planes (this process rank 0, worker n rank n + 1) and return their transport.

    The rendezvous store listens on a free port of this node; every worker joins the control plane
    (gloo) through one Ray call and then serves rows on a thread until the transport is closed. Over
    the control plane the master then gathers each worker's device and forms the data plane
    (`vela_ray.model.collective.form_data_plane`). `device`: the master's, where its rows are and its
    results come back with NCCL. `data_backend`: "gloo" or "nccl" instead of the automatic choice
    (`vela_ray.model.collective.data_backend`), e.g. "gloo" to compare the two.

    `master` of `num_masters`: which of the master processes sharing these workers this one is (data-parallel
    masters times tensor-parallel ranks; `master_transport`). Any master process may call it, in any order or at
    once: each forms planes of its own on its own store, every worker serves each master on a loop of its own,
    and closing this transport stops only this master's loops.
    """
    tiers = _check_tiers(handles, worker_tiers)
    if not 0 <= master < num_masters:
        raise ValueError(f"master {master} is not one of the {num_masters} master processes")
    world_size = len(handles) + 1
    address = ray.util.get_node_ip_address()
    store = make_store(address, 0, world_size, is_master=True, timeout_s=join_timeout_s)
    joins = [h.join_collective.remote(store.host, store.port, world_size, join_timeout_s,
                                      **_plane_of(master, num_masters)) for h in handles]
    try:
        group = make_group(store, 0, world_size, join_timeout_s, address)
        ray.get(joins, timeout=join_timeout_s)
    except Exception as err:  # the store's or gloo's timeout, or a worker's own failure to connect
        raise ClusterError(
            f"the collective data plane did not form within {join_timeout_s:g} s ({first_line(err)}): the "
            f"ExpertManagers join it at {address}:{store.port}, then every rank connects to every other over TCP. "
            "Open TCP between the nodes, or set data_plane.transport: object_ref to send rows through Ray") from None
    # the workers' devices travel over the control plane; on failure it tells their loops to stop first
    data = form_data_plane(group, store, len(handles), device, data_backend, timeout_s, join_timeout_s, address)
    logger.info("collective data plane of master %d of %d over %d expert workers: control over gloo, rows over %s",
                master, num_masters, len(handles), data.backend)

    def join_serving_loops() -> None:  # best effort: a dead worker has no loop left to join
        for ref in [h.leave_collective.remote(**({} if num_masters == 1 else {"master": master})) for h in handles]:
            try:
                ray.get(ref, timeout=join_timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass

    return CollectiveTransport(group, data, tiers, timeout_s, on_close=join_serving_loops)


def _plane_of(master: int, num_masters: int) -> dict[str, int]:
    """`join_collective`'s keywords for master `master` of `num_masters` (none for the only master: its defaults)."""
    return {} if num_masters == 1 else {"master": master, "num_masters": num_masters}


def master_transport(config, handles: Sequence, worker_tiers: Sequence[LinkTier], master: int = 0,
                     device: str | torch.device = "cpu") -> RayObjectRefTransport | CollectiveTransport:
    """The data plane of one master process to the ExpertManager actors `handles`, as `config.data_plane.transport`
    says: its own collective planes (`collective_transport`, rows over NCCL where it and the workers have GPUs)
    or Ray object refs. Every master process calls it, master 0 (`actors.pool.RayWorkerPool`) and each other rank
    (`actors.masters.RayRanks`), with `master` its place among the master processes: data-parallel master m's
    tensor-parallel rank t is m * cluster.master_tp + t (`MasterMesh.flat`; `config.master_processes` in all), the number
    its dispatcher's keys are counted by. `device`: this process's, where its rows are (its GPU, or the CPU)."""
    if config.data_plane.transport == "collective":
        return collective_transport(handles, worker_tiers, device=device, master=master,
                                    num_masters=config.master_processes)
    return RayObjectRefTransport(handles, worker_tiers, zero_copy=config.data_plane.zero_copy_tensors)
