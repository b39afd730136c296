"""One training step of the master, over any set of expert workers.

`train_step` is the whole step: forward/backward over the micro-batches
(experts run wherever the placement put them, through the brokers), global
grad-norm clipping across master and workers, and the optimizer steps on
both sides. Every runtime calls the same function: the job runner with
ExpertManagers in this process or behind Ray actors (`ExpertWorkers`), tests
with in-process ShardTrainers.

`build_local` splits an in-memory model into a master-side peft model with
brokers and in-process ExpertManagers: the single-process form of vela-ray.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from peft import PeftModel, get_peft_model
from torch import nn

from vela_ray.model.adapters import (
    backbone_lora_config, backbone_state_of, export_adapter, full_lora_config, resolve_expert_lora,
)
from vela_ray.model.broker import ExpertDispatcher
from vela_ray.model.experts import ExpertKey, LoraSpec
from vela_ray.model.modeling import attach_brokers, enable_activation_checkpointing, expert_weights, find_moe_blocks
from vela_ray.model import tensor_parallel
from vela_ray.model.tensor_parallel import TensorParallelConfig, TensorParallelPlan
from vela_ray.training.expert_manager import ExpertManager, ExpertManagerSpec
from vela_ray.training.optim import apply_step, clip_coefficient, grad_sq_norm, make_adamw
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.training.replicas import SINGLE, Replicas
from vela_ray.model.transport import InProcessTransport, Transport
from vela_ray.model.traffic import RowFormat

if TYPE_CHECKING:
    from vela_ray.model.sharded_loading import ReadStats

logger = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
LoraState = dict[ExpertKey, dict[str, torch.Tensor]]


class ExpertWorkers:
    """The control plane over every expert worker (the data plane is the Transport).

    Each call fans out to all workers and gathers their answers, so the workers step, load
    and report in parallel. One class for every runtime; only the fan-out differs:
    `ExpertWorkers.in_process(objs)` calls objects in this process (ExpertManagers, or
    ShardTrainers in tests), `actors.workers.actor_workers(handles)` calls Ray actors.
    """

    def __init__(self, call_all: Callable[..., list[Any]], num_workers: int):
        self._call_all = call_all  # (method name, *args) -> one result per worker
        self.num_workers = num_workers
        # Replicated experts (several masters, each using its nearest copy): {expert: its workers}. The
        # first worker of each counts it in norms and checkpoints; the others' copies are `not_counted`.
        self.copies: dict[ExpertKey, list[int]] = {}

    @classmethod
    def in_process(cls, workers: Sequence[Any]) -> "ExpertWorkers":
        workers = list(workers)
        return cls(lambda method, *args: [getattr(w, method)(*args) for w in workers], len(workers))

    def set_copies(self, copies: dict[ExpertKey, list[int]]) -> None:
        """The replicated experts of the placement the workers now host (`migration.copies_of`)."""
        self.copies = dict(copies)

    @property
    def not_counted(self) -> dict[int, list[ExpertKey]]:
        out: dict[int, list[ExpertKey]] = {}
        for key, workers in self.copies.items():
            for worker in workers[1:]:
                out.setdefault(worker, []).append(key)
        return out

    def grad_sq_norm(self) -> float:
        """Sum over workers of their experts' squared gradient norms, each expert once.

        Called after every master's backward: first the copies of each replicated expert get the sum
        of all copies' gradients (the gradient of the one expert they stand for), so that they take
        the same optimizer step and stay identical."""
        if not self.copies:
            return float(sum(self._call_all("grad_sq_norm")))
        self._sum_copies()
        return float(sum(self._call_all("grad_sq_norm", self.not_counted)))

    def _sum_copies(self) -> None:
        by_worker: dict[int, list[ExpertKey]] = {}
        for key, workers in self.copies.items():
            for worker in workers:
                by_worker.setdefault(worker, []).append(key)
        summed: LoraState = {}
        for part in self._call_all("lora_grads", by_worker):  # in worker order: every copy sums alike
            for key, named in part.items():
                if key in summed:
                    for name, grad in named.items():
                        summed[key][name] += grad
                else:
                    summed[key] = named
        self._call_all("set_lora_grads", summed)

    def step(self, lr: float, clip_coef: float) -> None:
        self._call_all("step", lr, clip_coef)

    def zo_apply(self, terms: list[tuple[int, float]]) -> None:
        """Zeroth-order training (`vela_ray.training.zo`): every worker adds each (step seed, coefficient)
        term's noise to its own experts' LoRA, drawing the noise itself; only the scalars travel."""
        self._call_all("zo_apply", terms)

    def lora_state(self) -> LoraState:
        """All experts' adapters, keyed by logical (layer, expert)."""
        state: LoraState = {}
        for part in self._call_all("lora_state"):
            state.update(part)
        return state

    def load_lora_state(self, state: LoraState) -> None:
        """Each worker takes its own experts from `state`."""
        self._call_all("load_lora_state", state)

    def save_checkpoint_parts(self, staging_dir: str) -> list[str]:
        """Every worker writes its experts' LoRA and AdamW state into the staging directory (a replicated
        expert once, by the worker that counts it)."""
        self.snapshot_checkpoint_parts(staging_dir)
        return self.finish_checkpoint_parts()

    def snapshot_checkpoint_parts(self, staging_dir: str) -> None:
        """`save_checkpoint_parts` in two halves: every worker copies its state now and writes it into the
        staging directory on a thread of its own; `finish_checkpoint_parts` waits for the files."""
        self._call_all("snapshot_checkpoint_part", staging_dir, self.not_counted)

    def finish_checkpoint_parts(self, poll_s: float | None = None) -> list[str]:
        """Every worker's part file once written (a failed write raises). `poll_s`: ask every `poll_s`
        seconds instead of waiting inside the workers, which would hold up their data plane meanwhile."""
        if poll_s is None:
            return self._call_all("finish_checkpoint_part")
        while True:
            parts = self._call_all("finish_checkpoint_part", 0.0)
            if all(part is not None for part in parts):
                return parts
            time.sleep(poll_s)

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        self._call_all("load_checkpoint", checkpoint_dir)

    def reports(self) -> list:
        """Per worker: its `worker_report.WorkerReport` (where it runs, its sizing, its counters so far)."""
        return self._call_all("report")

    def tier_stats(self) -> list:
        """Per worker: its `tiers.TierCounters` (`expert_tiers`), None where untiered."""
        return [report.tiers for report in self.reports()]

    def set_predictor(self, state: dict[str, torch.Tensor], top_k: int) -> None:
        """Every tiered worker forecasts next-layer demand with this `popularity.PopularityPredictor` state."""
        self._call_all("set_predictor", state, top_k)


