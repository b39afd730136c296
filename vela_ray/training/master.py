"""A master: the stripped model with brokers, peft-wrapped, and its optimizer (`MasterModel`), what every master
rank is built from (`MasterSpec`), the one path that builds every rank (`build_master_rank`: skeleton -> brokers ->
peft (`build_master`), then `shard_master` and `shard_and_read` for a tensor-parallel rank), and its LoRA + AdamW
state as tensors.

`build_local` splits an in-memory model into a master-side peft model with brokers and in-process ExpertManagers:
the single-process form of vela-ray.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from peft import PeftModel, get_peft_model
from torch import nn

from vela_ray.model.adapters import (
    backbone_lora_config, full_lora_config, resolve_expert_lora,
)
from vela_ray.model.broker import ExpertDispatcher
from vela_ray.model.experts import LoraSpec
from vela_ray.model.modeling import attach_brokers, enable_activation_checkpointing, expert_weights, find_moe_blocks
from vela_ray.model import tensor_parallel
from vela_ray.model.quantized_model import QuantizationSpec, quantize_as_read, quantize_backbone
from vela_ray.model.streaming import BackboneStream, StreamSettings, stream_backbone
from vela_ray.model.tensor_parallel import TensorParallelConfig, TensorParallelPlan
from vela_ray.training.expert_manager import ExpertManager, ExpertManagerSpec
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.optim import make_adamw
from vela_ray.training.pipeline import PipelineStage, keep_stage
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.model.transport import InProcessTransport, Transport
from vela_ray.model.traffic import RowFormat

if TYPE_CHECKING:
    from vela_ray.model.sharded_loading import ReadStats

logger = logging.getLogger(__name__)
_BUILDING = threading.Lock()




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
    stream: BackboneStream | None = None
    """The decoder layers' frozen weights streamed from host memory (`masters.streaming`), None when resident."""
    stage: PipelineStage | None = None
    """This master's stage of the pipeline (`masters.pipeline_stages`, `training.pipeline`), None without one."""
    stage_states: Callable[..., list[dict[str, torch.Tensor]]] | None = None
    """On stage 0: the other stages' `shard_state`s (copied or not), so that `master_state` holds every layer's, or
    with `adapter=True` their peft adapter states (`adapters.backbone_state_of`) for export (set by the runtime that
    started the stages)."""

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.peft_model.parameters() if p.requires_grad]

    def keep_stage(self, index: int, count: int, group, blocks) -> PipelineStage:
        """Make this master (built whole, before any step) stage `index` of `count` of a pipeline over `group`
        (`pipeline.keep_stage`), its optimizer over the parameters of its own layers."""
        if self.optimizer.state or len(self.optimizer.param_groups) != 1:
            raise RuntimeError("keep_stage takes a master before its first step (one param group, no state)")
        self.stage = keep_stage(self.peft_model, index, count, group, blocks)
        self.optimizer.param_groups[0]["params"] = self.trainable_parameters()
        return self.stage


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
    """What every master replica is built from (`runtime.masters.master_spec` makes it from a job's config):
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
    overlap_shared_experts: bool = True  # `training.overlap.shared_experts`, where the job allows it
    quantization: QuantizationSpec | None = None  # `model.quantization`: the backbone's frozen linears held quantized
    streaming: StreamSettings | None = None  # `masters.streaming`: the backbone streamed from host memory, or resident
    pipeline_stages: int = 1  # `masters.pipeline_stages`: each master rank holds one stage's decoder layers


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
        # a lone master holds its quantized layers so as it reads them; with peers on its node, master 0 sends them
        # the full-width backbone first (`shard_and_read(holds_backbone=True)` quantizes as it sends)
        alone = spec.num_masters == 1 and spec.quantization is not None and spec.quantization.backbone
        record["staged_bytes"] = read_backbone(model, None, spec.model_dir, spec.dtype, spec.trust_remote_code,
                                               filled=quantize_as_read(model, spec.quantization) if alone else None
                                               ).staged_bytes
    return model.eval()


def build_master_replica(spec: MasterSpec, expert_to_worker, transport: Transport, *, rank: int = 0,
                         model: nn.Module | None = None, latency=None, condenser=None) -> MasterModel:
    """A whole master (no TP, no node group) on `spec.device`: `model` (read with `seeded_backbone` if None) built by
    `build_master_rank` (the expert-parallel baseline's ranks, tests)."""
    model = seeded_backbone(spec) if model is None else model
    return build_master_rank(spec, expert_to_worker, transport, rank=rank, model=model, read=True, latency=latency,
                             condenser=condenser)[0]


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
                      node=None, dp_mesh=None, model: nn.Module | None = None, read: bool = False, latency=None,
                      condenser=None, stage: tuple[int, object] | None = None
                      ) -> tuple[MasterModel, "ReadStats | None"]:
    """Every master rank, master 0 included (`runtime.masters`), built one way: `model` (None: the backbone's
    unread skeleton, `seeded_backbone(read=False)`; `read`: it holds the whole backbone already) with brokers over
    `transport` by `expert_to_worker` [L, E] and peft LoRA (same seed, so the same LoRA draws as one master's), then
    sharded over the TP `mesh` if any and filled, each tensor read once per `node` group (`shard_and_read`), moved to
    `spec.device`, and its frozen backbone sharded over the data-parallel `dp_mesh` with FSDP2 if given, or streamed
    from host memory (`spec.streaming`, `vela_ray.model.streaming`). `stage`: (its index, the stages' group) with
    `spec.pipeline_stages` above 1: it keeps that stage's layers before anything is read (`MasterModel.keep_stage`).
    Returns it and what it read, received and sent (None: it read nothing here)."""
    # the build seeds the process's RNG and draws from it: ranks hosted as threads take turns, and one building its
    # own skeleton leaves the RNG as it found it, so master 0's draws (on the backbone the runner seeded and read) are
    # one master's whenever its turn comes
    own_seed = torch.random.fork_rng(devices=[]) if model is None else contextlib.nullcontext()
    with _BUILDING, own_seed:
        model = seeded_backbone(spec, read=False) if model is None else model
        blocks = find_moe_blocks(model) if stage is not None else []
        master = build_master(model, expert_to_worker, transport, spec.lora, spec.optim, master=rank,
                              num_masters=spec.num_masters, row_format=spec.row_format, latency=latency,
                              condenser=condenser, activation_checkpointing=spec.activation_checkpointing,
                              overlap_shared_experts=spec.overlap_shared_experts)
    if stage is not None:
        master.keep_stage(stage[0], spec.pipeline_stages, stage[1], blocks)
    stats = None
    if mesh is not None or node is not None or not read:
        stats = shard_and_read(master, spec, mesh, node, holds_backbone=read)
    if spec.quantization is not None and spec.quantization.backbone:  # held so as read; any other layer now
        quantize_backbone(master.peft_model, spec.quantization)
    if spec.streaming is not None:  # the layers' frozen weights stay in host memory, the rest goes
        streaming = spec.streaming
        master.stream = stream_backbone(master.peft_model, streaming.buffer_blocks, spec.device,
                                        streaming.upload_format, streaming.activation_budget, streaming.prefetch)
    else:
        master.peft_model.to(spec.device)
    if dp_mesh is not None:
        tensor_parallel.shard_frozen(master.peft_model, dp_mesh)
    return master, stats


