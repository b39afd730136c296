"""The run summary: one typed record of a finished run, written as `output.dir/summary.json`.

Both modes write it (`mode: vela` and the `expert_parallel` baseline), and everything
that reads a run (the report, `vela report`, the CLI's closing lines, the benchmarks)
reads these fields instead of guessing keys:

    summary = RunSummary.load("runs/demo")          # or RunSummary.model_validate_json(text)
    summary.losses[-1], summary.placement.problem    # the PlacementProblem it was solved for

`placement.problem` carries the problem the placement was solved for (profile, links,
capacities, cost model), so predicted bytes and times come from `placement.cost`, not
from numbers reconstructed after the fact. It is None when the run did not solve one
(a resumed run that kept its placement, or the expert-parallel baseline).

The fields that name the run's files (`RunSummary._paths`: the adapter, the report, the last checkpoint, the
checkpoints it resumed from) are absolute in memory and stored relative to the run's dir when they lie in
it, resolved against the dir `load` reads: a run moved aside (`vela_ray.runs.move_aside`), copied or
downloaded names its own files, not those of whatever run took its old place.

Shape legend: L = MoE layers, E = experts per layer, N = workers.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from placement import Placement, PlacementProblem, cost
from vela_ray.model.traffic import RowFormat
from vela_ray.paths import is_remote
from vela_ray.training.tiers import TierCounters

SUMMARY_FILE = "summary.json"


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepRecord(_Record):
    """One optimizer step."""

    step: int
    loss: float
    step_time_s: float
    expert_round_trip_s: float = 0.0
    """Seconds the master's transport calls took (communication + the workers' expert compute), summed over its
    micro-batches: with several in flight (`training.overlap`) they overlap each other and the master's compute."""
    master_idle_s: float = 0.0
    """Seconds of the step in which every micro-batch in flight waited on the experts (`model.activity`): the master
    idle. With one micro-batch at a time, its whole wait on the transport."""
    bytes_by_tier: dict[str, int] = Field(default_factory=dict)
    bytes_by_worker: list[int] = Field(default_factory=list)
    eval_loss: float | None = None
    tokens: int = 0
    """Non-padding tokens of the step's batch."""
    allreduce_bytes: int = 0
    """Backbone LoRA gradient all-reduce bytes of this step, as one rank sent them to the group (the
    expert-parallel ranks', or data-parallel masters' over the network; 0 for one master)."""
    sequence_moves: dict[str, int] | None = None
    """`masters.sequence_migration`: what the masters' migrations moved in this step, summed over masters
    (`vela_ray.training.sequence_migration.SequenceMoveStats`); None when it is off."""
    routing_drift: list[float] | None = None
    """Per MoE layer: the total-variation distance of this step's routing from the profile the placement was
    solved for (None without a profile). It moves when the router trains (`lora.modules_to_save`)."""
    preference: dict[str, float] | None = None
    """`training.preference`: TRL's metrics of the step's pairs (`rewards/chosen`, `rewards/rejected`,
    `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`), means over every master's pairs;
    None for SFT."""
    eval_preference: dict[str, float] | None = None
    """The same over the held-out pairs, at a step with an evaluation."""


class StepBreakdown(_Record):
    """Where a step's time goes (medians over steps; worker compute is a per-step mean)."""

    step: float
    expert_round_trip: float
    master: float
    """The master computing: the step less the seconds it was idle, waiting on the experts."""
    worker_compute_per_worker: list[float]
    worker_compute_max: float
    worker_compute_sum: float


class LinkRecord(_Record):
    """A probed master-to-worker link: seconds = latency + bytes / bandwidth."""

    latency_s: float
    bandwidth_bytes_per_s: float


