"""Conventional expert parallelism (the VELA paper's baseline, its Fig. 2) over torch.distributed.

N ranks run in lockstep. Every rank holds a full backbone replica with its
LoRA and the experts e mod N of every MoE block (with theirs); the global batch
is sharded over the ranks. The model is the same stripped model with
`ExpertBroker`s that vela-ray's master runs: only the transport differs.
`AllToAllTransport` moves a layer's rows with `all_to_all_single` (gloo on
CPU, NCCL on GPU) instead of master-to-worker calls, so there is one dispatch
path and one autograd Function for both systems.

Legend: N = ranks, E = experts per layer, D = hidden, R = rows this rank routes
in one layer, Q = rows it receives for its own experts.

Stages of one training step, on every rank: `vela_ray.training.step.train_step`, the
step vela-ray's master runs, given this rank's loss (`ExpertParallelRank.loss`) and its
replicas (`ProcessGroupReplicas`, the data-parallel hook):
  1. shard: rank r takes its contiguous slice of each micro-batch's rows
     (`vela_ray.training.replicas.ReplicaShare`); its loss is the summed token loss divided by the
     *micro-batch's* label count, so the ranks' losses add up to the loss of
     the whole micro-batch (a router aux loss, a product of two means over the
     tokens, does not split: each rank's is weighted by its share of the
     unpadded tokens, exact without aux loss, an approximation with it);
  2. forward/backward: at each MoE block the broker plans rows per owner rank;
     the transport exchanges counts [N, E], then rows, runs the local experts
     on what arrived and sends the outputs back; backward retraces the same
     splits with the gradients. All ranks reach every block in the same order,
     so the collectives pair up;
  3. all-reduce (sum) the backbone LoRA gradients: every replica now holds the
     gradient of the global-batch loss. Expert LoRA gradients stay local;
  4. global grad-norm clipping: backbone norm (identical on every rank) plus
     the all-reduced sum of the expert shards' squared norms;
  5. AdamW on the backbone (identical on every rank) and on the local experts.

Traffic: the broker's `TrafficCounter` counts what this rank sends to and
gets back from every other rank, with each rank's link tier given by the node
it runs on (`vela_ray.model.traffic.link_tiers`); summed over ranks, every transfer is
counted once. The backbone all-reduce is reported apart (`ProcessGroupReplicas.grad_bytes`).

Usage (inside an initialised process group; `actors.expert_parallel` launches it on Ray):

    rank = build_rank(model_dir, "float32", LoraSpec(8, 16), OptimizerConfig(), seed=0,
                      rank_nodes=["a", "a", "b", "b"])
    loss = train_step(rank.master, rank.workers, micro_batches, lr, max_grad_norm=1.0,
                      loss_fn=rank.loss, replicas=rank.replicas)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from placement import sequential_table
from vela_ray.model.dtypes import torch_dtype
from vela_ray.model.experts import LoraSpec
from vela_ray.model.modeling import find_moe_blocks
from vela_ray.model.traffic import LinkTier, link_tiers
from vela_ray.model.transport import ForwardRequest
from vela_ray.training.expert_manager import ExpertManager, ExpertManagerSpec
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.training.replicas import ProcessGroupReplicas, ReplicaShare
from vela_ray.training.adapter_io import import_adapter
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.master import MasterModel, MasterSpec, build_master_replica, seeded_backbone

logger = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]


@dataclass
class _Splits:
    """Rows this rank sent to / received from each rank in one forward, kept for its backward."""

    send: list[int]
    recv: list[int]


class AllToAllTransport:
    """`vela_ray.model.transport.Transport` over all-to-all collectives: rank r hosts the experts the table gives r.

    Every call is collective: all ranks must call `forward` (and later
    `backward`) for the same layer in the same order, each with its own requests.
    `experts` is this rank's own `ExpertManager`, the class vela-ray's workers run.
    """

    def __init__(self, experts: ExpertManager, num_experts: int, hidden_size: int,
                 worker_tiers: Sequence[LinkTier], group: dist.ProcessGroup | None = None):
        self.experts = experts
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_workers = dist.get_world_size(group)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        if len(worker_tiers) != self.num_workers:
            raise ValueError(f"worker_tiers has {len(worker_tiers)} entries for {self.num_workers} ranks")
        self.tiers = list(worker_tiers)
        self.control_bytes = 0  # the [N, E] count exchanges, not counted by the broker
        self._splits: dict[Hashable, _Splits] = {}

    def worker_tiers(self) -> list[LinkTier]:
        return self.tiers

    def describe(self) -> str:
        return f"all-to-all ({dist.get_backend(self.group)})"

    def forward(self, requests: dict[int, ForwardRequest]) -> dict[int, torch.Tensor]:
        """Send each rank its rows, run the rows that arrived through the local experts, return the outputs."""
        if not requests:
            raise ValueError(f"rank {self.rank} routes no rows in this layer; expert parallelism needs every "
                             "rank to take part in each all-to-all (give every rank at least one token)")
        first = next(iter(requests.values()))
        counts_NE = self._exchange_counts(requests)
        send = [int(requests[w].rows.shape[0]) if w in requests else 0 for w in range(self.num_workers)]
        recv = counts_NE.sum(dim=1).tolist()
        rows_QD = self._exchange(_cat_by_rank(requests, self.num_workers, first.rows), recv, send)
        expert_ids_Q = torch.repeat_interleave(
            torch.arange(self.num_experts).repeat(self.num_workers), counts_NE.reshape(-1))
        out_QD = self.experts.forward_rows(first.layer, expert_ids_Q, rows_QD, first.key)
        if first.key is not None:
            self._splits[first.key] = _Splits(send, recv)
        out_RD = self._exchange(out_QD, send, recv)
        return _split_by_rank(out_RD, send, requests)

    def backward(self, key: Hashable, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Send d(outputs) back along the forward's splits; return d(rows) from the owners."""
        splits = self._splits.pop(key)
        like = next(iter(grads.values()))
        grad_out_QD = self._exchange(_cat_by_rank(grads, self.num_workers, like), splits.recv, splits.send)
        grad_rows_QD = self.experts.backward_rows(key, grad_out_QD)  # zeros when no rows arrived
        grad_RD = self._exchange(grad_rows_QD.contiguous(), splits.send, splits.recv)
        return _split_by_rank(grad_RD, splits.send, grads)

    def release(self) -> None:
        """Forget splits kept for a backward that will not come (after an aborted step)."""
        self._splits.clear()

    def _exchange_counts(self, requests: dict[int, ForwardRequest]) -> torch.Tensor:
        """[N, E] rows per (source rank, expert) that this rank receives; rows arrive grouped that way."""
        device = next(iter(requests.values())).rows.device
        send_NE = torch.zeros(self.num_workers, self.num_experts, dtype=torch.int64, device=device)
        for worker, req in requests.items():
            send_NE[worker] = torch.bincount(req.expert_ids.to(device), minlength=self.num_experts)
        recv_NE = torch.empty_like(send_NE)
        dist.all_to_all_single(recv_NE, send_NE, group=self.group)
        self.control_bytes += 2 * send_NE.numel() * send_NE.element_size()
        return recv_NE.cpu()

    def _exchange(self, tensor_XD: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        out = tensor_XD.new_empty(sum(recv), self.hidden_size)
        dist.all_to_all_single(out, tensor_XD.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                               group=self.group)
        return out


def _cat_by_rank(parts: dict[int, ForwardRequest | torch.Tensor], num_workers: int, like: torch.Tensor):
    """Rows for rank 0, 1, ... concatenated (ranks without rows contribute nothing)."""
    ordered = [parts[w] for w in range(num_workers) if w in parts]
    tensors = [p.rows if isinstance(p, ForwardRequest) else p for p in ordered]
    return torch.cat(tensors) if tensors else like.new_empty(0, like.shape[-1])


def _split_by_rank(tensor: torch.Tensor, sizes: list[int], wanted: dict) -> dict[int, torch.Tensor]:
    pieces = torch.split(tensor, sizes)
    return {w: pieces[w] for w in sorted(wanted)}


# --- one rank ------------------------------------------------------------------------------------


@dataclass
class ExpertParallelRank:
    """One rank's replica: the backbone with brokers (peft-wrapped), its own experts, its peers."""

    rank: int
    num_ranks: int
    master: MasterModel
    experts: ExpertManager
    transport: AllToAllTransport
    replicas: ProcessGroupReplicas
    aux_loss_coef: float
    device: str = "cpu"

    @property
    def workers(self) -> ExpertWorkers:
        """This rank's experts as `train_step` steps them (disjoint from every other rank's)."""
        return ExpertWorkers.in_process([self.experts])

    @property
    def share(self) -> ReplicaShare:
        return ReplicaShare(self.rank, self.num_ranks, self.aux_loss_coef, self.device)

    def loss(self, model: torch.nn.Module, full: Batch) -> torch.Tensor:
        """This rank's share of the micro-batch loss (`ReplicaShare.loss`): summed over ranks it is the loss
        of `full`. The `loss_fn` of `train_step`/`eval_loss`."""
        return self.share.loss(model, full)


def build_rank(model_dir, dtype: str, lora: LoraSpec, optim: OptimizerConfig, seed: int, rank_nodes: Sequence[str],
               device: str = "cpu", init_adapter=None, group: dist.ProcessGroup | None = None) -> ExpertParallelRank:
    """This rank's replica: backbone from `model_dir`, experts e mod N read from the checkpoint.

    Seeding and build order follow vela-ray's master (seed, load the backbone, wrap with
    peft) and the experts are an `ExpertManager` like vela-ray's workers (LoRA init seeded
    per (layer, expert)), so EP and vela-ray start from the same adapters; `init_adapter`
    (a peft adapter directory of the original model) replaces them, as `lora.init_adapter` does.
    """
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    if len(rank_nodes) != num_ranks:
        raise ValueError(f"rank_nodes names {len(rank_nodes)} nodes for {num_ranks} ranks")
    spec = MasterSpec(model_dir=Path(model_dir), dtype=torch_dtype(dtype), lora=lora, optim=optim, seed=seed,
                      device=torch.device(device))
    model = seeded_backbone(spec)
    blocks = find_moe_blocks(model)
    layout = blocks[0].layout
    table = sequential_table(len(blocks), layout.num_experts, num_ranks)
    experts = ExpertManager(ExpertManagerSpec(
        worker=rank, keys=[tuple(k) for k in np.argwhere(table == rank).tolist()], model_dir=str(model_dir),
        lora=lora, optim=optim, seed=seed, dtype=dtype, device=device))
    transport = AllToAllTransport(experts, layout.num_experts, layout.hidden_size,
                                  link_tiers(rank_nodes[rank], rank_nodes, origin_index=rank), group)
    master = build_master_replica(spec, table, transport, model=model)
    ep_rank = ExpertParallelRank(rank, num_ranks, master, experts, transport, ProcessGroupReplicas(group),
                                 float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0), device)
    if init_adapter is not None:
        import_adapter(master, ep_rank.workers, init_adapter)
    logger.info("EP rank %d/%d: %d experts, node %s", rank, num_ranks, len(experts.keys), rank_nodes[rank])
    return ep_rank
