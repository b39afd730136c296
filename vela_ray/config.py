"""The job config: one pydantic model per component, read from YAML, checked before any actor starts.

    job = JobConfig.from_yaml("job.yaml")     # field errors name the field and the fix
    checked = job.preflight()                 # the files: weights, data, placement, resume, output dir
    checked.config                            # the job to run, its resume pinned to one checkpoint

One section per concern: `cluster` (the resources), `data_plane`, `fault_tolerance`, `masters`,
`expert_tiers`, `placement`, `training`, ... A key that moved between sections (`MOVED`) is read
from its old place, with a one-line warning, until the next release.

Importing this module loads neither torch, transformers nor ray, so a typo
costs well under a second; `preflight` (`vela_ray.preflight`) runs in the
driver in a second or two, so a bad file never costs a cluster start-up.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import time
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from vela_ray.data.config import DataConfig
from vela_ray.errors import first_line
from vela_ray.paths import StoragePath, UserPath
from vela_ray.model.traffic import RowFormat
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.training.tiers import ExpertTiersConfig

if TYPE_CHECKING:
    from vela_ray.preflight import Preflight

logger = logging.getLogger(__name__)

Solver = Literal["improved", "vela", "sequential", "random", "file"]
TransportName = Literal["object_ref", "collective"]


@dataclass(frozen=True)
class Refusal:
    """A combination of settings a feature cannot run (yet), declared by that feature's own section in its
    `refusals`; `JobConfig._features_combine` checks every section's before any work, and README's "What does not
    combine" lists them all with the reason. `applies` says whether a job has the combination."""

    settings: str  # the combination as a user writes it
    why: str
    fix: str
    applies: Callable[["JobConfig"], bool]

    def message(self) -> str:
        return f"{self.settings} do not combine: {self.why}. Fix: {self.fix}"


@dataclass(frozen=True)
class RunsSerially:
    """A setting with which a feature that runs work concurrently must run it one piece at a time, declared by that
    feature's own section in its `serial_with`: the job runs, serially, and says why in one log line (the numbers
    are the same either way, so this is no refusal)."""

    settings: str
    why: str
    applies: Callable[["JobConfig"], bool]


def first_serial(serials: tuple[RunsSerially, ...], job: "JobConfig") -> RunsSerially | None:
    """The first of a feature's `serials` that `job` has (its work then runs one piece at a time), or None."""
    return next((serial for serial in serials if serial.applies(job)), None)


def one_name_as_a_list(value: object) -> object:
    """A list setting given one name (`report_to: wandb`, `loss_type: ipo`), as Hugging Face's and TRL's configs take
    it: that name, listed."""
    return [value] if isinstance(value, str) else value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    refusals: ClassVar[tuple[Refusal, ...]] = ()  # what this feature cannot combine with (`Refusal`)


class QuantizationSection(_Section):
    """`model.quantization`: frozen weights held quantized where they live (the experts on the ExpertManagers, the
    backbone's linear layers on the master), dequantized at each use (`vela_ray.model.quantization`); LoRA, its
    gradients and AdamW stay fp32. LOSSY against the full-width model (the quantization), exact against peft on
    the dequantized one."""

    refusals = (
        Refusal("model.quantization.backbone and cluster.master_tp above 1 or masters.shard_frozen_backbone",
                "tensor parallelism and FSDP2 shard nn.Linear weights, where a quantized layer's weight is its "
                "format's blocks", "set model.quantization.backbone: false, or master_tp: 1 and "
                "shard_frozen_backbone: false",
                lambda job: job.model.quantization.on and job.model.quantization.backbone
                and (job.cluster.master_tp > 1 or job.masters.shard_frozen_backbone)),
    )

    format: Literal["none", "fp8", "int8", "nf4", "mxfp4"] = Field(
        "none", description="storage format of the frozen weights: fp8 (e4m3, a scale per 128x128 block: "
                            "DeepSeek-V3's), int8 (a scale per output channel), nf4 (QLoRA's, a scale per 64 inputs), "
                            "mxfp4 (gpt-oss's, an e8m0 scale per 32 inputs); none: the checkpoint's own width")
    experts: bool = Field(True, description="hold the experts' weight stacks quantized on the ExpertManagers")
    backbone: bool = Field(True, description="hold the backbone's frozen linear layers quantized on the master "
                                             "(not lm_head, not lora.modules_to_save); a layer no whole number of "
                                             "blocks covers stays full width")

    @property
    def on(self) -> bool:
        return self.format != "none" and (self.experts or self.backbone)


class ModelSection(_Section):
    path: UserPath = Field(description="Hugging Face checkpoint directory (config.json + safetensors)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="compute dtype of backbone and experts")
    trust_remote_code: bool = Field(
        False, description="run the model's own code (config.json's auto_map) in every process that reads it; "
                           "preflight then checks its math against peft on a debug-size copy")
    quantization: QuantizationSection = Field(
        default_factory=QuantizationSection, description="frozen weights in FP8, int8, NF4 or MXFP4 (LOSSY)")


class LoraSection(_Section):
    refusals = (
        Refusal("lora.lora_dropout above 0 and adapted expert stacks (lora.expert_stacks other than [])",
                "peft's ParamWrapper cannot apply dropout to expert weights, so peft itself refuses it",
                "set lora.expert_stacks: [] or lora.lora_dropout: 0",
                lambda job: bool(job.lora.lora_dropout) and job.lora.expert_stacks != []),
    )

    """LoRA in peft's names (`peft.LoraConfig`), passed to peft on the master; the ExpertManagers implement the
    same options for the expert weight stacks. Checked against the model before Ray starts (preflight)."""

    r: int = Field(8, ge=1, description="LoRA rank (the paper: 8)")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (the paper: 16)")
    init_adapter: UserPath | None = Field(None, description="start from this peft adapter dir (same model and rank)")
    target_modules: list[str] | str | None = Field(
        None, description="backbone modules to adapt, as peft takes them: names (a module whose path ends with "
                          "one), a regex over full paths, or 'all-linear'; [] adapts no backbone module (experts "
                          "only). None: every linear layer but lm_head and the routers (the paper)")
    exclude_modules: list[str] | str | None = Field(None, description="peft's: modules never adapted (names or regex)")
    expert_stacks: list[str] | Literal["all"] = Field(
        "all", description="the experts' weight stacks to adapt ('all', or names such as [gate_up_proj, "
                           "down_proj]); [] leaves the experts frozen (attention only)")
    lora_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="peft's dropout on a LoRA input, in [0, 1); backbone modules only: peft "
                                         "cannot apply it to expert stacks, so it needs expert_stacks: []")
    rank_pattern: dict[str, int] = Field(
        default_factory=dict, description="peft's: {key: rank} for modules or expert stacks whose path ends with "
                                          "key (a regex), e.g. {'experts\\.\\w+': 4}")
    alpha_pattern: dict[str, float] = Field(default_factory=dict, description="peft's: {key: alpha}, as rank_pattern")
    use_rslora: bool = Field(False, description="rank-stabilised scaling alpha / sqrt(r) instead of alpha / r")
    init_lora_weights: Literal[True, "gaussian"] = Field(
        True, description="peft's init of A (B starts at 0): true = kaiming-uniform, 'gaussian' = N(0, 1/r)")
    modules_to_save: list[str] = Field(
        default_factory=list, description="peft's: modules trained in full, e.g. [gate] for the router (the "
                                          "paper keeps it frozen)")

    @model_validator(mode="after")
    def _adapter_exists(self) -> "LoraSection":
        if self.init_adapter is not None and not (self.init_adapter / "adapter_config.json").is_file():
            raise ValueError(f"lora.init_adapter {self.init_adapter} is not a peft adapter directory "
                             "(no adapter_config.json)")
        bad = {k: v for k, v in self.rank_pattern.items() if v < 1} | {
            k: v for k, v in self.alpha_pattern.items() if v <= 0}
        if bad:
            raise ValueError(f"lora.rank_pattern/alpha_pattern {bad}: ranks must be >= 1 and alphas > 0")
        for field, patterns in (("rank_pattern", self.rank_pattern), ("alpha_pattern", self.alpha_pattern)):
            for key in patterns:
                try:
                    re.compile(key)  # peft matches each key as a regular expression against module names
                except re.error as err:
                    raise ValueError(f"lora.{field} key {key!r} is not a regular expression ({err}); peft matches "
                                     "these keys as regexes against module names: escape it, e.g. "
                                     f"{re.escape(key)!r}") from None
        return self

    def spec(self):
        """`vela_ray.model.experts.LoraSpec` of these options (rank/alpha patterns not yet resolved against the
        model: `vela_ray.model.adapters.resolve_expert_lora`)."""
        from vela_ray.model.experts import LoraSpec

        def names(value):
            return value if value is None or isinstance(value, str) else tuple(value)

        return LoraSpec(
            r=self.r, alpha=self.alpha, use_rslora=self.use_rslora, init_lora_weights=self.init_lora_weights,
            lora_dropout=self.lora_dropout, target_modules=names(self.target_modules),
            exclude_modules=names(self.exclude_modules),
            expert_stacks=None if self.expert_stacks == "all" else tuple(self.expert_stacks),
            rank_pattern=tuple(self.rank_pattern.items()), alpha_pattern=tuple(self.alpha_pattern.items()),
            modules_to_save=tuple(self.modules_to_save))