STEPPED_ELSEWHERE = ExpertWorkers(lambda method, *args: [], 0)
"""The workers as a data-parallel master other than master 0 sees them (`vela_ray.runtime.masters`):
master 0 reads their gradient norm and steps them, so here both are no-ops (a norm of 0 in the sum)."""


@dataclass
class MasterModel:
    """The master's side: the stripped model with brokers, peft-wrapped, and its optimizer."""

    peft_model: PeftModel
    dispatcher: ExpertDispatcher
    optimizer: torch.optim.Optimizer
    full_lora_config: object  # peft LoraConfig of the original model, for export
    grad_norm: float | None = None
    """The last first-order step's global gradient norm before clipping (backbone and experts, all masters):
    the trackers log it; it costs nothing, the clipping computes it anyway."""
    tp: TensorParallelPlan | None = None
    """This master's place in its tensor-parallel group (`cluster.master_tp`, `shard_master`), None without one."""
    tp_states: Callable[[bool], list[dict[str, torch.Tensor]]] | None = None
    """On the group's first rank: the other ranks' `shard_state`s (copied or not), in rank order, so that
    `master_state` gives the full tensors (set by the runtime that started the ranks)."""

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.peft_model.parameters() if p.requires_grad]


def master_device(wants_gpu: bool) -> torch.device:
    """Where a master keeps the backbone, its LoRA and optimizer state: its GPU with `cluster.master_gpus: 1`
    (Ray gives the actor one), else the CPU."""
    if not wants_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("cluster.master_gpus is 1 but the master's process sees no CUDA device; set "
                         "cluster.master_gpus: 0 or run it where Ray gives it a GPU")
    return torch.device("cuda", torch.cuda.current_device())


