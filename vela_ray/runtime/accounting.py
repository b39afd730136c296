"""What a run counts: each step's record (loss, time, tokens, traffic by tier and worker, routing, the
masters' all-reduce and sequence moves) into the history and the metrics, and the run's summary
built from the state at the end (`StepAccounting`).

Master 0 counts its own rows; the other masters' steps hand theirs over (`runtime.masters.peer_step`),
each binned by its own link tiers, and they are added here; so are their condensers' counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vela_ray.config import JobConfig, OutputSection
from vela_ray.data.locality import DriftTracker
from vela_ray.model.condensation import CondenserCounts
from vela_ray.model.traffic import TrafficSnapshot
from vela_ray.observability.metrics import MetricsSink
from vela_ray.runtime.state import EarlierSegments, Live, RunState
from vela_ray.storage import is_remote
from vela_ray.training.worker_report import hosted_bytes_per_expert
from vela_ray.training.preference import metric_means
from vela_ray.training.summary import (
    CondensationRecord, DataRecord, PlacementRecord, RunSummary, StepRecord, StreamingRecord, step_breakdown,
)


@dataclass(frozen=True)
class StepMark:
    """Master 0's counters when a step began."""

    traffic: TrafficSnapshot
    waited_s: float
    idle_s: float
    allreduce_bytes: int


def _counters(live: Live) -> tuple[list[int], list[float]]:
    """Each worker's received bytes and compute seconds so far, from one round of reports (at the start and
    the end of the training: a step's own fan-out answers them, `ExpertWorkers.counters`)."""
    reports = live.workers.reports()
    return [r.received_bytes for r in reports], [r.compute_s for r in reports]


def segment_totals(live: Live, state: RunState) -> EarlierSegments:
    """What this segment of the run counted so far: every master's expert traffic since it started (all
    passes), by link tier and by worker, and the seconds since training began."""
    traffics = [live.master.dispatcher.traffic(), *live.masters.traffic()]
    return EarlierSegments(
        bytes_by_tier=added([t.bytes_by_tier() for t in traffics]),
        bytes_by_worker=np.sum([t.bytes_by_worker() for t in traffics], axis=0).tolist(),
        sent_by_worker=np.sum([t.bytes_by_worker(("dispatch", "grad_dispatch")) for t in traffics], axis=0).tolist(),
        bytes_by_master=[t.total_bytes() for t in traffics],
        train_s=0.0 if state.train_started is None else time.perf_counter() - state.train_started)


def run_file(output: OutputSection, out_dir: Path, name: str) -> str:
    """Where the run's file `name` ends up, as the summary and the closing lines name it: on object storage for
    an `output.dir` there (the run writes a local mirror and uploads it), else in `out_dir`."""
    if is_remote(output.dir):
        return f"{output.dir}/{name}"
    return str((out_dir / name).resolve())


def added(dicts: list[dict[str, int]]) -> dict[str, int]:
    """Key-wise sum (masters' traffic by link tier: each master bins by its own tiers)."""
    total: dict[str, int] = {}
    for d in dicts:
        for key, value in d.items():
            total[key] = total.get(key, 0) + value
    return total