class ClusterSection(_Section):
    """The resources: where Ray runs, how many ExpertManagers, and what each process gets."""

    address: str | None = Field(None, description="Ray address; None: RAY_ADDRESS if set, else a fresh local Ray")
    num_workers: int = Field(3, ge=1, description="ExpertManager actors (one per GPU on GPU clusters)")
    num_gpus_per_worker: Literal[0, 1] = Field(0, description="1 pins each ExpertManager to a GPU")
    num_cpus_per_worker: float = Field(0.5, gt=0, description="CPU share per ExpertManager on CPU clusters")
    master_gpus: Literal[0, 1] | None = Field(
        None, description="GPUs of the master, which holds the backbone, its LoRA and optimizer state; None: 1 "
                          "when the Ray cluster has a GPU beyond the workers', else 0")
    workers_per_node: int | None = Field(None, ge=1, description="workers per node, filled from the master's node")
    master_threads: int | None = Field(
        None, ge=1, description="torch threads of the master's CPU work; None: Ray's default (1). More threads "
                                "speed up the backbone but their idle spinning slows workers that share the cores")
    master_tp: int = Field(
        1, ge=1, description="the master's tensor-parallel degree: its backbone sharded over this many processes (GPUs "
                             "of the master's node with master_gpus: 1), attention by heads and dense MLPs by "
                             "columns with LoRA split as the TP-LoRA thesis does, each rank sending its share of every "
                             "MoE layer's rows (exact: losses equal one master's)")
    workers_on_master: int = Field(
        0, ge=0, description="the last K of the num_workers ExpertManagers live in the master's own process, on its "
                             "device (its GPU with master_gpus: 1): rows to them move by direct call (the "
                             "same_process link tier, the fastest the placement sees) while the other workers' "
                             "rows travel. K = num_workers: the one-GPU configuration, no worker actors")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict) and "experts_on_master" in data:
            raise ValueError("cluster.experts_on_master is now cluster.workers_on_master: the number of "
                             "ExpertManagers in the master's process (num_workers for all of them)")
        return data

    @model_validator(mode="after")
    def _workers_on_master_fit(self) -> "ClusterSection":
        k = self.workers_on_master
        if k > self.num_workers:
            raise ValueError(f"cluster.workers_on_master ({k}) cannot exceed cluster.num_workers "
                             f"({self.num_workers})")
        if k == self.num_workers and self.num_gpus_per_worker:
            raise ValueError("cluster.workers_on_master = num_workers puts every ExpertManager on the master's "
                             "device, so cluster.num_gpus_per_worker must be 0 (give the master its GPU with "
                             "master_gpus: 1)")
        return self

    @property
    def num_worker_actors(self) -> int:
        """ExpertManagers that run as Ray actors (the rest live in the master's process)."""
        return self.num_workers - self.workers_on_master


class DataPlaneSection(_Section):
    """How rows, expert results and their gradients travel between the masters and the ExpertManagers."""

    transport: TransportName = Field(
        "collective", description="how rows travel. collective: torch.distributed point-to-point to each "
                                  "ExpertManager's serving loop, NCCL between GPUs and gloo through host memory "
                                  "otherwise, no Ray task per layer (the faster: benchmarks/data_plane.py). "
                                  "object_ref: Ray tasks and objects, for clusters whose nodes reach each other "
                                  "only on Ray's ports, and the one that answers rows to another master (sequence "
                                  "migration's new-master combine). Every master process (masters.count x "
                                  "cluster.master_tp) forms collective planes of its own with the workers.")
    inline_bytes: int = Field(
        4 * 2**20, ge=0, description="tensors up to this size travel inside Ray's task RPCs, not through the "
                                     "object store (Ray's max_direct_call_object_size for vela's actors; 0: Ray's "
                                     "default, 100 KiB). Saves the object store's round trips on small layers")
    row_format: RowFormat = Field(
        "exact", description="how rows, expert results and their gradients travel between master and workers: "
                             "exact, or LOSSY bfloat16 (half of fp32's bytes) or float8 (e4m3 with a scale per row, "
                             "about a quarter); computed in model.dtype on both sides (ZO-Offloading §5.4)")
    zero_copy_tensors: bool = Field(
        True, description="Ray pickles tensors without copying them (RAY_ENABLE_ZERO_COPY_TORCH_TENSORS in "
                          "vela's actors); the data plane only reads the tensors it receives")


class FaultToleranceSection(_Section):
    """What the run does when an ExpertManager dies."""

    on_worker_loss: Literal["stop", "recover"] = Field(
        "stop", description="stop: end the run naming the checkpoint to resume from; recover: start a new "
                            "ExpertManager in its place, roll every worker and the master back to the last "
                            "checkpoint (one is written at the start), replay the steps since and go on")
    max_recoveries: int = Field(3, ge=1, description="in-place recoveries per run before stopping as with `stop`")


class StreamingSection(_Section):
    """`masters.streaming`: the master's frozen backbone streamed block by block from host memory through a reusable
    device buffer (ZO-Offloading, `vela_ray.model.streaming`). Every decoder layer's frozen weights live in host
    memory (pinned on a GPU master) and are uploaded into one of `buffer_blocks` device slots just before the layer
    runs, the next layers' uploads overlapping its compute on a side stream; LoRA, the embedding and the LM head stay
    on the device. The device then holds `buffer_blocks` layers' frozen weights instead of all of them, for a backbone
    larger than its memory. Exact: the uploads copy bytes, so the losses and adapter are the unstreamed run's bit for
    bit. First-order training too: the forward's graph keeps no slot tensor, and the backward uploads each layer's
    block again, the layers below it prefetched. A quantized backbone (`model.quantization`) streams its quantized
    blocks. Not with activation checkpointing, a tensor-parallel master or FSDP2's sharded backbone (one line each,
    before anything starts). Micro-batches in flight (`training.overlap`) pass the buffer in step, GPipe's schedule: a
    block is uploaded once per wave of them instead of once each. `upload_format` moves the layers
    in fewer bits (LOSSY). The layers' frozen weights never reach the device whole: the master is built in host
    memory and only the rest is moved."""

    buffer_blocks: int | None = Field(
        None, ge=2, description="decoder layers the device buffer holds at once: one computing while the next "
                                "upload, so at least 2 (more hide slower uploads behind more compute). None: off, "
                                "the whole backbone resident on the master's device")
    upload_format: RowFormat = Field(
        "exact", description="how a layer's frozen weights travel from host memory to its slot: exact, or LOSSY "
                             "bfloat16 / float8 (e4m3, a scale per row; ZO-Offloading §5.4): the host keeps that form "
                             "beside the exact one, an upload copies half or about a quarter of the bytes and the "
                             "slot decodes them, so the layers compute with the rounded weights")

    activation_budget_bytes: int | None = Field(
        None, ge=0, description="bytes of activations the streamed layers save for backward that stay on the device; "
                                "beyond, each is offloaded to host memory (pinned on a GPU) and brought back when the "
                                "backward needs it: exact, and what lets micro-batches in flight (GPipe's waves) keep "
                                "their activations. None: all stay on the device; 0: all go to host memory")
    prefetch: bool = Field(
        True, description="queue the next layers' uploads while a layer computes (Mobius's and APTMoE's prefetch); "
                          "false: each layer is uploaded when it runs, its compute waiting for the copy (APTMoE's "
                          "'GPipe with naive offload' baseline)")

    @property
    def on(self) -> bool:
        return self.buffer_blocks is not None

    @property
    def settings(self):
        """`vela_ray.model.streaming.StreamSettings` of this section, None when off."""
        from vela_ray.model.streaming import StreamSettings

        return None if self.buffer_blocks is None else StreamSettings(self.buffer_blocks, self.upload_format,
                                                                       self.activation_budget_bytes, self.prefetch)