class PlacementRecord(_Record):
    """The placement a run trained with, and what the cost model expected of it."""

    solver: str
    expert_to_worker: list[list[int]]
    """[L][E] worker of each expert."""
    cost_model: Literal["communication", "communication+compute", "none"] = "communication"
    expected_step_time_s: float | None = None
    """The training step the cost model predicts (`placement.cost.predict_step`): the master's compute plus its
    waits on the experts (each call's latency, the bytes, the workers' compute), overlapped with several
    micro-batches in flight. From a problem without the step's inputs (a run from before them) it is the
    objective: communication, plus expert compute under communication+compute."""
    expected_comm_time_s: float | None = None
    """The communication part alone: what the paper's cost model (eq. 7) expects."""
    lower_bound_s: float | None = None
    problem: PlacementProblem | None = None
    """The problem the placement was solved for (None: not solved in this run)."""
    routes: list[list[list[int]]] | None = None
    """With replicated experts: [M][L][E] the worker each master sends each expert's rows to."""

    @classmethod
    def of(cls, plan: Placement, problem: PlacementProblem | None, cost_model: str) -> PlacementRecord:
        comm = None if problem is None else cost.step_time(problem.communication_only(), plan.tables())
        step = None if problem is None else cost.predict_step(problem, plan.tables()).step_s
        return cls(solver=plan.solver, expert_to_worker=plan.expert_to_worker, routes=plan.routes,
                   cost_model=cost_model, expected_step_time_s=step, expected_comm_time_s=comm,
                   lower_bound_s=plan.lower_bound, problem=problem)

    @property
    def table(self) -> np.ndarray:
        """[L, E] int64 worker of each expert."""
        return np.asarray(self.expert_to_worker, dtype=np.int64)

    def tables(self) -> np.ndarray:
        """What the workers host and the masters send to: routes [M, L, E], or the one table [L, E]."""
        return self.table if self.routes is None else np.asarray(self.routes, dtype=np.int64)

    @property
    def objective_s(self) -> float | None:
        """What the solver minimised for this placement (`placement.cost.step_time`): communication, plus expert
        compute under communication+compute."""
        return self.expected_step_time_s if self.problem is None else cost.step_time(self.problem, self.tables())

    @property
    def predicts_step(self) -> bool:
        """Whether `expected_step_time_s` is the predicted training step: the problem has the master's compute."""
        return self.problem is not None and self.problem.training_step is not None

    def predicted_bytes_per_worker(self) -> np.ndarray | None:
        """[N] bytes per training step the cost model expects between the master and each worker."""
        if self.problem is None:
            return None
        return cost.worker_bytes(self.problem, self.tables())


class MigrationRecord(_Record):
    """Experts moved between live workers (`vela_ray.runtime.migration`)."""

    step: int
    """Steps done when it happened (0: at the job's start)."""
    reason: Literal["start", "drift"]
    version: int
    """The placement version it installed (1: the job's first placement)."""
    moved: int
    state_bytes: int
    """LoRA + AdamW bytes sent worker to worker."""
    frozen_bytes: int
    """Frozen expert weights the receivers read from the model's checkpoint."""
    seconds: float
    expected_saving_s: float | None = None
    """Drift re-placements: the cost model's saving over the horizon, on the recent routing."""
    expected_cost_s: float | None = None
    expert_to_worker: list[list[int]] = Field(default_factory=list)
    """[L][E] the table it installed (the one before: the previous migration's, or the sequential table)."""


class ReplanRecord(_Record):
    """A re-solve the drift tracker triggered, adopted or not."""

    step: int
    drift: float
    """Mean over layers of the TV distance between the recent routing and the placed profile."""
    moved: int
    current_step_s: float
    candidate_step_s: float
    horizon_steps: int
    expected_saving_s: float
    expected_cost_s: float
    adopted: bool


class ResumeRecord(_Record):
    """The run went on from a checkpoint in a new process (`--resume`): its steps before are the earlier
    processes' (restored from the checkpoint), the ones after this one's."""

    step: int
    """The checkpoint's step: this process ran the steps after it."""
    checkpoint: str
    resumed_at: float
    """Unix time."""


class RecoveryRecord(_Record):
    """A lost worker replaced in place (`fault_tolerance.on_worker_loss: recover`)."""

    step: int
    """The step that failed."""
    workers: list[int]
    checkpoint_step: int
    """Where the run rolled back to; steps after it were replayed."""
    seconds: float
    """From the failure to the state restored (the replayed steps excluded)."""
    restored_at: float
    """Unix time the state was restored and the first replayed step began."""