def shard_and_read(master: MasterModel, spec: MasterSpec, mesh=None, node=None, holds_backbone: bool = False
                   ) -> "ReadStats":
    """Shard a master built on the unread skeleton (`seeded_backbone(read=False)`) over the TP `mesh` if any
    (`shard_master`) and fill it with its TP rank's shard of each backbone tensor from `spec.model_dir`, each read
    once per `node` group (the master processes of this node; None: alone) (`sharded_loading.read_backbone`).
    `holds_backbone`: this master read the whole backbone already (master 0 without TP) and sends it to its node
    group."""
    from vela_ray.model.sharded_loading import LOAD_RECORD_ENV, load_record, model_tensors, read_backbone

    with load_record("shard_and_read") as record:
        if os.environ.get(LOAD_RECORD_ENV):  # what the model held before (its LoRA, its unread skeleton)
            record.update(tensors_at_start=model_tensors(master.peft_model), filled=not holds_backbone)
        if mesh is not None:
            shard_master(master, mesh)
        quantized = spec.quantization is not None and spec.quantization.backbone
        stats = read_backbone(master.peft_model, master.tp, spec.model_dir, spec.dtype, spec.trust_remote_code,
                              node, holds_backbone,
                              filled=quantize_as_read(master.peft_model, spec.quantization) if quantized else None)
        record.update(model=master.peft_model, bytes_received=stats.bytes_received, bytes_sent=stats.bytes_sent,
                      staged_bytes=stats.staged_bytes,
                      node_rank=node.rank() if node is not None else 0, tp_rank=master.tp.rank if master.tp else 0)
    logger.info("master rank (tp %d) read %.1f MB of the backbone, received %.1f MB, sent %.1f MB in %.2f s",
                master.tp.rank if master.tp else 0, stats.bytes_read / 1e6, stats.bytes_received / 1e6,
                stats.bytes_sent / 1e6, stats.seconds)
    return stats