class MastersSection(_Section):
    refusals = (
        Refusal("masters.shard_frozen_backbone and masters.sequence_migration",
                "both talk among the masters inside every layer's forward, and nothing orders the two",
                "turn one off", lambda job: job.masters.shard_frozen_backbone and job.masters.sequence_migration),
    )

    """Data-parallel masters: backbone replicas sharing the ExpertManagers."""

    count: int = Field(
        1, ge=1, description="data-parallel masters: backbone replicas that split every micro-batch's rows and "
                             "share the ExpertManagers (one per node in node order, master 0 on the driver's); "
                             "backbone gradients are summed among them, so the losses equal one master's. Each "
                             "sends its rows to every worker, so without replicated experts (M-1)/M of the rows "
                             "cross nodes; it spreads the backbone's compute, not the traffic")
    sequence_migration: bool = Field(
        False, description="with several masters: after every MoE decoder layer each sequence continues on the "
                           "master whose node served most of its rows (LUFFY's sequence migration; exact: the math "
                           "does not change, only where rows go). Micro-batches with packed rows stay where they are")
    sequence_migration_candidates: int = Field(
        1, ge=1, description="LUFFY's q: a sequence may continue on any of the q masters that would draw the "
                             "least traffic, the one whose attention load grows least")
    sequence_migration_combine: Literal["new_master", "home"] = Field(
        "new_master", description="where a moving sequence's expert outputs are combined: 'new_master' (LUFFY's: "
                                  "decided before the combine, the workers answer its rows to the master it moves "
                                  "to, which adds them in; its hidden state moves without them), or 'home' (they "
                                  "return to the old master, which moves the combined hidden state). 'new_master' "
                                  "falls back to 'home', with a log line, for a layer that does not add its experts' "
                                  "output as it is or experts called on grouped rows")

    shard_frozen_backbone: bool = Field(
        False, description="FSDP2 over the data-parallel masters: each keeps 1/count of every decoder layer's frozen "
                           "weights and all-gathers a layer from the others as it runs it (forward and backward), so a "
                           "master's memory for them drops by (count-1)/count at the price of moving the backbone "
                           "over the masters' links every step; LoRA stays whole on every master. Exact. Worth it "
                           "where the masters share fast links (one node's GPUs), not across nodes")
    streaming: StreamingSection = Field(
        default_factory=StreamingSection, description="the frozen backbone streamed from host memory through a "
                                                      "device buffer of a few layers")
    pipeline_stages: int = Field(
        1, ge=1, description="the master's decoder layers cut into this many contiguous stages, one master process "
                             "(and device) each on master 0's node, run as GPipe's pipeline over the micro-batches "
                             "(APTMoE's, `training.pipeline`): a backbone too big for one device is spread over the "
                             "node's. Exact; each stage is one more master process to the ExpertManagers. 1: the "
                             "whole backbone on one master")

    @model_validator(mode="after")
    def _migration_needs_masters(self) -> "MastersSection":
        if self.sequence_migration and self.count == 1:
            raise ValueError("masters.sequence_migration moves sequences between masters: set masters.count "
                             "above 1, or turn it off")
        if self.shard_frozen_backbone and self.count == 1:
            raise ValueError("masters.shard_frozen_backbone shards the backbone over data-parallel masters: set "
                             "masters.count above 1, or turn it off")
        return self


class ReplanSection(_Section):
    """Online re-placement: re-solve when routing drifts, move experts only when it pays."""

    every: int = Field(0, ge=0, description="check the drift every N steps, on the routing of those N steps; "
                                            "0: keep the first placement")
    drift_threshold: float = Field(
        0.1, ge=0, le=1, description="mean TV distance (over layers) of the recent routing from the profile "
                                     "the placement was solved for that triggers a re-solve")
    horizon_steps: int | None = Field(
        None, ge=1, description="steps a new placement's saving is counted over against the migration's cost; "
                                "None: the steps left in the run")


class PlacementSection(_Section):
    solver: Solver = Field("improved", description="placement solver; `file` reads `file`")
    file: UserPath | None = Field(None, description="placement JSON for solver `file` (from `vela place`)")
    profile: Literal["measure", "uniform"] | UserPath = Field(
        "measure", description="expert-access profile: measured on the training data, uniform, or a .json/.npy file")
    profile_batches: int = Field(4, ge=1, description="batches profiled when `profile: measure`")
    capacity: int | None = Field(None, ge=1, description="experts per worker; None: from free device memory")
    cost_model: Literal["communication", "communication+compute"] = Field(
        "communication", description="what placement minimises: the paper's communication time, or communication "
        "plus each worker's measured expert compute per row (keeps a fast link from overloading its worker)")
    shared_links: Literal["measure", "none"] = Field(
        "measure", description="measure: probe the NICs master traffic crosses (the master node's, each worker "
        "node's) and place for them too; none: the paper's model of independent master-worker links")
    replicas: bool = Field(
        False, description="with several masters (masters.count): copy experts into the workers' spare "
                           "capacity where the cost model says it pays (placement.replicate); each master sends "
                           "its rows to its nearest copy, and the copies' gradients are summed before every "
                           "step, so they stay identical (exact)")
    seed: int = 0
    replan: ReplanSection = Field(default_factory=ReplanSection)

    @model_validator(mode="after")
    def _file_given(self) -> "PlacementSection":
        if self.solver == "file" and self.file is None:
            raise ValueError("placement.solver is 'file' but placement.file is not set: give the placement JSON")
        if self.file is not None and not self.file.is_file():
            raise ValueError(f"placement.file {self.file} does not exist; write one with `vela place --out`")
        if isinstance(self.profile, Path) and not self.profile.is_file():
            raise ValueError(f"placement.profile {self.profile} does not exist; write one with `vela profile`")
        return self


class CondensationSection(_Section):
    """LUFFY's token condensation (paper §V, `vela_ray.model.condensation`): LOSSY, off by default.

    Condensed rows take another row's expert output, so a run with it on no longer trains the
    exact model; eval forwards stay exact. Similarities are cosines clamped to [0, 1].
    """

    enabled: bool = Field(
        False, description="LOSSY: in each MoE layer, rows routed to the same expert whose similarity passes "
                           "`threshold` travel once (one representative is sent and computed, the others take "
                           "its output); training forwards only. false: exact training")
    threshold: float | Literal["adaptive"] = Field(
        "adaptive", description="similarity a pair must exceed to condense, in (0, 1]: lower condenses more and "
                                "loses more; adaptive: LUFFY's Eq. 2, 1 / (1 + exp((l_ini - l_prev) / l_ini)), 0.5 "
                                "at the start, falling as the training loss falls (0.27 when it reaches 0)")
    similar_above: float = Field(
        0.8, ge=0, le=1, description="S1: a pair above this in the previous MoE layer is taken as similar without "
                                     "recomputing (a LOSSY shortcut). 0.8: the paper's Fig. 7 (about 90% of pairs "
                                     "above 0.8 stay above it in the next blocks), and above Eq. 2's thresholds "
                                     "while the loss does not rise (at most 0.5)")
    dissimilar_below: float = Field(
        0.2, ge=0, le=1, description="S2: a pair below this in the previous MoE layer is taken as dissimilar "
                                     "without recomputing. 0.2: the paper's Fig. 7 (pairs below 0.2 stay low), and "
                                     "below every Eq. 2 threshold of a positive loss (at least 0.27), so it skips "
                                     "only pairs the adaptive threshold would not condense")

    @model_validator(mode="before")
    @classmethod
    def _threshold_in_range(cls, data: object) -> object:
        threshold = data.get("threshold", "adaptive") if isinstance(data, dict) else "adaptive"
        number = isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
        if threshold != "adaptive" and not (number and 0 < threshold <= 1):
            raise ValueError(f"training.condensation.threshold is {threshold!r}: give a similarity in (0, 1] "
                             "(lower condenses more) or 'adaptive'")
        return data

    @model_validator(mode="after")
    def _shortcuts_ordered(self) -> "CondensationSection":
        if self.dissimilar_below >= self.similar_above:
            raise ValueError(f"training.condensation.dissimilar_below ({self.dissimilar_below}) must be below "
                             f"training.condensation.similar_above ({self.similar_above})")
        return self