class DataRecord(_Record):
    """The training rows a run saw: how they were laid out and how much of them is padding, and (instruct and
    chat data) what became of the file's examples: read, kept, truncated, dropped and why
    (`vela_ray.data.tokenized.DataStats`, counted over the whole file before the train/eval split)."""

    kind: str
    packing: bool
    seq_len: int
    rows: int
    tokens: int
    """Non-padding tokens over all training rows."""
    padding_fraction: float
    """Share of the token slots that are padding: compute spent on nothing (packing lowers it)."""
    truncation: str = "right"
    """`data.truncation`: how examples longer than seq_len were cut."""
    examples: int | None = None
    """Examples read (None: text data, cut into blocks, or a run from before the counts)."""
    examples_kept: int | None = None
    examples_truncated: int = 0
    """Of the kept, those cut to seq_len."""
    examples_dropped: dict[str, int] = Field(default_factory=dict)
    """Examples left out, by reason."""
    supervised_tokens: int | None = None
    """Label tokens of every example read, before truncation."""
    supervised_tokens_lost: int = 0
    """Of them, those truncation cut off (the dropped examples' included)."""
    longest_example: int | None = None
    seq_len_p90: int | None = None
    """The shortest seq_len that holds 90% of the examples whole."""
    built_rows: int | None = None
    """Rows of the whole file (train and eval) the kept examples made (a preference pair makes two)."""
    desirable: int | None = None
    """`unpaired_preference` (KTO): the kept examples labelled desirable, and undesirable."""
    undesirable: int | None = None
    warning: str | None = None
    """The build's warning when more than 10% of the examples were dropped or truncated, with its fix."""

    @classmethod
    def of(cls, data, train_set) -> DataRecord:
        """From a `DataConfig` and the `TokenizedDataset` of its training rows (with its `stats`)."""
        record = cls(kind=data.kind, packing=data.packing, seq_len=train_set.seq_len, rows=len(train_set),
                     tokens=train_set.num_tokens, padding_fraction=train_set.padding_fraction,
                     truncation=data.truncation)
        stats = train_set.stats
        if stats is None:
            return record
        return record.model_copy(update=dict(
            examples=stats.examples, examples_kept=stats.kept, examples_truncated=stats.truncated,
            examples_dropped=dict(stats.dropped), supervised_tokens=stats.supervised_tokens,
            supervised_tokens_lost=stats.supervised_tokens_lost, longest_example=stats.longest,
            seq_len_p90=stats.seq_len_p90, built_rows=stats.rows, warning=stats.warning(str(data.path)),
            desirable=stats.desirable, undesirable=stats.undesirable))

    @property
    def examples_per_row(self) -> float | None:
        return None if not self.built_rows or self.examples_kept is None else self.examples_kept / self.built_rows


class CondensationRecord(_Record):
    """Token condensation over the run's training steps (`vela_ray.model.condensation`; LOSSY when enabled), the
    counters summed over every master rank (each condenses the rows it sends)."""

    enabled: bool
    threshold_policy: str = "off"
    """"adaptive" (LUFFY's Eq. 2), "fixed <value>", or "off"."""
    final_threshold: float | None = None
    """The threshold the next step would have used (similarity: cosine clamped to [0, 1])."""
    rows_seen: int = 0
    """Routed rows of the training forwards."""
    rows_condensed: int = 0
    """Of them, rows that did not travel and took their representative's expert output."""
    bytes_saved: dict[str, int] = Field(default_factory=dict)
    """By traffic direction (dispatch, gather, grad_dispatch, grad_gather): what the broker did not move."""
    pairs_computed: int = 0
    """Same-expert pairs whose similarity was calculated."""
    pairs_from_history: int = 0
    """Same-expert pairs the previous MoE layer decided without calculating."""
    select_s: float = 0.0
    """Seconds the master ranks spent selecting representatives (summed over them)."""

    @classmethod
    def of(cls, condenser, others=None) -> CondensationRecord:
        """From master 0's dispatcher's `condensation.Condenser` at the end of the run, its counters added to
        `others` (a `condensation.CondenserCounts`: the other master ranks'); None: condensation off."""
        if condenser is None:
            return cls(enabled=False)
        counts = condenser.counts() if others is None else condenser.counts() + others
        return cls(enabled=True, threshold_policy=condenser.policy, final_threshold=condenser.threshold,
                   **counts.as_dict())

    @property
    def condensed_fraction(self) -> float:
        return self.rows_condensed / self.rows_seen if self.rows_seen else 0.0

    @property
    def bytes_saved_total(self) -> int:
        return sum(self.bytes_saved.values())