@dataclass(frozen=True)
class MasterSpec:
    """What every master replica is built from (`runtime.pool.master_spec` makes it from a job's config):
    the job's master, its data-parallel peers, the master actor and the expert-parallel baseline's ranks."""

    model_dir: Path
    dtype: torch.dtype
    lora: LoraSpec
    optim: OptimizerConfig
    seed: int = 0
    trust_remote_code: bool = False
    num_masters: int = 1
    row_format: RowFormat = "exact"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    activation_checkpointing: bool = False


def seeded_backbone(spec: MasterSpec, read: bool = True) -> nn.Module:
    """The model, read after seeding torch (reading draws nothing): the LoRA that `build_master` then draws is
    the same in every replica and in peft's reference, which seeds and builds in this order. Read into its skeleton
    by slice (`sharded_loading.read_backbone`: what `load_backbone` gives, without a second copy in host memory);
    without `read`, the unread skeleton (`loading.backbone_skeleton`), which a master rank fills
    (`shard_and_read`)."""
    from vela_ray.model.loading import backbone_skeleton
    from vela_ray.model.sharded_loading import load_record, read_backbone

    torch.manual_seed(spec.seed)
    if not read:
        return backbone_skeleton(spec.model_dir, spec.dtype, spec.trust_remote_code)
    with load_record("seeded_backbone") as record:
        record["model"] = model = backbone_skeleton(spec.model_dir, spec.dtype, spec.trust_remote_code)
        read_backbone(model, None, spec.model_dir, spec.dtype, spec.trust_remote_code)
    return model.eval()


def build_master_replica(spec: MasterSpec, expert_to_worker, transport: Transport, *, rank: int = 0,
                         model: nn.Module | None = None, latency=None, condenser=None) -> MasterModel:
    """Master `rank`'s replica on `spec.device`: `model` (read with `seeded_backbone` if None) with brokers
    over `transport` by `expert_to_worker` [L, E], wrapped with peft LoRA, and its optimizer."""
    model = seeded_backbone(spec) if model is None else model
    master = build_master(model, expert_to_worker, transport, spec.lora, spec.optim, master=rank,
                          num_masters=spec.num_masters, row_format=spec.row_format, latency=latency,
                          condenser=condenser, activation_checkpointing=spec.activation_checkpointing)
    master.peft_model.to(spec.device)  # after the brokers replaced the (unallocated) experts
    return master


def shard_master(master: MasterModel, group, config: TensorParallelConfig | None = None) -> TensorParallelPlan:
    """Make `master` (built whole, before any step) one rank of the tensor-parallel group `group`
    (`cluster.master_tp`): its backbone and LoRA sharded in place (`tensor_parallel.parallelize_backbone`), a
    fresh optimizer over the shards, and its brokers sending only this rank's share of each layer's rows. Every
    rank built the same seeded master, so the group starts from the single master's exact state."""
    from vela_ray.model.broker import ExpertBroker

    size = group.size()  # a DeviceMesh's or a ProcessGroup's
    tensor_parallel.refuse_grouped_experts([m.layout for m in master.peft_model.modules()
                                            if isinstance(m, ExpertBroker) and m.layout is not None], size)
    if config is None:
        config = TensorParallelConfig(shard_vocab=tensor_parallel.vocab_shardable(master.peft_model, size))
        if not config.shard_vocab:
            logger.info("embedding and LM head replicated over the %d TP ranks: tied, or a vocabulary not divisible "
                        "by %d", size, size)
    plan = tensor_parallel.parallelize_backbone(master.peft_model, group, config)
    if master.optimizer.state or len(master.optimizer.param_groups) != 1:
        raise RuntimeError("shard_master takes a master before its first step (one param group, no state)")
    master.optimizer.param_groups[0]["params"] = master.trainable_parameters()  # the shards are new Parameters
    master.dispatcher.share_rows(plan)
    master.tp = plan
    return plan


def build_master_rank(spec: MasterSpec, expert_to_worker, transport: Transport, mesh=None, *, rank: int = 0,
                      node=None) -> tuple[MasterModel, "ReadStats"]:
    """A master process's master (every rank of `actors.masters` but master 0, which `RayPeers` fills itself): the
    backbone's unread skeleton built into a master as `build_master_replica` builds one (same seed, so the same
    LoRA draws), then sharded over the TP `mesh` if any and filled, each tensor read once per `node` group
    (`shard_and_read`), and moved to `spec.device`. Returns it and what it read and received."""
    model = seeded_backbone(spec, read=False)
    master = build_master(model, expert_to_worker, transport, spec.lora, spec.optim, master=rank,
                          num_masters=spec.num_masters, row_format=spec.row_format,
                          activation_checkpointing=spec.activation_checkpointing)
    stats = shard_and_read(master, spec, mesh, node)
    master.peft_model.to(spec.device)
    return master, stats