class ZoSection(_Section):
    """Zeroth-order training (`training.method: zo`; MeZO's ZO-SGD, `vela_ray.training.zo`)."""

    eps: float = Field(
        1e-3, gt=0, description="perturbation scale: each step measures the loss at theta + eps*z and "
                                "theta - eps*z (z ~ N(0, I), drawn per LoRA tensor) and steps along z by "
                                "lr * (L+ - L-) / (2 eps). MeZO's default 1e-3; much smaller loses the "
                                "difference to rounding (fp32), much larger biases it")
    parameters: Literal["lora", "full"] = Field(
        "lora", description="what ZO trains. lora: the LoRA adapters; full: every weight (MeZO's and "
                            "ZO-Offloading's full-parameter setting): the frozen weights are perturbed and updated "
                            "in place where they live (the master's backbone, streamed or not, and every "
                            "ExpertManager's experts), in the model's dtype, the adapters too; still no gradient or "
                            "optimizer state. Checkpoints keep the step's projected gradients, and resuming replays "
                            "them onto the base weights (MeZO's seed trick), as `vela export --format merged` does")


DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "sigmoid_norm", "sft")
"""TRL's DPOTrainer loss types (`DPOConfig.loss_type`) that score each pair on its own: the batch-sorting `aot`
variants and `discopop` are left out (`vela_ray.training.preference`)."""
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
"""TRL's KTOTrainer loss types (`KTOConfig.loss_type`)."""


class PreferenceSection(_Section):
    """`training.preference`: what the step optimises. `sft` (the default): the model's own next-token loss. `dpo`:
    Direct Preference Optimisation on `data.kind: preference` pairs, equal to TRL's `DPOTrainer` with peft; `kto`:
    Kahneman-Tversky Optimisation on `data.kind: unpaired_preference` examples, equal to TRL's `KTOTrainer` (TRL's
    names: `loss_type`, `loss_weights`, `beta`, `label_smoothing`, `desirable_weight`, `undesirable_weight`,
    `router_aux_loss_coef`). The reference model is the same weights with every adapter off, on the master (peft's
    `disable_adapter`) and on the ExpertManagers (the broker asks for rows without LoRA): no second copy
    (`vela_ray.training.preference`)."""

    refusals = (
        Refusal("training.preference.objective dpo or kto and training.method: zo, training.condensation.enabled or "
                "masters.sequence_migration", "each scores an example from its sequences' own rows, which ZO's "
                "perturbed passes, condensed rows or sequences moved between masters would not give",
                "use objective: sft, or leave those settings at their defaults",
                lambda job: job.training.preference.on and (
                    job.training.method == "zo" or job.training.condensation.enabled
                    or job.masters.sequence_migration)),
    )

    objective: Literal["sft", "dpo", "kto"] = Field(
        "sft", description="sft: supervised next-token loss; dpo: Direct Preference Optimisation on chosen/rejected "
        "pairs (data.kind: preference); kto: Kahneman-Tversky Optimisation on examples marked desirable or not "
        "(data.kind: unpaired_preference). The reference is computed in each step with the adapters off")
    loss_type: list[Literal[DPO_LOSS_TYPES + KTO_LOSS_TYPES]] | None = Field(  # type: ignore[valid-type]
        None, min_length=1, description="TRL's loss types. dpo: one or several, summed with loss_weights (e.g. "
        f"[sigmoid, sft]): {', '.join(DPO_LOSS_TYPES)}; default sigmoid. kto: one of {', '.join(KTO_LOSS_TYPES)}; "
        "default kto")
    loss_weights: list[float] | None = Field(None, description="dpo: one weight per loss_type; None: all 1")
    beta: float = Field(0.1, gt=0, description="the KL penalty's inverse temperature (IPO's tau)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo: conservative DPO's / robust's / exo_pair's "
                                   "share of flipped labels")
    desirable_weight: float = Field(1.0, gt=0, description="kto: the desirable examples' loss weight")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: the undesirable examples' loss weight")
    router_aux_loss_coef: float | None = Field(
        None, ge=0, description="the router's load-balancing loss coefficient added to the loss; None: the model "
        "config's own (router_aux_loss_coef), as TRL; 0 turns it off")

    _one_loss_type_as_a_name = field_validator("loss_type", mode="before")(
        classmethod(lambda cls, value: one_name_as_a_list(value)))  # `loss_type: ipo`, as TRL's configs take it

    @model_validator(mode="after")
    def _settings_fit_the_objective(self) -> "PreferenceSection":
        allowed = {"dpo": DPO_LOSS_TYPES, "kto": KTO_LOSS_TYPES}.get(self.objective, ())
        wrong = [t for t in self.loss_type or () if t not in allowed]
        if wrong:
            raise ValueError(f"training.preference.loss_type {wrong} is not a loss of objective {self.objective}; "
                             f"use {', '.join(allowed) or 'none (sft has one loss)'}")
        if self.objective == "kto" and len(self.losses) > 1:
            raise ValueError("training.preference.loss_type: kto takes one loss type, as TRL's KTOConfig")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.losses):
            raise ValueError(f"training.preference.loss_weights has {len(self.loss_weights)} weights for "
                             f"{len(self.losses)} loss types; give one per loss_type")
        if "exo_pair" in self.losses and self.label_smoothing == 0.0:
            raise ValueError("training.preference.loss_type exo_pair needs label_smoothing above 0 (TRL's default "
                             "for it is 1e-3)")
        return self

    @property
    def on(self) -> bool:
        return self.objective != "sft"

    @property
    def losses(self) -> tuple[str, ...]:
        """The loss types in use: `loss_type`, or the objective's default (TRL's: sigmoid for dpo, kto for kto)."""
        if self.loss_type:
            return tuple(self.loss_type)
        return {"dpo": ("sigmoid",), "kto": ("kto",)}.get(self.objective, ())


TRACKER_PACKAGES: dict[str, tuple[str, str]] = {  # training.report_to: each tracker's module and its extra
    "tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb"),
}


def missing_tracker_packages(names: list[str]) -> str | None:
    """One line naming each tracker in `names` whose package is not installed and the extra that installs it;
    None when all are there. Preflight calls it before Ray starts."""
    import importlib.util

    missing = [name for name in names if importlib.util.find_spec(TRACKER_PACKAGES[name][0]) is None]
    if not missing:
        return None
    extras = ",".join(TRACKER_PACKAGES[name][1] for name in missing)
    return (f"training.report_to names {', '.join(missing)}, not installed here: pip install 'vela-ray[{extras}]' "
            "(or remove it from training.report_to)")


def tracker_problem(names: list[str]) -> str | None:
    """One line naming a tracker of `names` that could not log here, and the fix; None when each can.
    Preflight asks before Ray starts: such a tracker would otherwise be dropped with a warning mid-run."""
    checks = {"mlflow": _mlflow_problem, "wandb": _wandb_problem}
    for name in names:
        problem = checks[name]() if name in checks else None
        if problem:
            return f"training.report_to names {name}, but {problem}"
    return None


def _flag(name: str) -> bool | None:
    """An environment variable as MLflow reads a boolean; None when unset."""
    value = os.environ.get(name)
    return None if value is None else value.strip().lower() in ("true", "1")