class StreamingRecord(_Record):
    """`masters.streaming`: master 0's decoder layers streamed from host memory through a few device slots
    (`vela_ray.model.streaming`), counted over this process's part of the run."""

    layers: int
    buffer_blocks: int
    frozen_bytes: int
    """Every streamed layer's frozen bytes: what the device would hold without streaming."""
    slot_bytes: int
    """One slot: the largest layer's frozen bytes."""
    peak_bytes: int
    """The most the slots held at once."""
    uploads: int
    """Layer blocks copied from host memory into a slot (forward, prefetch, and again for backward)."""
    upload_bytes: int
    """What those copies moved: the blocks' bytes, or their low-bit form's."""
    upload_format: RowFormat = "exact"
    """`masters.streaming.upload_format`: LOSSY unless exact (`vela_ray.model.wire`)."""
    activation_budget: int | None = None
    """`masters.streaming.activation_budget_bytes`: saved activations kept on the device (None: all)."""
    peak_activation_bytes: int = 0
    """With a budget: the most bytes of saved activations the graphs held on the device at once."""
    offloaded_bytes: int = 0
    """With a budget: the saved activations offloaded to host memory, and brought back for the backward."""

    @classmethod
    def of(cls, stream) -> StreamingRecord | None:
        """From master 0's `streaming.BackboneStream` at the end of the run; None when it is not streamed."""
        if stream is None:
            return None
        return cls(layers=len(stream.blocks), buffer_blocks=stream.buffer_blocks, frozen_bytes=stream.frozen_bytes,
                   slot_bytes=stream.slots[0].numel(), peak_bytes=stream.peak_bytes, uploads=stream.uploads,
                   upload_bytes=stream.upload_bytes, upload_format=stream.upload_format,
                   activation_budget=stream.activation_budget, peak_activation_bytes=stream.peak_activation_bytes,
                   offloaded_bytes=stream.offloaded_bytes)


