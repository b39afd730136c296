"""Data-parallel replicas of the master: the one hook `train_step` and `eval_loss` take for them.

A step may run on several replicas of the master's backbone at once, each on its own
shard of the batch: the expert-parallel baseline's ranks (`vela_ray.baselines.expert_parallel`),
each with its own experts, and vela-ray's data-parallel masters (`masters.count`), which
share the ExpertManagers. The step itself is the same; each replica computes its share of
the loss (`ReplicaShare`), and the replicas only have to agree on two things, and `Replicas`
is exactly those two:

    sync_grads(params)  sum the backbone LoRA gradients over replicas (after backward,
                        before clipping), so every replica takes the same optimizer step;
    sum(value)          sum a scalar over replicas: the experts' squared gradient norms
                        (for global clipping) and the replicas' shares of the loss.

A lone master is `SINGLE` (identity), the default of `train_step`; `ProcessGroupReplicas`
all-reduces over a torch.distributed group (gloo on CPU, NCCL on GPU); `ThreadGroup` lets
replicas in one process's threads do the same (the in-process form of several masters).

Sequence migration among masters (`vela_ray.training.sequence_migration`) needs two more
collective calls, which both `ProcessGroupReplicas` and `ThreadReplicas` have (`Exchanger`):

    sum_tensor(tensor)            the element-wise sum over replicas (every replica gets it);
    exchange(outgoing, incoming)  point-to-point: send outgoing[r] to replica r, receive a tensor of
                                  incoming[r] = (shape, dtype) from replica r (every replica calls it).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from vela_ray.data.examples import IGNORE_INDEX

Batch = dict[str, torch.Tensor]
WATCH_INTERVAL_S = 0.005  # how often a waiting sum checks `ProcessGroupReplicas.watch`


class Replicas(Protocol):
    """What `train_step`/`eval_loss` need from the other replicas (every call is collective), and the
    backbone gradient bytes this replica has sent to the others so far (the step records read it)."""

    grad_bytes: int

    def sync_grads(self, params: Sequence[nn.Parameter]) -> None: ...

    def sum(self, value: float) -> float: ...


Incoming = dict[int, tuple[tuple[int, ...], torch.dtype]]  # {source replica: (shape, dtype)}


class Exchanger(Protocol):
    """Replicas that can also move tensors among themselves (sequence migration)."""

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def exchange(self, outgoing: dict[int, torch.Tensor], incoming: Incoming) -> dict[int, torch.Tensor]: ...


class SingleReplica:
    """One master, no other replicas: nothing to sync, a sum is the value itself."""

    grad_bytes = 0

    def sync_grads(self, params: Sequence[nn.Parameter]) -> None:
        pass

    def sum(self, value: float) -> float:
        return value


SINGLE = SingleReplica()


class ProcessGroupReplicas:
    """Replicas as the ranks of a torch.distributed process group; counts the gradient all-reduce bytes.

    `group`: None for torch's default group (the expert-parallel ranks), or a gloo group of its own
    (`vela_ray.model.collective.make_group`, the data-parallel masters), reduced on the host.
    `watch(group_failed)`: with a group of its own, called while a sum waits (False) and once when the
    group fails (True, e.g. a rank's connection closed); it raises the failed rank's own error
    (master 0 watches the other masters' Ray calls), so a rank that will never join does not hold
    this one until the group's timeout, and a dead one is named, not a closed socket.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, watch: Callable[[bool], None] | None = None):
        self.group = group
        self.watch = watch
        self.grad_bytes = 0  # backbone LoRA gradients all-reduced so far, as this rank sent them

    def sync_grads(self, params: Sequence[nn.Parameter]) -> None:
        """Sum the gradients over ranks in one flat buffer (one collective, not one per tensor)."""
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self._all_sum(torch.cat([g.reshape(-1) for g in grads]))
        self.grad_bytes += flat.numel() * flat.element_size()
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
            offset += g.numel()

    def sum(self, value: float) -> float:
        """The float64 sum over ranks."""
        return float(self._all_sum(torch.tensor([value], dtype=torch.float64)).item())

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over ranks (a new tensor; `tensor` is left as it is)."""
        return self._all_sum(tensor.clone())

    def exchange(self, outgoing: dict[int, torch.Tensor], incoming: Incoming) -> dict[int, torch.Tensor]:
        """Send `outgoing[rank]` to each rank and receive `incoming`'s tensors: one all-to-all with uneven
        splits (through host memory on a gloo group of its own), so it is watched like a sum (a p2p
        operation never reports itself completed before its wait). Every tensor must have one dtype;
        returns the received tensors on the sent ones' device."""
        if self.group is None:
            raise ValueError("exchange needs a process group of its own (the data-parallel masters' group)")
        size = self.group.size()
        dtypes = [t.dtype for t in outgoing.values()] + [dtype for _, dtype in incoming.values()]
        dtype = dtypes[0] if dtypes else torch.float32
        device = next((t.device for t in outgoing.values()), torch.device("cpu"))
        sent = [outgoing[r].detach().reshape(-1).cpu() if r in outgoing else torch.empty(0, dtype=dtype)
                for r in range(size)]
        recv_sizes = [math.prod(incoming[r][0]) if r in incoming else 0 for r in range(size)]
        received = torch.empty(sum(recv_sizes), dtype=dtype)
        self._wait(self.group.alltoall_base(received, torch.cat(sent), recv_sizes, [t.numel() for t in sent]))
        parts = dict(zip(range(size), received.split(recv_sizes)))
        return {r: parts[r].view(shape).to(device) for r, (shape, _) in incoming.items()}

    def _all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is None:  # torch's default group; NCCL reduces only device tensors
            if dist.get_backend() == "nccl" and not tensor.is_cuda:
                return self._all_sum(tensor.cuda()).cpu()
            dist.all_reduce(tensor)
            return tensor
        host = tensor.cpu()  # a gloo group of its own reduces host tensors
        self._wait(self.group.allreduce([host]))
        return host.to(tensor.device)

    def _wait(self, work) -> None:
        """Wait for one operation on the group of its own, watching the other ranks meanwhile."""
        try:
            while self.watch is not None and not work.is_completed():
                self.watch(False)
                time.sleep(WATCH_INTERVAL_S)
            work.wait()
        except RuntimeError:  # the group broke: some rank died or failed
            if self.watch is not None:
                self.watch(True)
            raise


class ThreadGroup:
    """Replicas that are threads of one process: each sum waits for all of them (a barrier) and every
    thread adds the contributions in rank order, so all get bitwise the same result."""

    def __init__(self, size: int):
        self.size = size
        self._slots: list = [None] * size
        self._barrier = threading.Barrier(size)

    def member(self, rank: int) -> "ThreadReplicas":
        return ThreadReplicas(self, rank)

    def abort(self) -> None:
        """Release the threads waiting in a sum (one replica failed): they raise BrokenBarrierError."""
        self._barrier.abort()

    def all_sum(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        self._slots[rank] = tensor
        self._barrier.wait()
        total = self._slots[0].clone()
        for other in self._slots[1:]:
            total += other
        self._barrier.wait()  # nobody overwrites a slot before every thread has read them all
        return total

    def exchange(self, rank: int, outgoing: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """What every other thread sent to `rank` (copies), keyed by sender."""
        self._slots[rank] = outgoing
        self._barrier.wait()
        received = {src: sent[rank].detach().clone() for src, sent in enumerate(self._slots) if rank in sent}
        self._barrier.wait()
        return received


@dataclass
class ThreadReplicas:
    """One thread's `Replicas` in a `ThreadGroup`; threads share memory, so no gradient byte is sent."""

    group: ThreadGroup
    rank: int
    grad_bytes: int = 0

    def sync_grads(self, params: Sequence[nn.Parameter]) -> None:
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.group.all_sum(self.rank, torch.cat([g.reshape(-1) for g in grads]))
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
            offset += g.numel()

    def sum(self, value: float) -> float:
        return float(self.group.all_sum(self.rank, torch.tensor([value], dtype=torch.float64)).item())

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.group.all_sum(self.rank, tensor)

    def exchange(self, outgoing: dict[int, torch.Tensor], incoming: Incoming) -> dict[int, torch.Tensor]:
        received = self.group.exchange(self.rank, outgoing)
        if {r: (tuple(t.shape), t.dtype) for r, t in received.items()} != {r: (tuple(s), d) for r, (s, d) in
                                                                           incoming.items()}:
            raise RuntimeError(f"master {self.rank} expected {incoming} in the exchange, got "
                               f"{ {r: tuple(t.shape) for r, t in received.items()} }")
        return received


@dataclass(frozen=True)
class ReplicaShare:
    """Replica `rank` of `num_replicas`: its contiguous slice of each micro-batch's rows and its share of
    the micro-batch's loss, so that the replicas' losses add up to the loss of the whole micro-batch.

    The share is the summed token loss of its rows over the *micro-batch's* label count. A router aux
    loss (a product of two means over the tokens) does not split: each replica's is weighted by its
    share of the unpadded tokens, exact without aux loss, an approximation with it.
    """

    rank: int
    num_replicas: int
    aux_loss_coef: float = 0.0
    device: torch.device | str = "cpu"

    def rows(self, batch: Batch) -> Batch:
        return shard_rows(batch, self.rank, self.num_replicas)

    def loss(self, model: nn.Module, full: Batch) -> torch.Tensor:
        """The `loss_fn` of `train_step`/`eval_loss`: summed over replicas it is the loss of `full`."""
        part = {k: v.to(self.device) for k, v in self.rows(full).items()}
        out = model(**part, num_items_in_batch=max(1, label_count(full)))
        loss = out.loss
        aux = getattr(out, "aux_loss", None)
        if aux is not None and self.aux_loss_coef:
            mask = full.get("attention_mask", torch.ones_like(full["input_ids"]))
            share = float(self.rows({"m": mask})["m"].sum() / mask.sum().clamp(min=1))
            loss = loss - self.aux_loss_coef * (1.0 - share) * aux  # the model added coef * aux in full
        return loss


def shard_rows(batch: Batch, rank: int, num_ranks: int) -> Batch:
    """Replica `rank`'s contiguous slice of the batch rows (np.array_split sizes: they differ by at most one)."""
    rows = next(iter(batch.values())).shape[0]
    if rows < num_ranks:
        raise ValueError(f"a micro-batch of {rows} rows cannot feed {num_ranks} replicas (expert-parallel ranks "
                         "or masters): each needs at least one row; raise training.micro_batch_size (or "
                         "batch_size) or use fewer")
    bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(rows), num_ranks)])
    return {k: v[bounds[rank]:bounds[rank + 1]] for k, v in batch.items()}


def label_count(batch: Batch) -> int:
    """Tokens that carry a loss in the whole micro-batch (labels shifted by one, as causal LMs do)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