def _mlflow_problem() -> str | None:
    """Why MLflow could not open the store it would log to (`observability.trackers.mlflow_tracking_uri`), with
    the fix; None when it can."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        if _flag("MLFLOW_ALLOW_FILE_STORE") is False:
            return ("MLFLOW_ALLOW_FILE_STORE is false and forbids the file store in output.dir/mlruns it logs to "
                    "without MLFLOW_TRACKING_URI: unset MLFLOW_ALLOW_FILE_STORE, or set MLFLOW_TRACKING_URI")
        return None
    problem = _mlflow_store_problem(uri)
    return problem and f"{problem}, or unset MLFLOW_TRACKING_URI to log to a file store in output.dir/mlruns"


def _mlflow_store_problem(uri: str) -> str | None:
    """Why MLflow could not open the store at `uri` here, and the fix. Nothing is written: a database store is not
    opened (that creates it), a server is not asked."""
    from mlflow.store.db.db_types import DATABASE_ENGINES
    from mlflow.utils.uri import get_uri_scheme

    scheme = get_uri_scheme(uri)
    if scheme in ("", "file"):
        return None if _flag("MLFLOW_ALLOW_FILE_STORE") else (
            f"MLFLOW_TRACKING_URI={uri} is a file store, which MLflow opens only with MLFLOW_ALLOW_FILE_STORE=true: "
            "set it")
    if scheme.split("+")[0] in DATABASE_ENGINES:
        import importlib.util

        return None if importlib.util.find_spec("sqlalchemy") else (
            f"MLFLOW_TRACKING_URI={uri} is a database store, which needs sqlalchemy (mlflow-skinny does not install "
            "it): pip install sqlalchemy")
    from mlflow import MlflowClient

    try:
        MlflowClient(uri)  # builds the store; a server is asked nothing yet
    except Exception as err:
        return f"MLflow cannot use MLFLOW_TRACKING_URI={uri} ({first_line(err)}): set a tracking server's URL"
    return None


def _wandb_problem() -> str | None:
    """Why W&B could not log, with the fix: online (neither WANDB_MODE=offline nor disabled, here or in its
    settings files) without an API key wandb finds (WANDB_API_KEY, `wandb login`'s netrc). None when it can,
    or when this wandb has no `wbauth` to ask (wandb.init then says)."""
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import authenticate
    except ImportError:
        return None
    settings = wandb_setup.singleton().settings  # what wandb.init in this process goes by
    if settings.mode in ("offline", "dryrun", "disabled"):
        return None
    fix = ("set WANDB_API_KEY (or run `wandb login`), or WANDB_MODE=offline to log to output.dir/wandb and "
           "upload it later with `wandb sync`")
    try:
        found = authenticate.authenticate_session(host=settings.base_url, source="vela preflight", prompt=False,
                                                  update_session=False)
    except Exception as err:  # a key of the wrong form, two sources at once
        return f"W&B cannot use its credentials ({first_line(err)}): {fix}"
    return None if found else f"W&B is online and has no API key here: {fix}"


class OverlapSection(_Section):
    """Several micro-batches in flight on every master (issue 46): while one micro-batch's rows are at the experts,
    forward or backward, the master computes another's attention, router and shared experts, and the workers serve
    whichever rows arrive (`training.step.forward_backward`). Exact: the gradients of the micro-batches are summed
    in the order their backward passes end, so the numbers equal the serial step's to rounding (rel ~1e-7).
    Within one micro-batch, a block's shared expert computes while its own rows are away (`shared_experts`,
    `vela_ray.model.shared_expert`): the block's module, tokens and graph, so its numbers."""

    serial_with: ClassVar[tuple[RunsSerially, ...]] = (
        RunsSerially("cluster.master_tp above 1", "the tensor-parallel ranks' collectives inside every layer must "
                     "run in one order on every rank", lambda job: job.cluster.master_tp > 1),
        RunsSerially("masters.sequence_migration", "the masters exchange sequences inside every layer's forward, "
                     "in one order on every master", lambda job: job.masters.sequence_migration),
        RunsSerially("masters.shard_frozen_backbone", "FSDP2 gathers every layer's weights from the other masters, "
                     "in one order on every master", lambda job: job.masters.shard_frozen_backbone),
        RunsSerially("lora.lora_dropout above 0", "peft's dropout masks come from one torch generator in "
                     "micro-batch order", lambda job: job.lora.lora_dropout > 0),
        RunsSerially("training.condensation.enabled", "the condenser's adaptive state follows the calls in order",
                     lambda job: job.training.condensation.enabled),
        RunsSerially("training.method: zo without masters.streaming", "a ZO step runs no backward to overlap (with "
                     "a streamed backbone its micro-batches pass the buffer in step)",
                     lambda job: job.training.method == "zo" and not job.masters.streaming.on),
        RunsSerially("training.preference.objective: dpo", "its reference pass turns the master's adapters off in "
                     "the whole model (peft's disable_adapter), which another micro-batch would compute through",
                     lambda job: job.training.preference.on),
        RunsSerially("masters.pipeline_stages above 1", "the stages keep micro-batches in flight already, one per "
                     "stage, in ticks every stage walks in one order (GPipe)",
                     lambda job: job.masters.pipeline_stages > 1),
    )
    shared_experts_serial_with: ClassVar[tuple[RunsSerially, ...]] = (
        RunsSerially("cluster.master_tp above 1", "a tensor-parallel shared expert's collectives would run while the "
                     "rows travel on another thread, in no one order on every rank",
                     lambda job: job.cluster.master_tp > 1),
    )

    micro_batches_in_flight: int = Field(
        1, ge=1, description="micro-batches a master runs at once, each on a thread of its own (its own CUDA stream "
        "on a GPU): while one's rows travel to the experts and back, another computes. 1: the serial step. Runs "
        "serially, saying why, with the settings it cannot overlap (`OverlapSection.serial_with`)")
    shared_experts: bool = Field(
        True, description="compute each MoE block's shared expert (DeepSeek-V3, GLM-4.5, Llama 4) on the master while "
        "the block's routed rows are at the experts, their round trip on a thread of its own: exact, the block's own "
        "module on its own tokens. A block that calls its shared expert before its experts (Qwen2-MoE) has nothing to "
        "overlap. false: computed once the rows are back, as the block does. Runs serially, saying why, with the "
        "settings in `OverlapSection.shared_experts_serial_with`")

    def in_flight(self, job: "JobConfig") -> int:
        """The micro-batches this job runs at once: the setting, or 1 (logged once, with the reason) where a
        setting of the job needs the serial step."""
        if self.micro_batches_in_flight == 1:
            return 1
        serial = first_serial(self.serial_with, job)
        if serial is not None:
            logger.info("training.overlap.micro_batches_in_flight %d: running micro-batches one at a time, "
                        "as %s: %s", self.micro_batches_in_flight, serial.settings, serial.why)
            return 1
        return self.micro_batches_in_flight

    def overlaps_shared_experts(self, job: "JobConfig") -> bool:
        """Whether this job's blocks compute their shared experts while their rows are away: the setting, or False
        (logged once, with the reason) where a setting of the job needs them after the rows are back."""
        if not self.shared_experts:
            return False
        serial = first_serial(self.shared_experts_serial_with, job)
        if serial is not None:
            logger.info("training.overlap.shared_experts: computing each shared expert one at a time, once its "
                        "block's rows are back, as %s: %s", serial.settings, serial.why)
            return False
        return True