def shard_and_read(master: MasterModel, spec: MasterSpec, mesh=None, node=None, holds_backbone: bool = False
                   ) -> "ReadStats":
    """Shard a master built on the unread skeleton (`seeded_backbone(read=False)`) over the TP `mesh` if any
    (`shard_master`) and fill it with its TP rank's shard of each backbone tensor from `spec.model_dir`, each read
    once per `node` group (the master processes of this node; None: alone) (`sharded_loading.read_backbone`).
    `holds_backbone`: this master read the whole backbone already (master 0 without TP) and sends it to its node
    group."""
    from vela_ray.model.sharded_loading import load_record, read_backbone

    with load_record("shard_and_read") as record:
        if mesh is not None:
            shard_master(master, mesh)
        stats = read_backbone(master.peft_model, master.tp, spec.model_dir, spec.dtype, spec.trust_remote_code,
                              node, holds_backbone)
        record.update(model=master.peft_model, bytes_received=stats.bytes_received, bytes_sent=stats.bytes_sent,
                      node_rank=node.rank() if node is not None else 0, tp_rank=master.tp.rank if master.tp else 0)
    logger.info("master rank (tp %d) read %.1f MB of the backbone, received %.1f MB, sent %.1f MB in %.2f s",
                master.tp.rank if master.tp else 0, stats.bytes_read / 1e6, stats.bytes_received / 1e6,
                stats.bytes_sent / 1e6, stats.seconds)
    return stats


def build_master(
    model: nn.Module, expert_to_worker, transport: Transport, lora: LoraSpec, optim: OptimizerConfig,
    *, master: int = 0, num_masters: int = 1, row_format: RowFormat = "exact", latency=None, condenser=None,
    activation_checkpointing: bool = False,
) -> MasterModel:
    """Strip `model`'s experts (brokers over `transport`) and wrap the rest with peft LoRA.

    `master` of `num_masters`: which data-parallel master this is (`vela_ray.runtime.masters`).
    `row_format`: how its rows travel (`vela_ray.model.wire`; LOSSY unless exact).
    `activation_checkpointing`: recompute decoder layers in backward, replaying the experts' outputs
    (`modeling.enable_activation_checkpointing`).

    Training needs no KV cache; without one, a batch with `position_ids` and no `attention_mask`
    (packed rows) gets transformers' per-example attention mask (it only looks when no cache is given)."""
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.use_cache = False
    full_cfg = full_lora_config(model, lora)
    dispatcher = ExpertDispatcher(torch.as_tensor(expert_to_worker), transport, master=master,
                                  num_masters=num_masters, row_format=row_format, latency=latency,
                                  condenser=condenser)
    attach_brokers(model, dispatcher)
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    peft_model = get_peft_model(model, backbone_lora_config(full_cfg))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    return MasterModel(peft_model, dispatcher, make_adamw(params, optim), full_cfg)


def build_local(
    model: nn.Module, expert_to_worker, lora: LoraSpec, optim: OptimizerConfig, seed: int = 0
) -> tuple[MasterModel, ExpertWorkers]:
    """Single-process vela-ray: ExpertManagers built from `model`'s own experts, in-process transport."""
    table = torch.as_tensor(expert_to_worker, dtype=torch.long)
    blocks = find_moe_blocks(model)
    weights = expert_weights(blocks)
    lora = resolve_expert_lora(model, lora)  # each stack's rank/alpha, by peft's rule over module paths
    managers = [
        ExpertManager(ExpertManagerSpec(
            worker=worker, keys=[k for k in weights if table[k] == worker],
            weights={k: w for k, w in weights.items() if table[k] == worker},
            hf_config=model.config, lora=lora, optim=optim, seed=seed))
        for worker in range(int(table.max()) + 1)
    ]
    master = build_master(model, table, InProcessTransport(managers), lora, optim)
    return master, ExpertWorkers.in_process(managers)


LossFn = Callable[[nn.Module, Batch], torch.Tensor]
"""(peft model, micro-batch) -> this replica's share of the micro-batch's mean loss."""


