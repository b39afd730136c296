"""A run's state, in one place: what it loaded (`Backbone`), what lives while it trains (`Live`),
where it resumes from (`ResumePoint`) and what it decided and measured so far (`RunState`).

The stages of `vela_ray.runtime.runner` read and fill these; none keeps a copy of its own.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from placement import Placement, PlacementProblem, SharedLink
from vela_ray.config import JobConfig, LoraSection
from vela_ray.data.datasets import TokenizedDataset, build_dataset
from vela_ray.data.locality import AccessProfile
from vela_ray.model.modeling import MoeBlock, find_moe_blocks, top_k_of
from vela_ray.runtime.masters import MasterGroup, master_spec
from vela_ray.runtime.pool import HostedExperts
from vela_ray.training import checkpoint
from vela_ray.training.sequence_migration import SequenceMigration
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.master import MasterModel, MasterSpec, seeded_backbone
from vela_ray.runs import RunIdentity, check_same_math
from vela_ray.storage import name_of
from vela_ray.training.summary import (
    LinkRecord, MigrationRecord, RecoveryRecord, ReplanRecord, ResumeRecord, StepRecord,
)

logger = logging.getLogger(__name__)


@dataclass
class Backbone:
    """What the master holds before any worker starts: tokenizer, data, the model and its MoE blocks."""

    tokenizer: PreTrainedTokenizerBase
    train_set: TokenizedDataset
    eval_set: TokenizedDataset
    model: nn.Module
    blocks: list[MoeBlock]

    @classmethod
    def load(cls, config: JobConfig, spec: MasterSpec | None = None) -> Backbone:
        """Tokenizer, data split and the model as `spec` (the job's `master_spec` by default) reads it."""
        tokenizer = AutoTokenizer.from_pretrained(str(config.model.path))
        data = build_dataset(config.data, tokenizer, warn=False)  # the driver's preflight warned already
        train_set, eval_set = data.split(config.training.eval_fraction, config.training.seed)
        # a tensor-parallel master 0 reads only its shards, once its group exists (`runtime.masters.MasterGroup`)
        model = seeded_backbone(spec or master_spec(config), read=config.cluster.master_tp == 1)
        return cls(tokenizer, train_set, eval_set, model, find_moe_blocks(model))

    @property
    def shape(self) -> tuple[int, int]:
        """(MoE layers, experts per layer)."""
        return len(self.blocks), self.blocks[0].layout.num_experts

    @property
    def top_k(self) -> int:
        return top_k_of(self.model)

    def checkpoint_meta(self, lora: LoraSection) -> dict:
        """What a checkpoint of this model with the job's `lora` must match to be resumed
        (`checkpoint.check_compatible`)."""
        layout = self.blocks[0].layout
        return {"model_type": self.model.config.model_type, "moe_layers": len(self.blocks),
                "experts": layout.num_experts, "hidden_size": layout.hidden_size,
                "lora_r": lora.r, "lora_alpha": lora.alpha}


@dataclass
class Live:
    """What a run trains with, from the master's build to the end: the backbone, the experts' workers and the
    masters (master 0 and the other ranks of their mesh). Recovery replaces `hosted` and the masters' other ranks."""

    backbone: Backbone
    masters: MasterGroup
    hosted: HostedExperts

    @property
    def master(self) -> MasterModel:
        """Master 0, this process's."""
        return self.masters.leader

    @property
    def migration(self) -> SequenceMigration | None:
        """Master 0's sequence migration, with masters.sequence_migration."""
        return self.masters.migration

    @property
    def workers(self) -> ExpertWorkers:
        return self.hosted.workers


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from: its directory, verified manifest and `trainer.json`."""

    path: Path
    manifest: dict
    trainer: dict

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def placement(self) -> dict | None:
        return self.trainer.get("placement")

    @property
    def run(self) -> RunIdentity | None:
        """The run the checkpoint belongs to (None: written before runs had an identity)."""
        saved = self.trainer.get("run")
        return None if saved is None else RunIdentity.model_validate(saved)

    @property
    def profile(self) -> np.ndarray | None:
        saved = self.trainer.get("profile")
        return None if saved is None else np.asarray(saved, dtype=np.float64)

    @classmethod
    def of(cls, config: JobConfig) -> ResumePoint | None:
        """`checkpoint.resume`'s checkpoint, verified in full; refused if it does not match the job."""
        spec = config.checkpoint.resume
        if spec is None:
            return None
        path = checkpoint.resolve(spec, config.checkpoint_root)
        manifest = checkpoint.verify(path)  # full checksums
        trainer = json.loads((path / "trainer.json").read_text())
        checkpoint.check_compatible(manifest, {"lora_r": config.lora.r, "lora_alpha": config.lora.alpha}, path)
        if trainer.get("run"):
            check_same_math(trainer["run"]["math"], config.model_dump(mode="json"), path)
        if manifest["step"] >= config.training.steps:
            raise ValueError(f"{path}: the run is complete at step {manifest['step']} (training.steps = "
                             f"{config.training.steps}); raise training.steps to train further")
        logger.info("resuming from %s (step %d of %d)", path, manifest["step"], config.training.steps)
        return cls(path, manifest, trainer)


class EarlierSegments(BaseModel):
    """What a resumed run's earlier segments counted, as its checkpoint kept it: expert traffic by link tier and
    by worker (all passes: profile, training, eval) and training seconds. The summary adds this segment's."""

    bytes_by_tier: dict[str, int] = Field(default_factory=dict)
    bytes_by_worker: list[int] = Field(default_factory=list)
    sent_by_worker: list[int] = Field(default_factory=list)
    bytes_by_master: list[int] = Field(default_factory=list)
    train_s: float = 0.0

    def plus(self, segment: EarlierSegments) -> EarlierSegments:
        """Both together. Per worker only where the worker count is the same (a resume with another count
        re-places the experts: worker n is another worker then, and the newer segment's counts stand); per master
        process likewise."""
        def per_worker(mine: list[int], theirs: list[int]) -> list[int]:
            return [a + b for a, b in zip(mine, theirs)] if len(mine) == len(theirs) else list(theirs)
        tiers = dict(self.bytes_by_tier)
        for tier, count in segment.bytes_by_tier.items():
            tiers[tier] = tiers.get(tier, 0) + count
        return EarlierSegments(bytes_by_tier=tiers, bytes_by_worker=per_worker(self.bytes_by_worker,
                                                                                 segment.bytes_by_worker),
                               sent_by_worker=per_worker(self.sent_by_worker, segment.sent_by_worker),
                               bytes_by_master=per_worker(self.bytes_by_master, segment.bytes_by_master),
                               train_s=self.train_s + segment.train_s)


@dataclass
class RunState:
    """What the run has decided and measured so far; each stage fills its part."""

    plan: Placement | None = None
    problem: PlacementProblem | None = None
    version: int = 1  # of the placement; each adopted re-placement adds one
    placed_probs: np.ndarray | None = None  # [L, E] the profile the current placement was solved for
    access_profile: AccessProfile | None = None  # the measured one in full (profile.json), kept by checkpoints
    links: list[LinkRecord] = field(default_factory=list)
    shared_links: list[SharedLink] = field(default_factory=list)  # NICs the links share, measured with them
    start_step: int = 0
    history: list[StepRecord] = field(default_factory=list)
    last_checkpoint: Path | str | None = None  # the newest published checkpoint of this run (a URI on storage)
    tokens_routed_LE: np.ndarray | None = None
    routed_at_checkpoint: np.ndarray | None = None  # tokens_routed_LE when last_checkpoint was written
    timings_s: dict[str, float | list[float]] = field(default_factory=dict)
    migrations: list[MigrationRecord] = field(default_factory=list)
    replans: list[ReplanRecord] = field(default_factory=list)
    recoveries: list[RecoveryRecord] = field(default_factory=list)
    migrating: bool = False  # between pool.migrate's start and its end
    tables: np.ndarray | None = None  # what the workers host: a table [L, E], or routes [M, L, E] with replicas
    received_bytes: list[int] = field(default_factory=list)  # by each worker during training
    identity: RunIdentity | None = None  # the run's (a resume's is its checkpoint's)
    resumes: list[ResumeRecord] = field(default_factory=list)
    # what each step sent the trackers (`training.report_to`): a resume sends a tracker the steps it lost
    tracked: dict[int, dict[str, float]] = field(default_factory=dict)
    earlier: EarlierSegments = field(default_factory=EarlierSegments)  # a resumed run's segments before this one
    train_started: float | None = None  # perf_counter when this segment's training began

    def checkpointed(self, step: int) -> bool:
        """Whether the newest published checkpoint is of `step`."""
        last = self.last_checkpoint
        return last is not None and name_of(last) == f"step-{step:06d}"

    def add_routed(self, counts_LE: np.ndarray) -> None:
        """Tokens routed to each expert in a training step (not in eval or profiling)."""
        routed = self.tokens_routed_LE
        self.tokens_routed_LE = counts_LE if routed is None else routed + counts_LE

    def records(self, segment: EarlierSegments) -> dict:
        """What a checkpoint keeps of the run's record, for a resume to go on with (`restore_records`):
        `segment` is what this segment counted so far, added to the earlier ones'; and the placement problem, so
        a resumed run that keeps its placement still has the prediction it was solved for."""
        return {"totals": self.earlier.plus(segment).model_dump(),
                "problem": None if self.problem is None else self.problem.model_dump(mode="json"),
                "history": [h.model_dump() for h in self.history],
                "migrations": [m.model_dump() for m in self.migrations],
                "replans": [r.model_dump() for r in self.replans],
                "recoveries": [r.model_dump() for r in self.recoveries],
                "resumes": [r.model_dump() for r in self.resumes],
                "tracked": {str(step): values for step, values in self.tracked.items()},
                "tokens_routed": None if self.tokens_routed_LE is None else self.tokens_routed_LE.tolist()}

    def restore_records(self, saved: dict) -> None:
        """The record of the steps before a resumed checkpoint (`records`), so the summary covers them all."""
        self.history = [StepRecord.model_validate(h) for h in saved.get("history", [])]
        self.migrations = [MigrationRecord.model_validate(m) for m in saved.get("migrations", [])]
        self.replans = [ReplanRecord.model_validate(r) for r in saved.get("replans", [])]
        self.recoveries = [RecoveryRecord.model_validate(r) for r in saved.get("recoveries", [])]
        self.resumes = [ResumeRecord.model_validate(r) for r in saved.get("resumes", [])]
        self.tracked = {int(step): values for step, values in saved.get("tracked", {}).items()}
        self.earlier = EarlierSegments.model_validate(saved.get("totals") or {})
        if self.problem is None and saved.get("problem") is not None:  # the placement was kept, not re-solved
            self.problem = PlacementProblem.model_validate(saved["problem"])
        routed = saved.get("tokens_routed")
        self.tokens_routed_LE = self.routed_at_checkpoint = None if routed is None else np.asarray(routed)

    def roll_back_to(self, step: int) -> None:
        """Forget what the steps after `step` recorded (they are replayed from its checkpoint)."""
        self.history = [h for h in self.history if h.step <= step]
        self.tracked = {done: values for done, values in self.tracked.items() if done <= step}
        self.tokens_routed_LE = self.routed_at_checkpoint