class TrainingSection(_Section):
    refusals = (
        Refusal("training.method: zo and several master processes (masters.count, cluster.master_tp or "
                "masters.pipeline_stages above 1)", "one master draws the backbone's perturbation",
                "use masters.count: 1, cluster.master_tp: 1 and masters.pipeline_stages: 1, or training.method: "
                "first_order", lambda job: job.training.method == "zo" and job.master_processes > 1),
        Refusal("training.method: zo and training.condensation.enabled",
                "condensation condenses only forwards that keep a graph, so it would do nothing",
                "turn condensation off", lambda job: job.training.method == "zo" and job.training.condensation.enabled),
        Refusal("training.method: zo and fault_tolerance.on_worker_loss: recover",
                "a ZO step's update waits to be fused into the next step's first pass, in processes a recovery "
                "replaces", "use on_worker_loss: stop and resume from the checkpoint it names",
                lambda job: job.training.method == "zo" and job.fault_tolerance.on_worker_loss == "recover"),
    )

    steps: int = Field(ge=1, description="optimizer steps")
    batch_size: int = Field(8, ge=1, description="rows per optimizer step (the paper: 8)")
    micro_batch_size: int | None = Field(None, ge=1, description="rows per forward; None: the whole batch")
    eval_every: int = Field(0, ge=0, description="evaluate every N steps; 0: only at the end")
    eval_batches: int = Field(2, ge=1)
    eval_fraction: float = Field(0.05, gt=0, lt=1, description="share of the data held out for eval loss")
    log_every: int = Field(1, ge=1)
    seed: int = 0
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    condensation: CondensationSection = Field(
        default_factory=CondensationSection, description="LUFFY's token condensation: LOSSY, off by default")
    method: Literal["first_order", "zo"] = Field(
        "first_order", description="first_order: backward and AdamW (equals transformers + peft); zo: zeroth-order "
        "ZO-SGD (MeZO): two no-grad forwards per step, no backward, no activations kept, no gradient traffic; "
        "steps with optimizer.lr and its schedule (AdamW's other settings and max_grad_norm are unused). A "
        "different optimizer: it needs many more steps and a smaller lr")
    zo: ZoSection = Field(default_factory=ZoSection, description="settings of method: zo")
    overlap: OverlapSection = Field(default_factory=OverlapSection,
                                    description="several micro-batches in flight on every master")
    preference: PreferenceSection = Field(default_factory=PreferenceSection,
                                          description="the objective: sft, or dpo on preference pairs")
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in backward instead of keeping them (long "
        "contexts in less master memory, ~a third more master compute); the experts' outputs are kept, so expert "
        "rows still cross the data plane once per step each way. Unused by method: zo, which keeps no activations")
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list, description="experiment trackers master 0 logs to (per step: loss, lr, gradient norm, "
        "tokens/s, step time and its parts, bytes per link tier, placement version, eval loss; per run: the config, "
        "the summary, report.html and placement.json). TensorBoard writes to output.dir/tensorboard; MLflow to "
        "MLFLOW_TRACKING_URI, or without it to a file store in output.dir/mlruns; W&B where its environment says "
        "(WANDB_API_KEY, or WANDB_MODE=offline: output.dir/wandb). Each needs its extra: pip install "
        "'vela-ray[tensorboard,mlflow,wandb]'; preflight refuses one that could not log here")
    tracker_project: str = Field("vela-ray", min_length=1, description="the MLflow experiment / W&B project the "
                                 "run is logged under; the run is named after output.dir and the run id")

    _one_tracker_as_a_name = field_validator("report_to", mode="before")(
        classmethod(lambda cls, value: one_name_as_a_list(value)))  # `report_to: wandb`, as TrainingArguments take it

    @model_validator(mode="after")
    def _micro_divides(self) -> "TrainingSection":
        if self.micro_batch_size and self.batch_size % self.micro_batch_size:
            raise ValueError(f"training.micro_batch_size ({self.micro_batch_size}) must divide "
                             f"training.batch_size ({self.batch_size})")
        return self

    @model_validator(mode="after")
    def _zo_keeps_no_activations(self) -> "TrainingSection":
        if self.method == "zo" and self.activation_checkpointing:
            logger.warning("training.activation_checkpointing is unused by method: zo (its forwards keep no "
                           "activations)")
        return self

    @property
    def grad_accumulation(self) -> int:
        return self.batch_size // (self.micro_batch_size or self.batch_size)


class CheckpointSection(_Section):
    every: int = Field(0, ge=0, description="checkpoint every N steps; 0: only at the end")
    keep: int = Field(3, ge=1, description="keep the newest K checkpoints")
    dir: StoragePath | None = Field(None, description="checkpoint root, a directory or a URI on object storage "
                                    "(s3://bucket/ckpt); None: output.dir/checkpoints")
    resume: str | None = Field(None, description="`latest` or a checkpoint directory to continue from")
    asynchronous: bool = Field(
        False, description="copy the state to host memory at a checkpoint step and write it on background "
                           "threads while training goes on; published (atomically, as ever) once all is written")


def _timestamped_dir() -> Path:
    return Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")


class OutputSection(_Section):
    dir: StoragePath = Field(
        default_factory=_timestamped_dir, description="where the adapter, summary, report and checkpoints go; one "
                                                      "run per dir: a directory, or a URI on object storage "
                                                      "(s3://bucket/run, gs://..., credentials from the environment; "
                                                      "vela_ray.storage). Default: runs/<the config file's name>, or "
                                                      "runs/run-<date-time> for a job built in Python")
    overwrite: bool = Field(
        False, description="when output.dir holds another run, move it aside to <dir>.old-<its run id> (nothing "
                           "is deleted) instead of refusing the job")


class ReportSection(_Section):
    """The report's Samples section: greedy generations of the base and the fine-tuned model, side by side,
    made on the driver after the run (`vela_ray.generate.add_samples`)."""

    prompts: list[str] = Field(default_factory=list, description="prompts to generate from (a chat model's "
                               "under its chat template); empty: the start of the first `samples` eval rows")
    samples: int = Field(3, ge=0, description="eval rows to take prompts from when `prompts` is empty; 0 (and no "
                                              "prompts): no samples")
    max_new_tokens: int = Field(32, ge=1, le=1024, description="tokens generated per prompt and model")
    samples_max_params: float = Field(
        2e9, gt=0, description="larger models get no samples (they are generated on the driver's CPU); the "
                               "report says why")