def model_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The model's own loss of the whole micro-batch: what a lone master trains on."""
    return model(**batch).loss


def step_seed(seed: int, step: int) -> int:
    """The torch seed of training step `step` of a run seeded `seed` (`training.seed`): a step's random draws
    (LoRA dropout's masks) depend on (seed, step) alone, so a resumed run and peft's reference
    (`equivalence.peft_losses`) draw the same. `hash` of a tuple of ints does not depend on PYTHONHASHSEED."""
    return hash((seed, step)) % (2**31)


def train_step(
    master: MasterModel, workers: ExpertWorkers, micro_batches: Sequence[Batch], lr: float,
    max_grad_norm: float | None, *, loss_fn: LossFn = model_loss, replicas: Replicas = SINGLE,
) -> float:
    """Forward/backward all micro-batches, clip globally, step master and workers. Returns mean loss.

    With data-parallel `replicas` (e.g. expert-parallel ranks) every replica calls this at once,
    `loss_fn` gives its share of each micro-batch, and `workers` are its own experts (disjoint
    from the other replicas'): the backbone gradients and the scalars are summed over replicas,
    so all of them clip with the global norm and return the loss of the whole batch.
    """
    model = master.peft_model
    model.train()
    if master.tp is not None and master.tp.draws_dropout:
        tensor_parallel.agree_on_rng(master.tp)  # the group's ranks draw the dropout masks one master would
    total_loss = 0.0
    for batch in micro_batches:
        loss = loss_fn(model, batch) / len(micro_batches)
        loss.backward()
        total_loss += float(loss.detach())
    params = master.trainable_parameters()
    replicas.sync_grads(params)
    if master.tp is None:
        total_sq = grad_sq_norm(params) + replicas.sum(workers.grad_sq_norm())
    else:  # the group's backward has ended (a barrier) before its first rank reads the workers' norm
        own_sq = tensor_parallel.grad_sq_norm(model, master.tp)
        total_sq = own_sq + tensor_parallel.all_sum(replicas.sum(workers.grad_sq_norm()), master.tp)
    master.grad_norm = total_sq ** 0.5
    clip_coef = clip_coefficient(total_sq, max_grad_norm)
    apply_step(master.optimizer, lr, clip_coef)
    workers.step(lr, clip_coef)
    return replicas.sum(total_loss)


@torch.no_grad()
def eval_loss(master: MasterModel, batches: Sequence[Batch], *, loss_fn: LossFn = model_loss,
              replicas: Replicas = SINGLE) -> float:
    """Mean over `batches` of each batch's loss (summed over `replicas`' shares, as in `train_step`)."""
    model = master.peft_model
    model.eval()
    local = sum(float(loss_fn(model, b)) for b in batches)
    return replicas.sum(local) / max(1, len(batches))


def export(master: MasterModel, workers: ExpertWorkers, out_dir) -> None:
    """Write the standard peft adapter of the original model (see vela_ray.model.adapters); a tensor-parallel
    master's LoRA gathered whole."""
    full = None
    if master.tp is not None:
        names = {n for n, p in master.peft_model.named_parameters() if p.requires_grad}
        full = {k: v for k, v in master_state(master).items() if k in names}
    export_adapter(out_dir, master.peft_model.base_model.model.config, master.full_lora_config,
                   backbone_state_of(master.peft_model, full), workers.lora_state())


def import_adapter(master: MasterModel, workers: "ExpertWorkers", adapter_dir) -> dict[str, torch.Tensor]:
    """Load a peft adapter directory of the original model into master and workers (any placement). Returns the
    master's state after it (`master_state`: full tensors), for the other masters or ranks to load."""
    from vela_ray.model.adapters import check_adapter_matches, read_adapter

    config = master.peft_model.base_model.model.config
    lora_config, backbone_state, expert_state = read_adapter(adapter_dir, config)
    check_adapter_matches(lora_config, master.full_lora_config, adapter_dir)
    state = _with_backbone_adapter(master, backbone_state, adapter_dir)
    load_master_state(master, state)
    workers.load_lora_state(expert_state)
    return state