class RunSummary(_Record):
    """A finished run (see the module docstring)."""

    mode: Literal["vela", "expert_parallel"] = "vela"
    method: Literal["first_order", "zo"] = "first_order"
    """`training.method`: backward + AdamW, or zeroth-order ZO-SGD (two no-grad forwards per step)."""
    zo_parameters: Literal["lora", "full"] = "lora"
    """`training.zo.parameters` of a ZO run: the LoRA adapters, or every weight (full-parameter)."""
    row_format: RowFormat = "exact"
    """`data_plane.row_format`: how rows travelled; LOSSY unless exact (`vela_ray.model.wire`)."""
    data_plane: str = ""
    """What carried the rows between master and workers (`Transport.describe`): "collective (gloo)",
    "collective (nccl)", "object_ref", "in-process", or a split such as "collective (nccl) + in-process"."""
    objective: str = "sft"
    """`training.preference`: "sft", or the preference objective with its loss types and beta ("dpo (sigmoid, beta
    0.1)"); each step's TRL metrics are in `history` (`StepRecord.preference`)."""
    quantization: str | None = None
    """`model.quantization`: the format the frozen weights were held in and where ("nf4: experts, backbone"); None:
    at the checkpoint's width. LOSSY against the full-width model."""
    bytes_per_expert: int | None = None
    """Mean bytes one hosted expert took on its worker: frozen weights (quantized or not), LoRA, its gradient and
    AdamW moments (`worker_report.bytes_per_expert`): what the placement's capacity was sized by."""
    family_check: str | None = None
    """How the model's family was verified equal to peft before the run (`vela_ray.training.family_check`):
    by the test suite at the installed versions, or by preflight on a debug-size copy."""
    steps: int
    losses: list[float]
    eval_loss: float | None
    median_step_time_s: float
    history: list[StepRecord]
    step_breakdown_s: StepBreakdown | None = None
    traffic_bytes_by_tier: dict[str, int]
    """Expert traffic by link tier over the whole run (training and eval passes)."""
    traffic_bytes_by_worker: list[int]
    sent_bytes_by_worker: list[int] = Field(default_factory=list)
    worker_received_bytes: list[int] = Field(default_factory=list)
    tokens_routed: list[list[int]] = Field(default_factory=list)
    """[L][E] rows the routers sent to each expert during training steps."""
    worker_tiers: list[str]
    worker_nodes: list[str]
    master_node: str
    master_nodes: list[str] = Field(default_factory=list)
    """Node of each data-parallel master (`masters.count`), master 0's first; traffic counts are
    every master's, each binned by its own link tier to the worker."""
    master_tp: int = 1
    """Tensor-parallel ranks of each master (`cluster.master_tp`), all on its node."""
    pipeline_stages: int = 1
    """Pipeline stages of each master (`masters.pipeline_stages`), all on its node."""
    stage_bytes: list[int] = Field(default_factory=list)
    """Master 0's frozen backbone bytes by pipeline stage (its layers', the embedding, norm and head; on its device,
    or in host memory when streamed), stage 0's first: one entry without stages."""
    traffic_bytes_by_master: list[int] = Field(default_factory=list)
    """Each master process's expert traffic (all passes), in mesh order (`MasterMesh.ranks`, master 0's first): a
    pipeline stage's is its own layers' rows."""
    placement: PlacementRecord
    links: list[LinkRecord] = Field(default_factory=list)
    # startup_s (from the run's start to its first step), placement_s, train_s, checkpoint_stall_s (per
    # checkpoint), worker_compute_s (per worker)
    timings_s: dict[str, float | list[float]] = Field(default_factory=dict)
    adapter_dir: str | None = None
    report: str | None = None
    checkpoint: str | None = None
    """The last checkpoint written (None: checkpoints off or none written)."""
    allreduce_bytes_per_step: int | None = None
    """Expert-parallel ranks, or data-parallel masters (`masters.count` > 1); None otherwise."""
    sequence_moves: dict[str, int] | None = None
    """`masters.sequence_migration`: the steps' `StepRecord.sequence_moves` summed; None when it is off."""
    control_bytes: int | None = None
    """Expert-parallel baseline only: the [N, E] count exchanges before each all-to-all."""
    data: DataRecord | None = None
    migrations: list[MigrationRecord] = Field(default_factory=list)
    replans: list[ReplanRecord] = Field(default_factory=list)
    recoveries: list[RecoveryRecord] = Field(default_factory=list)
    resumes: list[ResumeRecord] = Field(default_factory=list)
    """Each time the run went on from a checkpoint in a new process; `history` covers every step regardless."""
    run_id: str | None = None
    """The run's identity (`vela_ray.runs`): a resume continues the same run."""
    trackers: dict[str, str] = Field(default_factory=dict)
    """Each tracker of `training.report_to` and where it logged the run, or why it did not
    (`vela_ray.observability.trackers.Trackers.described`)."""
    condensation: CondensationRecord | None = None
    """Token condensation (None: a run from before it existed, or the expert-parallel baseline: exact)."""
    expert_tiers: list[TierCounters] = Field(default_factory=list)
    """APTMoE's CPU/device tiers per worker (`expert_tiers`): experts and rows per tier, uploads,
    predictor accuracy, measured speeds; empty when the tiers are off."""
    streaming: StreamingRecord | None = None
    """Master 0's streamed backbone (`masters.streaming`); None when its layers were resident."""
    paths_relative: bool = False
    """Whether the paths of the run's files (`_paths`) are relative to its dir, as `write` stores them; False in
    memory (`load` resolves them) and in a summary.json written before, whose paths are as the run named them."""

    @property
    def tokens_per_s(self) -> float:
        """Non-padding training tokens per second of step time (what padding waste costs shows here)."""
        seconds = sum(h.step_time_s for h in self.history)
        return sum(h.tokens for h in self.history) / seconds if seconds else 0.0

    @property
    def num_workers(self) -> int:
        return len(self.worker_tiers)

    def tracked(self) -> dict[str, float | str]:
        """What the experiment trackers keep of the run as its final values (`training.report_to`)."""
        values: dict[str, float | str] = {"steps": self.steps, "median_step_time_s": self.median_step_time_s,
                                          "method": self.method}
        if self.losses:
            values["loss"] = self.losses[-1]
        if self.eval_loss is not None:
            values["eval_loss"] = self.eval_loss
        values.update({f"bytes/{tier}": count for tier, count in self.traffic_bytes_by_tier.items()})
        if self.run_id:
            values["run_id"] = self.run_id
        return values

    def write(self, out_dir: str | Path) -> Path:
        """`out_dir/summary.json`, the paths of the run's files (`_paths`) relative to `out_dir` where in it."""
        path = Path(out_dir) / SUMMARY_FILE
        stored = self._paths(partial(_relative_to, Path(out_dir).resolve()), relative=True)
        path.write_text(stored.model_dump_json(indent=1))
        return path

    @classmethod
    def load(cls, run_dir: str | Path) -> RunSummary:
        """The summary of the run in `run_dir`, naming the files in `run_dir`; ValueError if there is none (the run
        did not finish)."""
        path = Path(run_dir) / SUMMARY_FILE
        if not path.is_file():
            raise ValueError(f"{run_dir} has no {SUMMARY_FILE}: give the output.dir of a finished `vela train` run")
        summary = cls.model_validate_json(path.read_text())
        if not summary.paths_relative:  # written before summaries stored them relative: as the run named them
            return summary
        return summary._paths(partial(_resolved_in, Path(run_dir).resolve()), relative=False)

    def _paths(self, convert: Callable[[str | None], str | None], relative: bool) -> RunSummary:
        """A copy with `convert` applied to every path that names a file of the run: the adapter, the report, the
        last checkpoint, the checkpoints it resumed from."""
        resumes = [r.model_copy(update={"checkpoint": convert(r.checkpoint)}) for r in self.resumes]
        return self.model_copy(update={"adapter_dir": convert(self.adapter_dir), "report": convert(self.report),
                                       "checkpoint": convert(self.checkpoint), "resumes": resumes,
                                       "paths_relative": relative})