class StepAccounting:
    """Turns each step's counters into a `StepRecord` and metrics; the workers' received bytes and compute
    over the training; the `RunSummary` at the end."""

    def __init__(self, config: JobConfig, state: RunState, metrics: MetricsSink):
        self.config = config
        self.state = state
        self.metrics = metrics
        self.workers_at_start: tuple[list[int], list[float]] = ([], [])  # received bytes, compute seconds
        self._compute_mark: list[float] = []  # the workers' compute seconds at the last tracked step
        # what the hosted ranks' condensers counted in this segment's steps (master 0's condenser counts its own)
        self.peers_condensed = CondenserCounts()

    def begin_training(self, live: Live) -> None:
        """The workers' counters now (again after a recovery: new workers count from zero)."""
        self.workers_at_start = _counters(live)
        self._compute_mark = list(self.workers_at_start[1])

    def end_training(self, live: Live) -> None:
        (received, compute), (received_0, compute_0) = _counters(live), self.workers_at_start
        self.state.received_bytes = [a - b for a, b in zip(received, received_0)]
        self.state.timings_s["worker_compute_s"] = [a - b for a, b in zip(compute, compute_0)]

    @staticmethod
    def begin_step(live: Live) -> StepMark:
        dispatcher = live.master.dispatcher
        return StepMark(dispatcher.traffic(), sum(dispatcher.round_trip_s.values()), dispatcher.activity.idle_s,
                        live.masters.replicas.grad_bytes)

    def end_step(self, live: Live, mark: StepMark, step: int, loss: float, step_time_s: float, tokens: int,
                 peer_steps: list[dict], drift: DriftTracker | None) -> StepRecord:
        """Step `step`'s record (1-based), from master 0's counters since `mark` and the other masters'
        `peer_step` records; sent to the metrics."""
        dispatcher = live.master.dispatcher
        own = dispatcher.traffic() - mark.traffic
        traffic = [own, *(p["traffic"] for p in peer_steps)]  # each master's rows, by its own link tiers
        counts_LE = np.sum([t.routed_LE for t in traffic], axis=0)  # every master's routing
        self.state.add_routed(counts_LE)
        self.peers_condensed = sum((p["condensation"] for p in peer_steps if p["condensation"] is not None),
                                   self.peers_condensed)
        drift_L = drift.record_step(counts_LE) if drift else None
        sums = live.masters.step_sums(peer_steps)
        record = StepRecord(step=step, loss=loss, step_time_s=step_time_s, tokens=tokens,
                            expert_round_trip_s=sum(dispatcher.round_trip_s.values()) - mark.waited_s,
                            master_idle_s=dispatcher.activity.idle_s - mark.idle_s,
                            bytes_by_tier=added([own.bytes_by_tier(), *[p["bytes_by_tier"] for p in peer_steps]]),
                            bytes_by_worker=sum(traffic[1:], own).bytes_by_worker(),
                            allreduce_bytes=live.masters.replicas.grad_bytes - mark.allreduce_bytes,
                            sequence_moves=self._sequence_moves(live, peer_steps),
                            routing_drift=None if drift_L is None else [round(float(d), 5) for d in drift_L],
                            preference=None if sums is None else metric_means(sums))
        self.metrics.record_step(step, loss, step_time_s, tokens=tokens, traffic_delta=traffic,
                                 expert_counts_LE=counts_LE, drift_L=drift_L)
        if record.sequence_moves is not None:
            self.metrics.record_sequence_moves(record.sequence_moves)
        return record

    def tracked(self, live: Live, record: StepRecord, lr: float) -> dict[str, float | None]:
        """What the trackers log for `record` (`training.report_to`): loss, lr, gradient norm, non-padding
        tokens per second, the step's time and its parts, bytes per link tier, the placement version and the
        eval loss when there is one. The workers' compute is what their step answered (`ExpertWorkers.counters`):
        no round trip of its own."""
        compute = [counters.compute_s for counters in live.workers.counters]
        mark, self._compute_mark = self._compute_mark or compute, compute
        worker_s = max((a - b for a, b in zip(compute, mark)), default=0.0)
        values: dict[str, float | None] = {
            "train/loss": record.loss, "train/lr": lr, "train/grad_norm": live.master.grad_norm,
            "train/tokens_per_s": record.tokens / record.step_time_s if record.step_time_s > 0 else None,
            "time/step_s": record.step_time_s, "time/expert_round_trip_s": record.expert_round_trip_s,
            "time/master_s": record.step_time_s - record.master_idle_s, "time/worker_compute_max_s": worker_s,
            "placement/version": self.state.version, "eval/loss": record.eval_loss,
        }
        values.update({f"bytes/{tier}": count for tier, count in record.bytes_by_tier.items()})
        values.update({f"train/{name}": value for name, value in (record.preference or {}).items()})
        values.update({f"eval/{name}": value for name, value in (record.eval_preference or {}).items()})
        if live.masters.num_masters > 1:
            values["bytes/allreduce"] = record.allreduce_bytes
        return values

    @staticmethod
    def _sequence_moves(live: Live, peer_steps: list[dict]) -> dict[str, int] | None:
        """This step's sequence migration, summed over the masters; None when it is off."""
        if live.migration is None:
            return None
        return added([live.migration.take_stats().as_dict(), *(p["sequence_moves"] for p in peer_steps)])

    def summary(self, live: Live, master_node: str, out_dir: Path) -> RunSummary:
        """The run's summary; a resumed run's totals and training time count its earlier segments too."""
        state, config, dispatcher = self.state, self.config, live.master.dispatcher
        totals = state.earlier.plus(segment_totals(live, state))
        timings = {**state.timings_s, **({"train_s": state.timings_s["train_s"] + state.earlier.train_s}
                                         if "train_s" in state.timings_s else {})}
        history, routed = state.history, state.tokens_routed_LE
        reports = live.workers.reports()
        return RunSummary(
            mode="vela", method=config.training.method, zo_parameters=config.training.zo.parameters,
            row_format=config.data_plane.row_format,
            data_plane=live.hosted.transport.describe(), family_check=config.family_check,
            quantization=quantization_label(config.model.quantization),
            objective=objective_label(config.training.preference),
            bytes_per_expert=hosted_bytes_per_expert(reports) if any(r.num_experts for r in reports) else None,
            steps=len(history), losses=[h.loss for h in history],
            eval_loss=history[-1].eval_loss if history else None,
            median_step_time_s=float(np.median([h.step_time_s for h in history])) if history else 0.0,
            history=history, step_breakdown_s=step_breakdown(history, state.timings_s.get("worker_compute_s", [])),
            traffic_bytes_by_tier=totals.bytes_by_tier, traffic_bytes_by_worker=totals.bytes_by_worker,
            sent_bytes_by_worker=totals.sent_by_worker, traffic_bytes_by_master=totals.bytes_by_master,
            worker_received_bytes=state.received_bytes,
            tokens_routed=[] if routed is None else routed.astype(int).tolist(),
            worker_tiers=list(dispatcher.traffic().worker_tiers), worker_nodes=live.hosted.node_ids,
            master_node=master_node,
            master_nodes=live.masters.nodes, master_tp=config.cluster.master_tp,
            pipeline_stages=config.masters.pipeline_stages, stage_bytes=live.masters.stage_bytes(),
            allreduce_bytes_per_step=history[-1].allreduce_bytes if live.masters.num_masters > 1 and history else None,
            sequence_moves=None if live.migration is None else added([h.sequence_moves or {} for h in history]),
            placement=PlacementRecord.of(state.plan, state.problem, config.placement.cost_model),
            links=state.links, timings_s=timings,
            adapter_dir=run_file(config.output, out_dir, "adapter"),
            checkpoint=None if state.last_checkpoint is None else str(state.last_checkpoint),
            data=DataRecord.of(config.data, live.backbone.train_set),
            migrations=state.migrations, replans=state.replans, recoveries=state.recoveries, resumes=state.resumes,
            run_id=None if state.identity is None else state.identity.run_id,
            condensation=CondensationRecord.of(dispatcher.condenser, self.peers_condensed),
            expert_tiers=[report.tiers for report in reports if report.tiers is not None],
            streaming=StreamingRecord.of(live.master.stream),
            report=run_file(config.output, out_dir, "report.html"),
        )


def objective_label(section) -> str:
    """"dpo (sigmoid, beta 0.1)": `training.preference`'s objective and its settings; "sft" for supervised."""
    if not section.on:
        return "sft"
    return f"{section.objective} ({'+'.join(section.losses)}, beta {section.beta:g})"


def quantization_label(section) -> str | None:
    """"nf4: experts, backbone": `model.quantization`'s format and what it holds in it; None when it is off."""
    if not section.on:
        return None
    return f"{section.format}: " + ", ".join(part for part in ("experts", "backbone") if getattr(section, part))