def _with_backbone_adapter(master: MasterModel, state: dict[str, torch.Tensor], adapter_dir) -> dict[str, torch.Tensor]:
    """The master's state (`master_state`) with a saved adapter's backbone factors in place of its LoRA parameters,
    by name.

    Not `peft.set_peft_model_state_dict`: peft 0.21 applies transformers' checkpoint renames to
    adapter keys at load time, and some rules are regexes that also match adapted names (laguna's
    "mlp.shared_expert." hits "mlp.shared_experts.", giving "shared_experts..down_proj"; inkling2's
    rename hits "k_sconv.weight_proj"), so the keys it loads no longer exist. The backbone adapts
    only plain nn.Linear layers, whose saved key "<module>.lora_A.weight" is parameter
    "<module>.lora_A.<adapter>.weight": no conversion is needed.
    """
    adapter = master.peft_model.active_adapter
    names = [n for n, p in master.peft_model.named_parameters() if p.requires_grad]
    by_key = {re.sub(rf"\.(lora_[AB])\.{adapter}\.weight$", r".\1.weight", n): n for n in names}
    # modules_to_save (the router trained in full): peft saves "<module>.<name>" of its trained copy, buffers too
    # (DeepSeek's e_score_correction_bias)
    buffers = {n: b for n, b in master.peft_model.named_buffers() if f".modules_to_save.{adapter}." in n}
    saved = {**by_key, **{n: n for n in buffers}}
    by_key = {re.sub(rf"\.modules_to_save\.{adapter}\.", ".", k): n for k, n in saved.items()}
    unknown = sorted(set(state) - set(by_key))
    if unknown:
        raise ValueError(f"{adapter_dir}: adapter keys not in this model: {unknown[:5]}")
    missing = sorted(set(by_key) - set(state))
    if missing:
        raise ValueError(f"{adapter_dir}: adapter lacks {missing[:3]} ({len(missing)} in all) of this model's "
                         "backbone LoRA layers")
    full = master_state(master)
    with torch.no_grad():
        for key, value in state.items():
            name = by_key[key]
            if name in buffers:  # not trained, so not in the state: copied in place (never sharded)
                buffers[name].copy_(value)
            else:
                full[name] = value.to(full[name].dtype).clone()
    return full


def master_state(master: MasterModel, copy: bool = False) -> dict[str, torch.Tensor]:
    """Backbone LoRA values and AdamW state by parameter name, for checkpoints. `copy`: always fresh host
    tensors (on the CPU the others share the live ones): a snapshot the next step cannot change.
    A tensor-parallel master's are the full tensors, merged from its group's shards (what a single master
    holds), so a checkpoint resumes at any `cluster.master_tp`."""
    local = shard_state(master, copy)
    if master.tp is None or master.tp.size == 1:
        return local
    if master.tp_states is None:
        raise RuntimeError("master_state of a tensor-parallel rank is its group's first rank's to take")
    return tensor_parallel.merge_shards([local, *master.tp_states(copy)], master.tp)


def shard_state(master: MasterModel, copy: bool = False) -> dict[str, torch.Tensor]:
    """`master_state` of this process's parameters only: a tensor-parallel rank's shards."""
    tensors = {}
    for name, param in master.peft_model.named_parameters():
        if not param.requires_grad:
            continue
        tensors[name] = param.detach().to("cpu", copy=copy)
        for slot, value in master.optimizer.state.get(param, {}).items():
            tensors[f"{name}.{slot}"] = torch.as_tensor(value).detach().to("cpu", copy=copy)
    return tensors


def load_master_state(master: MasterModel, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `master_state` (a tensor-parallel rank takes its share); ValueError if the checkpoint lacks a
    trainable parameter."""
    params = {n: p for n, p in master.peft_model.named_parameters() if p.requires_grad}
    if master.tp is not None and set(params) <= set(tensors):
        tensors = tensor_parallel.shard_of(tensors, master.tp)
    missing = [n for n in params if n not in tensors]
    if missing:
        raise ValueError(f"checkpoint lacks backbone adapter tensors {missing[:4]} ({len(missing)} in all): "
                         "it was written for another model or LoRA target set")
    with torch.no_grad():
        for name, param in params.items():
            if tensors[name].shape != param.shape:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensors[name].shape)}, "
                                 f"this job's is {tuple(param.shape)} (different LoRA rank?)")
            param.copy_(tensors[name])
            slots = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
            if slots:
                master.optimizer.state[param] = {k: v.clone() if k == "step" else v.to(param.device).clone()
                                                 for k, v in slots.items()}