def _relative_to(run_dir: Path, path: str | None) -> str | None:
    """`path` as summary.json stores it: relative to `run_dir` (resolved) when it lies in it, else absolute; a URI
    on object storage as it is."""
    if path is None or is_remote(path):
        return path
    absolute = Path(path).resolve()
    return absolute.relative_to(run_dir).as_posix() if absolute.is_relative_to(run_dir) else str(absolute)


def _resolved_in(run_dir: Path, path: str | None) -> str | None:
    """A stored path (`_relative_to`) as a path: under `run_dir` when relative."""
    return path if path is None or is_remote(path) else str(run_dir / path)


def step_breakdown(history: list[StepRecord], worker_compute_s: list[float]) -> StepBreakdown | None:
    """Medians over steps: the step, its expert round trips, and the master computing (the step less its idle wait
    on the experts).

    Worker compute (per-step mean per worker) shows how much of the round trips is arithmetic.
    """
    if not history:
        return None
    step = float(np.median([h.step_time_s for h in history]))
    round_trip = float(np.median([h.expert_round_trip_s for h in history]))
    master = float(np.median([h.step_time_s - h.master_idle_s for h in history]))
    per_worker = [s / len(history) for s in worker_compute_s]
    return StepBreakdown(step=step, expert_round_trip=round_trip, master=master,
                         worker_compute_per_worker=per_worker, worker_compute_max=max(per_worker, default=0.0),
                         worker_compute_sum=sum(per_worker))