class JobConfig(_Section):
    """A whole fine-tuning job."""

    refusals = (
        Refusal("mode: expert_parallel and a vela-only setting (cluster.master_tp above 1, training.method: zo, "
                "training.condensation, data_plane.row_format other than exact, model.trust_remote_code, "
                "model.quantization, training.preference)",
                "the expert-parallel baseline runs plain peft steps over all-to-all collectives, on transformers' "
                "own families and modules, with its rows exact", "use mode: vela, or leave those settings at their "
                "defaults",
                lambda job: job.mode != "vela" and (
                    job.cluster.master_tp > 1 or job.training.method != "first_order"
                    or job.training.condensation.enabled or job.data_plane.row_format != "exact"
                    or job.model.trust_remote_code or job.model.quantization.on or job.training.preference.on)),
    )

    mode: Literal["vela", "expert_parallel"] = Field(
        "vela", description="vela: master + ExpertManagers; expert_parallel: the conventional EP baseline")
    model: ModelSection
    data: DataConfig
    lora: LoraSection = Field(default_factory=LoraSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    data_plane: DataPlaneSection = Field(default_factory=DataPlaneSection)
    fault_tolerance: FaultToleranceSection = Field(default_factory=FaultToleranceSection)
    masters: MastersSection = Field(default_factory=MastersSection)
    expert_tiers: ExpertTiersConfig = Field(
        default_factory=ExpertTiersConfig, description="APTMoE's CPU/device expert tiers: workers keep experts in host "
                                                       "memory and compute each on the CPU or their device (Eq. 1)")
    placement: PlacementSection = Field(default_factory=PlacementSection)
    training: TrainingSection
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    output: OutputSection = Field(default_factory=OutputSection)
    report: ReportSection = Field(default_factory=ReportSection)
    _family_check: str | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: object) -> object:
        """Old keys in their new places first (`MOVED`), so the validators below see every key where it now is."""
        if not isinstance(data, dict):
            return data
        return _move_old_keys(data)

    @model_validator(mode="after")
    def _features_combine(self) -> "JobConfig":
        """Every feature's own refusals (`_Section.refusals`, declared where the feature is), the first that applies
        raised in one line: the config holds no list of combinations."""
        for section in _sections(self):
            for refusal in type(section).refusals:
                if refusal.applies(self):
                    raise ValueError(refusal.message())
        return self

    @property
    def master_processes(self) -> int:
        """Master processes sending rows to the workers: masters.count data-parallel masters of cluster.master_tp
        tensor-parallel ranks each (`runtime.masters.MasterMesh`)."""
        return self.masters.count * self.cluster.master_tp * self.masters.pipeline_stages

    @model_validator(mode="after")
    def _objective_reads_its_data(self) -> "JobConfig":
        """A preference objective trains on pairs, SFT on single answers: each refuses the other's data."""
        objective, kind = self.training.preference.objective, self.data.kind
        reads = {"dpo": "preference", "kto": "unpaired_preference"}
        if objective in reads and kind != reads[objective]:
            raise ValueError(f"training.preference.objective {objective} trains on data.kind {reads[objective]}, not "
                             f"{kind}; set data.kind: {reads[objective]}")
        micro = self.training.micro_batch_size or self.training.batch_size
        if objective == "kto" and self.training.preference.losses == ("kto",) and micro < 2:
            raise ValueError("training.micro_batch_size 1 with KTO: its KL baseline pairs each example's prompt with "
                             "another example's answer in the micro-batch, so it needs at least 2; raise it (as TRL "
                             "refuses per_device_train_batch_size 1)")
        trains = {kind_: name for name, kind_ in reads.items()}
        if objective == "sft" and kind in trains:
            raise ValueError(f"data.kind {kind} holds preference data, which supervised fine-tuning cannot train on; "
                             f"set training.preference.objective: {trains[kind]}")
        return self

    @model_validator(mode="after")
    def _streaming_combines(self) -> "JobConfig":
        """What a streamed backbone (`StreamingSection`) cannot run with, one line each."""
        blocks = self.masters.streaming.buffer_blocks
        if blocks is None:
            return self
        for setting, on, why in (
                ("training.activation_checkpointing", self.training.activation_checkpointing and
                 self.training.method != "zo", "its recompute runs a layer again inside the backward, outside the "
                 "stream that uploads the layer's block"),
                ("cluster.master_tp above 1", self.cluster.master_tp > 1, "a tensor-parallel layer's weights are "
                 "DTensor shards, not plain tensors a block can hold"),
                ("masters.shard_frozen_backbone", self.masters.shard_frozen_backbone, "FSDP2 already keeps each "
                 "layer's frozen weights sharded and gathers them per layer"),
                ("mode: expert_parallel", self.mode == "expert_parallel", "the expert-parallel baseline runs plain "
                 "peft on every rank, its layers resident")):
            if on:
                raise ValueError(f"masters.streaming.buffer_blocks ({blocks}) and {setting} do not combine: {why}; "
                                 f"turn one off")
        return self

    @model_validator(mode="after")
    def _pipeline_combines(self) -> "JobConfig":
        """What a pipelined master (`MastersSection.pipeline_stages`) cannot run with, one line each."""
        stages = self.masters.pipeline_stages
        if stages == 1:
            return self
        for setting, on, why in (
                ("masters.count above 1", self.masters.count > 1, "a pipeline of data-parallel masters is not "
                 "built: one master's layers are cut into stages"),
                ("cluster.master_tp above 1", self.cluster.master_tp > 1, "a stage of tensor-parallel ranks is not "
                 "built"),
                ("a preference objective", self.training.preference.on, "its reference pass and its metric sums "
                 "are not carried through the stages"),
                ("training.condensation.enabled", self.training.condensation.enabled, "each stage's condenser "
                 "would follow a loss only the last stage computes"),
                ("lora.lora_dropout above 0", self.lora.lora_dropout > 0, "each stage process draws dropout masks "
                 "from its own generator, not in one master's layer order"),
                ("mode: expert_parallel", self.mode == "expert_parallel", "the expert-parallel baseline runs plain "
                 "peft on every rank")):
            if on:
                raise ValueError(f"masters.pipeline_stages ({stages}) and {setting} do not combine: {why}; turn one "
                                 "off")
        return self

    @model_validator(mode="after")
    def _full_zo_combines(self) -> "JobConfig":
        """What full-parameter ZO (`ZoSection.parameters: full`) cannot run with, one line each."""
        if self.training.method != "zo" or self.training.zo.parameters != "full":
            return self
        for setting, on, why, fix in (
                ("model.quantization", self.model.quantization.on, "a quantized weight cannot take eps*z: it would "
                 "be rounded back to its format's grid", "set model.quantization.format: none"),
                ("placement.replan.every above 0", self.placement.replan.every > 0, "an expert that moves reads "
                 "its frozen weights from the model's checkpoint, not the trained ones", "set replan.every: 0")):
            if on:
                raise ValueError(f"training.zo.parameters: full and {setting} do not combine: {why}; {fix}, or use "
                                 "zo.parameters: lora")
        return self

    @model_validator(mode="after")
    def _row_format_that_changes_something(self) -> "JobConfig":
        row_format = self.data_plane.row_format
        for field, value in (("data_plane.row_format", row_format),
                             ("expert_tiers.upload_format", self.expert_tiers.upload_format),
                             ("masters.streaming.upload_format", self.masters.streaming.upload_format)):
            if value == "bfloat16" and self.model.dtype == "bfloat16":
                raise ValueError(f"{field}: bfloat16 with model.dtype: bfloat16 saves nothing (the tensors are "
                                 "bf16 already): use exact, or float8 for fewer bytes")
        return self

    @model_validator(mode="after")
    def _rows_for_every_master(self) -> "JobConfig":
        rows = self.training.micro_batch_size or self.training.batch_size
        if self.mode == "vela" and rows < self.masters.count:
            raise ValueError(f"a micro-batch of {rows} rows cannot feed masters.count = "
                             f"{self.masters.count} masters: raise training.micro_batch_size (or "
                             "batch_size) to at least the number of masters")
        return self

    @property
    def checkpoint_root(self) -> Path | str:
        """`checkpoint.dir`, else `output.dir/checkpoints`: a Path, or a URI string on object storage."""
        if self.checkpoint.dir is not None:
            return self.checkpoint.dir
        if isinstance(self.output.dir, str):
            return f"{self.output.dir}/checkpoints"
        return self.output.dir / "checkpoints"

    @property
    def output_local_dir(self) -> Path:
        """Where this run writes its outputs: `output.dir`, or for a URI its local mirror, uploaded at the end
        (`vela_ray.storage.local_mirror`)."""
        if isinstance(self.output.dir, str):
            from vela_ray.storage import local_mirror

            return local_mirror(self.output.dir)
        return self.output.dir

    # Where config strings become runtime objects, each through the model side's one translation
    # (imported here lazily: a config is read and validated without torch).

    @property
    def lora_spec(self):
        """`vela_ray.model.experts.LoraSpec` of the job's LoRA, rank/alpha patterns resolved against the model
        (each expert stack's own, `vela_ray.model.adapters.resolve_expert_lora`), as workers need it."""
        spec = self.lora.spec()
        if not (spec.rank_pattern or spec.alpha_pattern):
            return spec
        from vela_ray.model.adapters import resolve_expert_lora_of

        return resolve_expert_lora_of(self.model.path, spec, self.model.trust_remote_code)

    @property
    def quantization_spec(self):
        """`vela_ray.model.quantization.QuantizationSpec` of `model.quantization`, None when nothing is quantized."""
        section = self.model.quantization
        if not section.on:
            return None
        from vela_ray.model.quantized_model import QuantizationSpec

        return QuantizationSpec(section.format, section.experts, section.backbone, tuple(self.lora.modules_to_save))

    @property
    def torch_dtype(self):
        """`model.dtype` as a torch dtype (`vela_ray.model.dtypes`, the one table of dtype names)."""
        from vela_ray.model.dtypes import torch_dtype

        return torch_dtype(self.model.dtype)

    def with_dataset(self, dataset: object) -> "JobConfig":
        """This job reading its records from `dataset`, a `ray.data.Dataset` of text, instruct or chat records
        (as `data.kind` says) instead of `data.path`: streamed to the master from the cluster, never gathered
        on the driver (preflight checks a sample of it)."""
        return self.model_copy(update={"data": self.data.with_records(dataset)})

    def with_resume(self, spec: str | None) -> "JobConfig":
        """This config resuming from `spec` (`latest` or a directory); None leaves it unchanged."""
        if spec is None:
            return self
        return self.model_copy(update={"checkpoint": self.checkpoint.model_copy(update={"resume": spec})})

    @property
    def family_check(self) -> str | None:
        """How preflight verified the model's family equal to peft (None before preflight): the run summary
        records it. Not a field: only preflight sets it, a YAML file cannot."""
        return self._family_check

    def with_family_check(self, text: str) -> "JobConfig":
        checked = self.model_copy()
        checked._family_check = text
        return checked

    @classmethod
    def from_yaml(cls, path: str | Path) -> "JobConfig":
        """The job in a YAML file; a syntax error names the file and line, not a parser traceback."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        raw = _read_yaml(path)
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of sections (model:, data:, training:, ...), "
                             f"got a YAML {type(raw).__name__}")
        output = raw.get("output")
        if output is None or (isinstance(output, dict) and "dir" not in output):  # one run dir per config file
            raw = {**raw, "output": {**(output or {}), "dir": str(Path("runs") / path.stem)}}
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "JobConfig":
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            raise ValueError(f"{source}: " + _readable(err)) from None

    def preflight(self) -> "Preflight":
        """Every check against the files (weights, data, placement file, resume, output dir) before Ray.

        ValueError with one line naming the field or file and the fix. Writes nothing
        but a probe file it deletes. Run the returned `.config`: its resume is pinned
        to the checkpoint verified here, so the master cannot pick a different one.
        """
        from vela_ray.preflight import preflight  # torch and transformers load here, after validation

        return preflight(self)


# Keys that moved, old path -> new path: each old key is read into its new place, with a one-line
# warning, until the next release (issue 32 split `cluster` into one section per concern).
MOVED: dict[tuple[str, ...], tuple[str, ...]] = {
    ("cluster", "transport"): ("data_plane", "transport"),
    ("cluster", "inline_bytes"): ("data_plane", "inline_bytes"),
    ("cluster", "row_format"): ("data_plane", "row_format"),
    ("cluster", "zero_copy_tensors"): ("data_plane", "zero_copy_tensors"),
    ("cluster", "on_worker_loss"): ("fault_tolerance", "on_worker_loss"),
    ("cluster", "max_recoveries"): ("fault_tolerance", "max_recoveries"),
    ("cluster", "num_masters"): ("masters", "count"),
    ("cluster", "sequence_migration"): ("masters", "sequence_migration"),
    ("cluster", "sequence_migration_candidates"): ("masters", "sequence_migration_candidates"),
    ("cluster", "expert_tiers"): ("expert_tiers",),
}


def _sections(section: _Section) -> list[_Section]:
    """`section` and every section within it, depth first (`JobConfig._features_combine`)."""
    inner = [value for name in type(section).model_fields if isinstance(value := getattr(section, name), _Section)]
    return [section, *(s for value in inner for s in _sections(value))]


def _move_old_keys(raw: dict) -> dict:
    """`raw` with every old key of `MOVED` at its new path; the caller's dicts are left as they were.

    ValueError when a key is given under both its old and its new name: which one was meant is a guess.
    """
    data = dict(raw)
    for old, new in MOVED.items():
        old_parent = _section_copy(data, old[:-1])
        if old_parent is None or old[-1] not in old_parent:
            continue
        new_parent = _section_copy(data, new[:-1], create=True)
        if new_parent is None:
            continue  # the new section is not a mapping: its own validation says so
        old_name, new_name = ".".join(old), ".".join(new)
        if new[-1] in new_parent:
            raise ValueError(f"{old_name} and {new_name} are both set, but {old_name} is the old name of "
                             f"{new_name}: keep only {new_name}")
        new_parent[new[-1]] = old_parent.pop(old[-1])
        logger.warning("%s is now %s; the old key is read until the next release", old_name, new_name)
    return data


def _section_copy(data: dict, path: tuple[str, ...], create: bool = False) -> dict | None:
    """The mapping at `path` in `data`, copied into place so edits leave the caller's own dicts alone;
    None where a step is missing (and not `create`d) or is not a mapping."""
    node = data
    for name in path:
        child = node.get(name, {} if create else None)
        if not isinstance(child, dict):
            return None
        node[name] = child = dict(child)
        node = child
    return node


def _read_yaml(path: Path) -> object:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1} column {mark.column + 1}: " if mark else ""
        what = getattr(err, "problem", None) or first_line(err)
        raise ValueError(f"{path}: {where}YAML syntax error ({what}); fix the YAML there") from None


# Names other fine-tuning tools use for a field, and vela-ray's own (an unknown key gets a pointer).
ALIASES: dict[tuple[str, ...], str] = {
    ("training", "learning_rate"): "training.optimizer.lr",
    ("training", "lr"): "training.optimizer.lr",
    ("training", "max_steps"): "training.steps",
    ("training", "num_train_steps"): "training.steps",
    ("training", "warmup_steps"): "training.optimizer.warmup_steps",
    ("training", "weight_decay"): "training.optimizer.weight_decay",
    ("training", "max_grad_norm"): "training.optimizer.max_grad_norm",
    ("training", "lr_scheduler_type"): "training.optimizer.schedule",
    ("training", "per_device_train_batch_size"): "training.micro_batch_size",
    ("lora", "rank"): "lora.r",
    ("lora", "lora_r"): "lora.r",
    ("lora", "lora_alpha"): "lora.alpha",
    ("data", "cutoff_len"): "data.seq_len",
    ("data", "max_seq_length"): "data.seq_len",
    ("training", "num_train_epochs"): "training.steps",
    ("lora", "lora_rank"): "lora.r",
    # LLaMA-Factory's and HF's flat files: their keys at the top level
    ("model_name_or_path",): "model.path",
    ("learning_rate",): "training.optimizer.lr",
    ("num_train_epochs",): "training.steps",
    ("max_steps",): "training.steps",
    ("lora_rank",): "lora.r",
    ("lora_alpha",): "lora.alpha",
    ("cutoff_len",): "data.seq_len",
    ("output_dir",): "output.dir",
}
# What an alias's value means differently in vela-ray, said beside the pointer
ALIAS_NOTES: dict[str, str] = {
    "num_train_epochs": "it counts optimizer steps, not epochs: steps = epochs x training rows / batch_size",
}


def _readable(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        what = _unknown_field(e["loc"]) if e["type"] == "extra_forbidden" else _message(e)
        # a whole-job validator's error names its own fields (and the caller names the file): no "config: " before it
        parts.append(f"{'.'.join(str(x) for x in e['loc'])}: {what}" if e["loc"] else what)
    return "; ".join(parts)


def _message(error: dict) -> str:
    """pydantic's error in vela-ray's words: our own validators' text as written, the rest without pydantic's
    phrasing ("Value error, ...", "Input should be ...")."""
    if error["type"] == "value_error" and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    if error["type"] == "missing":
        return "missing: this field is required"
    got = f" (got {error['input']!r})" if "input" in error and not isinstance(error["input"], dict) else ""
    return error["msg"].replace("Input should be", "must be").replace("Value error, ", "") + got


def _unknown_field(loc: tuple) -> str:
    """A misspelt key: the closest field of its section, which is what the user meant to type; a misspelt
    old key (`MOVED`) is pointed to its new place."""
    alias = ALIASES.get(tuple(map(str, loc)))
    if alias:
        note = ALIAS_NOTES.get(str(loc[-1]))
        return f"unknown field (vela-ray calls it {alias!r}{'; ' + note if note else ''})"
    names = _section_fields(loc[:-1])
    moved = {old[-1]: ".".join(new) for old, new in MOVED.items() if old[:-1] == tuple(map(str, loc[:-1]))}
    close = difflib.get_close_matches(str(loc[-1]), [*names, *moved], n=1)
    if close:
        return f"unknown field (did you mean {moved.get(close[0], close[0])!r}?)"
    return "unknown field" + (f"; the fields here are {', '.join(names)}" if names else "")


def _section_fields(loc: tuple) -> list[str]:
    """Field names of the pydantic model at `loc` below JobConfig ([] if it is not a model)."""
    model: type[BaseModel] = JobConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)
