"""ExpertManager: hosts the experts one worker owns, serves their rows and trains their LoRA adapters.

A plain class with no Ray in it (Ray Train v2 style): `actors.cluster.spawn_expert_managers`
is the one place that turns it into a Ray actor (one per GPU, or per CPU bundle in tests);
`vela_ray.training.master.build_local` and the in-process job runtime
(`vela_ray.runtime.local`) build it in this process.

    spec = ExpertManagerSpec(worker=0, model_dir="/ckpt", keys=[(0, 3), (1, 5)])
    manager = ExpertManager(spec)          # reads only experts (0, 3) and (1, 5)
    out_RD = manager.forward_rows(0, ids_R, rows_RD, key=k)
    grad_RD = manager.backward_rows(k, grad_out_RD)
    manager.step(lr, clip_coef)

Zero redundancy: the manager reads its own experts from the checkpoint
(`vela_ray.training.expert_spec.load_expert_weights`, memory-mapped); the master never sends expert
weights. Tests may pass in-memory `weights` instead of a `model_dir`.

Callers reach it by method name, in this process or through a Ray actor handle, so every call below
is one method of this class; what is not about rows and steps lives in delegates it holds and calls:
- data plane: `forward_rows`, `backward_rows` (ExpertShard's calls: in-process, or Ray object refs),
  or `join_collective` / `leave_collective`: a serving loop per master process on a thread of this process,
  answering that master over torch.distributed (`vela_ray.model.collective`, which calls the same two methods;
  row calls run one at a time, whichever thread makes them); with
  several masters' sequence migration also `collect_rows` and `backward_rows(..., master=)`
  (`transport.RowRelay`: rows answered to a master other than the sender, held in `held`);
- control plane: `grad_sq_norm`, `step`, `lora_state`, `load_lora_state`, `lora_grads` and
  `sum_copy_grads` (replicated experts: the copies' holders hand each other their gradients); `zo_apply` for
  zeroth-order training (`vela_ray.training.zo`). `step` and `zo_apply` answer the worker's counters
  (`worker_report.WorkerCounters`): the step's own fan-out carries its telemetry;
- checkpoints (`checkpoint_parts`, `vela_ray.training.checkpoint_parts`): `snapshot_checkpoint_part`
  (copies, then writes on a thread), `finish_checkpoint_part` (polled by the master), `load_checkpoint`.
  Loading state (`load_lora_state`, `load_checkpoint`) starts the worker at a step boundary: a step in
  progress, its gradients, saved graphs and held rows, is dropped (a recovery's failed step);
- live migration (`vela_ray.training.rehosting`, planned by `vela_ray.runtime.migration`):
  `expert_states` (what a leaving expert carries), `rehost` (host a new key set, reading arriving
  experts' weights from the checkpoint);
- APTMoE's CPU/device tiers (`tiers`, a `vela_ray.training.tiered.TieredExperts` when `spec.tiers` is
  enabled): the data plane computes each expert on the CPU or the device; `set_predictor`;
- probes: `ping` (liveness, and the PlacementService's link timing), `report` (where it runs, its sizing
  for the placement, its counters: `vela_ray.training.worker_report`).

Any failure in the data plane is re-raised as `ExpertWorkerError` naming this
worker and the (layer, expert) keys involved, with the worker's traceback (Ray adds it,
the collective plane sends it along).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Callable, Hashable, Iterator

import torch

from vela_ray.errors import ExpertWorkerError
from vela_ray.model import wire
from vela_ray.model.experts import ExpertKey, ExpertShard
from vela_ray.model.transport import HeldRows
from vela_ray.quiet import silence_known_warnings
from vela_ray.training.checkpoint_parts import ExpertCheckpointParts, read_part_states
from vela_ray.training.expert_spec import ExpertManagerSpec, load_expert_weights
from vela_ray.training.optim import ShardTrainer, ZoTensors, ZoTerm, apply_zo_terms, grad_sq_norm
from vela_ray.training import checkpoint, worker_report
from vela_ray.training.popularity import PopularityPredictor
from vela_ray.training.rehosting import (
    ExpertMove, ExpertStates, MigrationStats, arriving_weights, expert_states, host_experts, load_expert_states,
)
from vela_ray.training.tiered import TieredExperts
from vela_ray.training.worker_report import WorkerCounters, WorkerReport

__all__ = ["ExpertManager", "ExpertManagerSpec", "ExpertStates", "LoraState", "MigrationStats", "NotCounted",
           "load_expert_weights"]

logger = logging.getLogger(__name__)

LoraState = dict[ExpertKey, dict[str, torch.Tensor]]
NotCounted = dict[int, list[ExpertKey]]
"""{worker: its copies of replicated experts that another worker counts (in norms and checkpoints)}."""


class ExpertManager:
    """One worker's experts: an `ExpertShard` with its own AdamW (`ShardTrainer`)."""

    # What it hosts now (`rehosting.Hosting`), replaced as a whole by `rehost`.
    keys: list[ExpertKey]
    shard: ExpertShard
    trainer: ShardTrainer | None
    dtype: torch.dtype
    tiers: TieredExperts | None

    def __init__(self, spec: ExpertManagerSpec):
        silence_known_warnings()  # an actor process: Ray is imported by now, so the filters stay in front
        self.worker = spec.worker
        self.spec = spec
        self.device = torch.device("cpu" if spec.tiers.enabled else spec.device)  # tiered: the shard is in host memory
        weights, self.prototypes = load_expert_weights(spec)
        self.keys, self.shard, self.trainer, self.dtype, self.tiers = host_experts(
            spec, weights, self.prototypes, self.device)
        self.checkpoint_parts = ExpertCheckpointParts(self.worker)
        self.held = HeldRows()  # rows answered to a master other than their sender (`transport.RowRelay`)
        self.received_bytes = 0  # rows and gradients that arrived here, as counted on this side of the link
        self.compute_s = 0.0  # wall seconds spent in expert forward/backward (the data plane's arithmetic)
        self._serving: dict[int, threading.Thread] = {}  # the collective planes' serving loops, by master process
        # row calls run one at a time: each master's serving loop is a thread, Ray's calls another (`_one_at_a_time`)
        self._rows_lock = threading.Lock()
        self._ordered_on_device = False  # several masters' planes: each call's kernels queued after the previous's
        self._last_call: torch.cuda.Event | None = None
        logger.info("expert worker %d: hosting %d experts on %s", self.worker, len(self.keys), self.device)

    # -- data plane -------------------------------------------------------------------------

    def forward_rows(self, layer: int, expert_ids: torch.Tensor, rows: torch.Tensor,
                     key: Hashable | None = None, reply_to: torch.Tensor | None = None,
                     adapters: bool = True) -> torch.Tensor:
        """Unweighted expert outputs [R, D] for `rows` [R, D] of experts `expert_ids` [R] of `layer`, in the
        rows' format (`vela_ray.model.wire`) and on their device: the CPU for a Ray caller, the data plane's
        device for the collective plane's. With `key`, the graph is kept for `backward_rows(key, ...)`.
        With `reply_to` [R] (`transport.RowRelay`), only the rows where it is -1 come back; the others are held
        for the masters it names (`collect_rows`). `adapters` False: the base model's outputs, LoRA left out (a
        preference objective's reference pass)."""
        with self._one_at_a_time():
            self.received_bytes += rows.numel() * rows.element_size()
            with self._computing(lambda: f"forward of experts {_experts_of(layer, expert_ids)} (key {key!r})"):
                rows_RD = wire.decode(rows.to(self.device), self.dtype)
                out_RD = (self.tiers or self.shard).forward_rows(layer, expert_ids, rows_RD, key, adapters=adapters)
                out = wire.encode(out_RD, wire.reply_format(rows, self.dtype))
            out = out.to(rows.device)  # outside the timing: compute on CUDA is timed as launched
            # rows for other masters wait where the sender's rows go (the host for Ray), ready to travel
            return out if reply_to is None else self.held.hold(key, reply_to, out)

    def backward_rows(self, key: Hashable, grad: torch.Tensor, master: int | None = None) -> torch.Tensor | None:
        """d(rows) [R, D] for the forward saved under `key`, in `grad`'s format and on its device. A relayed
        forward's backward takes a part from each master its rows were answered to (`transport.RowRelay`):
        with `master`, `grad` is the d(outputs) of the rows answered to it, kept until the sender's own call
        (no `master`, its rows' part), which finishes the backward and returns every row's d(rows)."""
        with self._one_at_a_time():
            self.received_bytes += grad.numel() * grad.element_size()
            if master is not None:
                with self._computing(lambda: f"gradients of key {key!r} from master {master}"):
                    self.held.deposit(key, master, grad)
                return None
            with self._computing(lambda: f"backward of key {key!r}"):
                grad_out_RD = self.held.complete(key, grad, lambda g: wire.decode(g.to(self.device), self.dtype))
                grad_RD = (self.tiers or self.shard).backward_rows(key, grad_out_RD)
                out = wire.encode(grad_RD, wire.reply_format(grad, self.dtype))
            return out.to(grad.device)

    def collect_rows(self, key: Hashable, master: int) -> torch.Tensor:
        """The outputs held for `master` from the relayed forward saved under `key` (`transport.RowRelay`)."""
        with self._one_at_a_time(), self._computing(lambda: f"collecting the rows of key {key!r} for master {master}"):
            return self.held.collect(key, master)

    @contextlib.contextmanager
    def _one_at_a_time(self) -> Iterator[None]:
        """One row call at a time: several masters' serving loops (threads of this process) and Ray's calls reach
        the same experts, whose saved forwards, gradients and counters are not thread-safe. Once several masters'
        planes were joined on a GPU, each call's kernels are also queued after the previous call's (an event
        recorded on whichever stream made it), so gradients accumulate in call order on the device too. Only
        compute runs under it, never a wait on a link: one master's slow rows never hold up another's."""
        with self._rows_lock:
            ordered = self._ordered_on_device and self.device.type == "cuda"
            if ordered and self._last_call is not None:
                torch.cuda.current_stream(self.device).wait_event(self._last_call)
            try:
                yield
            finally:
                if ordered:
                    self._last_call = torch.cuda.Event()
                    self._last_call.record(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def _computing(self, what: Callable[[], str]) -> Iterator[None]:
        """Count the block's wall time as compute, and raise its failure as this worker's `ExpertWorkerError`."""
        start = time.perf_counter()
        try:
            yield
        except Exception as exc:
            raise self._error(what(), exc) from exc
        finally:
            self.compute_s += time.perf_counter() - start

    def _error(self, what: str, exc: Exception) -> ExpertWorkerError:
        hosted = self.keys if len(self.keys) <= 16 else f"{self.keys[:16]} ... ({len(self.keys)} in all)"
        return ExpertWorkerError(
            self.worker,
            f"{what} failed with {type(exc).__name__}: {exc}. This worker hosts {hosted}; if the experts "
            "differ, the placement table and the spawned workers' keys disagree: build both from one Placement",
        )

    def join_collective(self, host: str, port: int, world_size: int, timeout_s: float, master: int = 0,
                        num_masters: int = 1) -> None:
        """Join master process `master`'s collective planes as rank `worker + 1` and serve its rows on a thread of
        this process until that master stops it (`vela_ray.model.collective`); a loop of its own per master
        process (`num_masters` of them: data-parallel masters times tensor-parallel ranks), each calling this
        manager's row calls. Returns once this process reached the master's rendezvous store (raising if it
        cannot); the thread then joins the control group, which completes when the master and every other
        worker have joined too. Joining on the thread keeps this (Ray's) thread free: two masters forming their
        planes at once would otherwise each wait in a join the other's workers have not reached."""
        from vela_ray.model import collective

        if not self.leave_collective(master=master):  # it ends when its groups' sockets close; the new one serves
            logger.warning("expert worker %d: master %d's previous serving loop has not ended; serving its new plane "
                           "beside it", self.worker, master)
        if num_masters > 1 and not self._ordered_on_device:
            with self._rows_lock:
                self._ordered_on_device = True
        store = collective.make_store(host, port, world_size, is_master=False, timeout_s=timeout_s)

        def join_and_serve() -> None:
            try:
                group = collective.make_group(store, self.worker + 1, world_size, timeout_s, collective.node_address())
            except Exception as err:  # the master names it: its own join times out (`collective_transport`)
                logger.error("expert worker %d: joining master %d's collective plane failed: %s: %s", self.worker,
                             master, type(err).__name__, err)
                return
            collective.serve(group, self, master=master, shared=num_masters > 1)

        thread = threading.Thread(target=join_and_serve, daemon=True, name=f"vela-serve-{self.worker}-m{master}")
        self._serving[master] = thread
        thread.start()

    def leave_collective(self, timeout_s: float = 30.0, master: int | None = None) -> bool:
        """Wait for the serving loop of `master` (None: every master's) to end, after that master's stop; True
        if none of them is running."""
        masters = list(self._serving) if master is None else [master]
        deadline = time.monotonic() + timeout_s
        for m in masters:
            thread = self._serving.get(m)
            if thread is None:
                continue
            thread.join(max(0.0, deadline - time.monotonic()))
            if not thread.is_alive():
                del self._serving[m]
        return not any(m in self._serving for m in masters)

    # -- control plane ----------------------------------------------------------------------

    def grad_sq_norm(self, not_counted: NotCounted | None = None) -> float:
        """Squared norm of this worker's LoRA gradients, without the experts `not_counted[self.worker]`
        (copies of replicated experts that another worker counts)."""
        skip = self._not_counted_here(not_counted)
        if not self.trainer:
            return 0.0
        if not skip:
            return self.trainer.grad_sq_norm()
        return grad_sq_norm([p for key in self.keys if key not in skip for p in self.shard.expert(*key).parameters()])

    def step(self, lr: float, clip_coef: float) -> WorkerCounters:
        """The optimizer step; answers the counters after it, so that the trackers and the tiers' metrics need
        no round trip of their own (`ExpertWorkers.counters`)."""
        self.held.release()
        if self.trainer:
            self.trainer.step(lr, clip_coef)
        return self._counters()

    def zo_apply(self, terms: list[ZoTerm], which: ZoTensors = "lora") -> WorkerCounters:
        """Zeroth-order training (`vela_ray.training.zo`): add each (step seed, coefficient) term's noise to
        `which` tensors of every hosted expert: its LoRA, its frozen weights (full-parameter ZO), or both, in place
        where they live (a tiered worker's host copies, its device cache dropped). Each tensor's noise comes from
        its logical checkpoint name, so any placement adds the same numbers (and copies of a replicated expert stay
        identical). Answers the counters, as `step` does."""
        by_name = {key: dict(self.shard.expert(*key).named_parameters()) if which != "frozen" else {}
                   for key in self.keys}
        if which != "lora":
            if self.tiers is not None:
                self.tiers.weights_changed()  # before the writes: the copies in flight finish reading first
            for key, frozen in self.shard.frozen_views().items():
                by_name[key] |= frozen
        apply_zo_terms(checkpoint.expert_part_tensors(by_name), terms)
        return self._counters()

    def lora_state(self) -> LoraState:
        """This worker's adapters, keyed by logical (layer, expert), on the CPU."""
        return {key: {n: t.cpu() for n, t in params.items()} for key, params in self.shard.lora_state().items()}

    def lora_grads(self, keys: dict[int, list[ExpertKey]] | list[ExpertKey] | None = None) -> LoraState:
        """The accumulated LoRA gradients of `keys` (all hosted experts by default; a dict: this worker's
        entry), keyed like `lora_state`, on the CPU."""
        if isinstance(keys, dict):
            keys = keys.get(self.worker, [])
        return {
            key: {name: p.grad.detach().cpu().clone() for name, p in self.shard.expert(*key).named_parameters()}
            for key in (self.keys if keys is None else [tuple(k) for k in keys])
        }

    def sum_copy_grads(self, workers: list[int], *parts: LoraState) -> None:
        """Replicated experts: the gradient of each copy hosted here becomes the sum of every copy's (the
        gradient of the one expert they stand for), so that all copies take the same optimizer step.
        `parts[i]`: the `lora_grads` of worker `workers[i]`'s copies (handed over by Ray, not by the master).
        Each expert's sum runs in worker order, this worker's own gradient at its place, so every copy sums
        the same numbers in the same order and gets the same bits."""
        keys = sorted({tuple(key) for part in parts for key in part} & set(self.keys))
        by_worker = dict(zip(workers, parts)) | {self.worker: self.lora_grads(keys)}
        for key, named in _summed_in_order([by_worker[n] for n in sorted(by_worker)], keys).items():
            for name, p in self.shard.expert(*key).named_parameters():
                p.grad.copy_(named[name].to(p.grad.device))

    def load_lora_state(self, state: LoraState) -> None:
        """Load this worker's experts from `state` (a full or partial dict keyed by (layer, expert)), dropping
        any step in progress."""
        missing = [key for key in self.keys if key not in state]
        if missing:
            raise ExpertWorkerError(self.worker, f"adapter state lacks hosted experts {missing[:8]} "
                                                 f"(of {len(missing)}); load an adapter of the same model")
        self._drop_step()
        self.shard.load_lora_state({key: state[key] for key in self.keys})

    def _drop_step(self) -> None:
        """Forget the step in progress: its gradients, saved graphs and held rows. Loading state does this, so
        that the adapters and their gradients never belong to two different steps."""
        self.held.release()
        if self.trainer:
            self.trainer.zero_grad()

    def _not_counted_here(self, not_counted: NotCounted | None) -> set[ExpertKey]:
        return {tuple(k) for k in (not_counted or {}).get(self.worker, [])}

    # -- checkpoints (`checkpoint_parts`): written here, in parallel with the other workers -----

    def snapshot_checkpoint_part(self, staging_dir: str, not_counted: NotCounted | None = None) -> None:
        """Copy this worker's experts' LoRA and AdamW state to host memory now (so the next step cannot
        change what is saved) and write it, named by logical expert, on a thread of this process;
        `finish_checkpoint_part` waits. Copies of replicated experts in `not_counted[self.worker]` are
        left to the worker that counts them."""
        skip = self._not_counted_here(not_counted)
        states = self.expert_states([k for k in self.keys if k not in skip])
        self.checkpoint_parts.snapshot(staging_dir, states)

    def finish_checkpoint_part(self, timeout_s: float | None = None) -> str | None:
        """The part `snapshot_checkpoint_part` writes, once written; None if still writing after
        `timeout_s` (None: wait; `ExpertCheckpointParts.finish`)."""
        return self.checkpoint_parts.finish(timeout_s)

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Load LoRA and AdamW state of the experts this worker hosts, whichever worker wrote them, dropping
        any step in progress (a recovery's failed step: the checkpoint is of a step boundary)."""
        self._drop_step()
        load_expert_states(self.shard, self.trainer, read_part_states(checkpoint_dir, self.keys))

    # -- live migration (`rehosting`): between steps, with no graph in flight -----------------

    def expert_states(self, keys: list[ExpertKey]) -> ExpertStates:
        """LoRA factors and AdamW state of `keys`, on the CPU, named as in a checkpoint part:
        everything an expert carries when it moves to another worker (its frozen weights do not)."""
        keys = [tuple(k) for k in keys]
        missing = [k for k in keys if k not in self.keys]
        if missing:
            raise ExpertWorkerError(self.worker, f"cannot send experts {missing[:8]}: not hosted here")
        return expert_states(self.shard, self.trainer, keys)

    def rehost(self, keys: list[ExpertKey], *incoming: ExpertStates) -> MigrationStats:
        """Host exactly `keys` from now on: experts staying keep their weights and state, arriving ones
        read their frozen weights from the model's checkpoint (as at spawn) and take LoRA and AdamW
        state from `incoming` (their old workers' `expert_states`), leaving ones are dropped."""
        move = ExpertMove.between(self.worker, self.keys, keys, incoming)
        states = {**move.incoming, **self.expert_states(move.staying)}
        kept = self.shard.weights()
        # arriving weights are read to the CPU, staying ones are on the shard's device: one device to stack on
        arriving = arriving_weights(self.spec, move.arriving)
        weights = {k: kept[k] for k in move.staying} | {k: {name: t.to(self.device) for name, t in w.items()}
                                                        for k, w in arriving.items()}
        self.shard.release()
        self.keys, self.shard, self.trainer, self.dtype, self.tiers = host_experts(
            self.spec, weights, self.prototypes, self.device, previous_tiers=self.tiers)
        load_expert_states(self.shard, self.trainer, {k: states[k] for k in move.keys})
        logger.info("expert worker %d: now hosting %d experts (%d arrived, %d left)", self.worker, len(move.keys),
                    len(move.arriving), move.leaving)
        return move.stats(weights)

    # -- APTMoE's tiers (`tiers`, `expert_tiers`) ------------------------------------

    def set_predictor(self, state: dict[str, torch.Tensor], top_k: int) -> None:
        """Forecast each next layer's demand with this popularity predictor (a `PopularityPredictor`'s
        state_dict, fitted on the master: `vela_ray.training.popularity`); untiered workers ignore it."""
        if self.tiers:
            self.tiers.use_predictor(PopularityPredictor.from_state(state, top_k))

    # -- probes -------------------------------------------------------------------------------

    def ping(self, payload: torch.Tensor | None = None) -> int:
        """Cheap liveness check; returns the worker index. The PlacementService times these with
        `payload`s of several sizes to fit this worker's link."""
        return self.worker

    def report(self, num_rows: int | None = None) -> WorkerReport:
        """Where this worker runs, what the placement sizes it by, and its counters so far. `num_rows`:
        also time one row's forward + backward at that many rows (slow; training state is untouched)."""
        node, tiered = worker_report.node_id(), self.tiers is not None
        return WorkerReport(
            worker=self.worker, node_id=node, pid=os.getpid(), num_experts=len(self.keys),
            bytes_per_expert=worker_report.bytes_per_expert(self.shard),
            free_bytes=worker_report.free_bytes(self.device, tiered),
            memory_pool=worker_report.memory_pool(self.device, tiered, node),
            seconds_per_row=None if num_rows is None else worker_report.measured_seconds_per_row(
                self.shard, self.keys, self.tiers, num_rows),
            **dict(self._counters()))

    def _counters(self) -> WorkerCounters:
        return WorkerCounters(received_bytes=self.received_bytes, compute_s=self.compute_s,
                              tiers=self.tiers.stats() if self.tiers else None)


def _summed_in_order(parts: list[LoraState], keys: list[ExpertKey]) -> LoraState:
    """For each of `keys`, the sum of its gradients over the `parts` that hold it, added in the parts' order.
    The first is copied, not added to: a part from Ray may be a read-only view of the object store."""
    summed: LoraState = {}
    for part in parts:
        for key in keys:
            if key not in part:
                continue
            if key in summed:
                for name, grad in part[key].items():
                    summed[key][name] += grad
            else:
                summed[key] = {name: grad.clone() for name, grad in part[key].items()}
    return summed


def _experts_of(layer: int, expert_ids: torch.Tensor) -> list[ExpertKey]:
    """The (layer, expert) keys a request's rows go to, for its error message."""
    return sorted({(layer, int(e)) for e in expert_ids.tolist()})