def build_master(
    model: nn.Module, expert_to_worker, transport: Transport, lora: LoraSpec, optim: OptimizerConfig,
    *, master: int = 0, num_masters: int = 1, row_format: RowFormat = "exact", latency=None, condenser=None,
    activation_checkpointing: bool = False, overlap_shared_experts: bool = True,
) -> MasterModel:
    """Strip `model`'s experts (brokers over `transport`) and wrap the rest with peft LoRA.

    `master` of `num_masters`: which data-parallel master this is (`vela_ray.runtime.masters`).
    `row_format`: how its rows travel (`vela_ray.model.wire`; LOSSY unless exact).
    `activation_checkpointing`: recompute decoder layers in backward, replaying the experts' outputs
    (`modeling.enable_activation_checkpointing`).
    `overlap_shared_experts`: compute each block's shared expert while its rows are away
    (`model.shared_expert`, `training.overlap.shared_experts`).

    Training needs no KV cache; without one, a batch with `position_ids` and no `attention_mask`
    (packed rows) gets transformers' per-example attention mask (it only looks when no cache is given)."""
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.use_cache = False
    full_cfg = full_lora_config(model, lora)
    dispatcher = ExpertDispatcher(torch.as_tensor(expert_to_worker), transport, master=master,
                                  num_masters=num_masters, row_format=row_format, latency=latency,
                                  condenser=condenser)
    attach_brokers(model, dispatcher, shared_experts=overlap_shared_experts)
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


def master_state(master: MasterModel, copy: bool = False) -> dict[str, torch.Tensor]:
    """Backbone LoRA values and AdamW state by parameter name, for checkpoints. `copy`: always fresh host
    tensors (on the CPU the others share the live ones): a snapshot the next step cannot change.
    A tensor-parallel master's are the full tensors, merged from its group's shards (what a single master
    holds), so a checkpoint resumes at any `cluster.master_tp`."""
    local = shard_state(master, copy)
    if master.stage is not None and master.stage.count > 1:
        if master.stage_states is None:
            raise RuntimeError("master_state of a pipeline stage is stage 0's to take")
        return {k: v for state in (local, *master.stage_states(copy)) for k, v in state.items()}
    if master.tp is None or master.tp.size == 1:
        return local
    if master.tp_states is None:
        raise RuntimeError("master_state of a tensor-parallel rank is its group's first rank's to take")
    return tensor_parallel.merge_shards([local, *master.tp_states(copy)], master.tp)


def parameters_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters of a `master_state`, its optimizer's slots ("<parameter>.<slot>") left out: every stage's of
    a pipeline, which stage 0's model does not hold."""
    return {k: v for k, v in state.items() if k.rsplit(".", 1)[0] not in state}


def shard_state(master: MasterModel, copy: bool = False) -> dict[str, torch.Tensor]:
    """`master_state` of this process's parameters only: a tensor-parallel rank's shards, a pipeline stage's
    layers."""
    tensors = {}
    for name, param in master.peft_model.named_parameters():
        if not param.requires_grad:
            continue
        tensors[name] = param.detach().to("cpu", copy=copy)
        for slot, value in master.optimizer.state.get(param, {}).items():
            tensors[f"{name}.{slot}"] = torch.as_tensor(value).detach().to("cpu", copy=copy)
    return tensors


def load_master_state(master: MasterModel, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `master_state` (a tensor-parallel rank takes its share, a pipeline stage its layers'); ValueError
    if the checkpoint lacks a trainable parameter."""
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
