"""Preflight: a job checked against its files in the driver, before Ray starts.

    checked = JobConfig.from_yaml("job.yaml").preflight()   # ValueError: one line, field or file + fix
    run(checked.config)                                      # resume pinned to `checked.resume`
    ...after ray.init: check_cluster_resources(config.cluster, ray.available_resources())

Everything a MasterActor would otherwise find 30 s into a run, behind a Ray
traceback, is found here in a second or two: unreadable weights, data that is
empty or malformed or too short for one batch, a `seq_len` past the model's
positions, a placement file or profile for another shape, an initial adapter of
another rank or model, a resume that cannot happen, an
output directory that cannot be written or that another run holds. Preflight holds
`output.dir` (`runs.hold_output_dir`) from its checks of the resume point on: it
writes nothing but one probe file that it deletes, and only after every other check
passed, so a refused job leaves `output.dir` as it was; the one move it may make is
of a corrupt checkpoint that `--resume latest` skips (`checkpoint.set_aside`).

The heavy imports (torch, transformers) are inside the functions, so
`check_cluster_resources` stays a pure function a caller can import cheaply.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vela_ray.errors import first_line
from vela_ray.runs import check_output_dir, check_same_math, hold_output_dir
from vela_ray.storage import is_remote

if TYPE_CHECKING:
    from vela_ray.config import (
        CheckpointSection, ClusterSection, JobConfig, LoraSection, ModelSection, OutputSection, PlacementSection,
        TrainingSection,
    )
    from vela_ray.data.config import DataConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFacts:
    """What the checks need to know of `model.path`, read without loading weights."""

    model_type: str
    num_layers: int
    num_experts: int
    max_positions: int | None


@dataclass(frozen=True)
class Preflight:
    """A checked job. Run `config`: its `checkpoint.resume` is `resume`, the verified directory."""

    config: JobConfig
    model: ModelFacts
    train_rows: int
    resume: Path | None = None
    resume_step: int = 0

    @property
    def family(self) -> str | None:
        """How the model's family was verified equal to peft (`FamilyCheck.describe`), pinned in `config`."""
        return self.config.family_check


def preflight(config: JobConfig) -> Preflight:
    """All checks, cheapest first; the only write (the output dir probe) comes last. From the resume point on
    `output.dir` is held: a run going on there now is refused before anything is moved or written."""
    check_trackers(config.training)
    model = check_model(config.model)
    check_quantization(config.model)
    check_capacity(config.placement, config.cluster, model)
    check_seq_len(config.data, config.model.path, model)
    check_placement_file(config.placement, config.cluster, model)
    check_profile_file(config.placement, config.model.path, model)
    check_lora_options(config.lora, config.model)
    check_master_tp(config)
    check_pipeline(config)
    check_init_adapter(config.lora, config.model)
    check_packing(config.data, config.model)
    train_rows = check_data(config)
    with hold_output_dir(config.output_local_dir, config.output.dir):
        resume, resume_step = check_resume(config, model)  # `latest` sets a corrupt newer checkpoint aside
        family = check_family(config.model)  # seconds, and only for a family the test suite did not verify
        check_output_dirs(config.output, config.checkpoint, resume)
    from vela_ray.training.checkpoint import source_of

    # pinned where every node finds it: a checkpoint on object storage by its URI, not this machine's copy
    pinned = (config.with_resume(source_of(resume)) if resume else config).with_family_check(family)
    return Preflight(config=pinned, model=model, train_rows=train_rows, resume=resume, resume_step=resume_step)


def check_trackers(training: TrainingSection) -> None:
    """Every tracker of `training.report_to` is installed, else one line with the extra that installs it; and can
    log here (`config.tracker_problem`: MLflow's store, W&B's key or offline mode), else one line with the fix."""
    from vela_ray.config import missing_tracker_packages, tracker_problem

    problem = missing_tracker_packages(training.report_to) or tracker_problem(training.report_to)
    if problem:
        raise ValueError(problem)


# --- model ------------------------------------------------------------------------------


def check_model(model: ModelSection) -> ModelFacts:
    """config.json, readable safetensors headers, MoE blocks: what every actor will load."""
    from transformers import AutoConfig

    from vela_ray.model.loading import moe_layout

    model_dir = model.path
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model.path {model_dir}: no config.json; point it at a save_pretrained directory")
    check_weights(model_dir)
    try:
        num_layers, num_experts = moe_layout(model_dir, model.trust_remote_code)
        text_config = AutoConfig.from_pretrained(str(model_dir)).get_text_config()
    except (ValueError, OSError, KeyError, ImportError) as err:
        if "trust_remote_code" in str(err) and not model.trust_remote_code:
            raise ValueError(f"model.path {model_dir}: the model comes with its own code (config.json's auto_map); "
                             "set model.trust_remote_code: true to run it (preflight then checks its math against "
                             "peft)") from None
        raise ValueError(f"model.path {model_dir}: {first_line(err)}") from None
    return ModelFacts(model_type=text_config.model_type, num_layers=num_layers, num_experts=num_experts,
                      max_positions=getattr(text_config, "max_position_embeddings", None))


def check_quantization(model: ModelSection) -> None:
    """A checkpoint shipped quantized is one vela-ray reads, whole (every scale there, shaped as its blocks need),
    and trained as shipped or dequantized; `model.quantization` quantizes every expert stack into whole blocks of
    its format. One line naming the tensor, stack or setting otherwise (`vela_ray.model.shipped`)."""
    from vela_ray.model.experts import lora_in_out, weight_stacks
    from vela_ray.model.loading import checkpoint_prototypes
    from vela_ray.model.quantization import FORMATS
    from vela_ray.model.shipped import check_shipped

    try:
        shipped = check_shipped(model.path)
    except ValueError as err:
        raise ValueError(first_line(err)) from None
    wanted = model.quantization
    if shipped is not None and wanted.format not in ("none", shipped):
        raise ValueError(f"model.quantization.format: {wanted.format}, but {model.path} is shipped in {shipped}: "
                         f"set {shipped} to train it as shipped, or none to dequantize it")
    if not (wanted.on and wanted.experts) or wanted.format == shipped:
        return
    fmt = FORMATS[wanted.format]
    for layer, experts in checkpoint_prototypes(model.path, model.trust_remote_code).items():
        for stack in weight_stacks(experts):
            in_features, out_features = lora_in_out(experts, stack)
            why = fmt.unfit((out_features, in_features))
            if why:
                raise ValueError(f"model.quantization.format: {wanted.format} cannot hold {type(experts).__name__}."
                                 f"{stack} of MoE layer {layer}: {why}; use fp8 or int8, or experts: false")


def check_family(model: ModelSection) -> str:
    """The model's family verified equal to peft: by the test suite, or now on a debug-size copy of its
    architecture (`vela_ray.training.family_check`); refused in one line where vela-ray's numbers differ."""
    from transformers import AutoConfig

    from vela_ray.training.family_check import check_family as verify

    try:
        return verify(AutoConfig.from_pretrained(str(model.path))).describe()
    except ValueError as err:
        raise ValueError(f"model.path {model.path}: {first_line(err)}") from None


def check_weights(model_dir: Path) -> None:
    """Every safetensors file's header reads (a truncated download fails here, by name), and a
    sharded checkpoint's index names only files that exist. Headers only: no tensor is read."""
    import json

    from safetensors import SafetensorError, safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.path {model_dir}: config.json but no *.safetensors weights; save the model "
                         "with save_pretrained(..., safe_serialization=True)")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"model.path: {index} is not a safetensors index ({first_line(err)}); download "
                             "the checkpoint again") from None
        missing = sorted(shards - {f.name for f in files})
        if missing:
            raise ValueError(f"model.path {model_dir}: {index.name} lists missing shards {missing[:3]}; "
                             "download the checkpoint again")
    for file in files:
        try:
            with safe_open(str(file), "numpy") as f:
                f.keys()
        except (SafetensorError, OSError) as err:
            raise ValueError(f"model.path: {file} is not a readable safetensors file ({first_line(err)}); "
                             "download or save it again") from None


def check_capacity(placement: PlacementSection, cluster: ClusterSection, model: ModelFacts) -> None:
    """`placement.capacity` slots on every worker hold all of the model's experts."""
    capacity, workers = placement.capacity, cluster.num_workers
    total = model.num_layers * model.num_experts
    if capacity is not None and capacity * workers < total:
        raise ValueError(
            f"placement.capacity {capacity} x cluster.num_workers {workers} holds {capacity * workers} experts "
            f"but the model has {model.num_layers}x{model.num_experts}={total}: need {total - capacity * workers} "
            "more expert slots (raise capacity or add workers)")


def check_seq_len(data: DataConfig, model_dir: Path, model: ModelFacts) -> None:
    """Rows longer than the model's positions train on positions it never learned (or index past RoPE);
    `model_dir` (`model.path`) is named in the message."""
    seq_len, limit = data.seq_len, model.max_positions
    if limit is not None and seq_len > limit:
        raise ValueError(f"data.seq_len {seq_len} exceeds the model's max_position_embeddings {limit} "
                         f"({model_dir / 'config.json'}); set data.seq_len to at most {limit}")


def check_placement_file(placement: PlacementSection, cluster: ClusterSection, model: ModelFacts) -> None:
    """A `solver: file` placement must be for this model's layers x experts and this worker count."""
    from placement import Placement

    file = placement.file
    if placement.solver != "file" or file is None:
        return
    try:
        plan = Placement.from_json(file)
    except (ValueError, OSError, KeyError) as err:
        raise ValueError(f"placement.file {file} is not a placement JSON ({first_line(err)}); "
                         "write one with `vela place --out`") from None
    layers, experts, workers = plan.shape
    wanted = (model.num_layers, model.num_experts, cluster.num_workers)
    if (layers, experts, workers) != wanted:
        raise ValueError(
            f"placement.file {file} places {layers}x{experts} experts on {workers} workers, but this job has "
            f"{wanted[0]}x{wanted[1]} (model.path) on {wanted[2]} (cluster.num_workers); solve again with "
            "`vela place` for this job or match cluster.num_workers")


def check_profile_file(placement: PlacementSection, model_dir: Path, model: ModelFacts) -> None:
    """A `placement.profile` file must give one probability per expert of every MoE layer of the model
    (`model_dir`, `model.path`, which the fix profiles)."""
    from placement.io import load_profile

    path = placement.profile
    if not isinstance(path, Path):
        return
    try:
        probs, _ = load_profile(path)
    except ValueError as err:
        raise ValueError(f"placement.profile: {first_line(err)}; write one with `vela profile`") from None
    wanted = (model.num_layers, model.num_experts)
    if probs.shape != wanted:
        raise ValueError(
            f"placement.profile {path} is {probs.shape[0]}x{probs.shape[1]} (layers x experts) but model.path "
            f"has {wanted[0]}x{wanted[1]}; profile this model with `vela profile --model {model_dir}`")


def check_lora_options(lora: LoraSection, model: ModelSection) -> None:
    """The `lora` section against the model's architecture (a meta-device skeleton): a target module, expert
    stack or rank/alpha pattern that matches nothing, or a router as a LoRA target where it is no linear layer
    (`adapters.check_lora_targets`)."""
    if lora == type(lora)(init_adapter=lora.init_adapter, r=lora.r, alpha=lora.alpha):
        return  # the paper's targets, which every verified family supports
    from vela_ray.model.adapters import check_lora_targets
    from vela_ray.model.loading import meta_model

    try:
        check_lora_targets(meta_model(model.path, model.trust_remote_code), lora.spec())
    except ValueError as err:  # its messages name the lora field
        raise ValueError(first_line(err)) from None


def check_master_tp(config: JobConfig) -> None:
    """With `cluster.master_tp` > 1, the master's model (a meta-device skeleton with the job's backbone LoRA) must
    split exactly over that many ranks: head counts and MLP widths divisible, no cross-head norm (OLMoE), no
    LoRA variant whose sharded math differs, experts called on routed rows (`tensor_parallel.check_tensor_parallel`)."""
    tp = config.cluster.master_tp
    if tp == 1:
        return
    from peft import get_peft_model

    from vela_ray.model.adapters import backbone_lora_config, full_lora_config
    from vela_ray.model.loading import meta_model
    from vela_ray.model.modeling import find_moe_blocks
    from vela_ray.model.tensor_parallel import check_tensor_parallel, refuse_grouped_experts

    model = meta_model(config.model.path, config.model.trust_remote_code)
    refuse_grouped_experts([b.layout for b in find_moe_blocks(model)], tp)
    try:
        check_tensor_parallel(get_peft_model(model, backbone_lora_config(full_lora_config(model, config.lora_spec))),
                              tp)
    except ValueError as err:
        raise ValueError(f"cluster.master_tp: {tp} cannot split this model: {first_line(err)}") from None


def check_pipeline(config: JobConfig) -> None:
    """With `masters.pipeline_stages` > 1, every stage holds a layer and the loss is one the last stage computes
    alone (`pipeline.check_stages`)."""
    if config.masters.pipeline_stages == 1:
        return
    from transformers import AutoConfig

    from vela_ray.training.pipeline import check_stages

    text_config = AutoConfig.from_pretrained(str(config.model.path),
                                             trust_remote_code=config.model.trust_remote_code).get_text_config()
    check_stages(text_config, config.masters.pipeline_stages)


def check_init_adapter(lora: LoraSection, model: ModelSection) -> None:
    """`lora.init_adapter` must be a peft adapter of this model's experts, with the job's LoRA options."""
    from peft import LoraConfig
    from transformers import AutoConfig

    from vela_ray.model.adapters import check_adapter_matches, read_adapter

    adapter = lora.init_adapter
    if adapter is None:
        return
    try:
        model_config = AutoConfig.from_pretrained(str(model.path))
        lora_config, _, _ = read_adapter(adapter, model_config)
        job = LoraConfig(r=lora.r, lora_alpha=lora.alpha, use_rslora=lora.use_rslora, rank_pattern=lora.rank_pattern,
                         alpha_pattern=lora.alpha_pattern, modules_to_save=lora.modules_to_save or None)
        check_adapter_matches(lora_config, job, adapter)
    except (ValueError, OSError, KeyError) as err:
        raise ValueError(f"lora.init_adapter: {first_line(err)}") from None


# --- data -------------------------------------------------------------------------------


def check_packing(data: DataConfig, model: ModelSection) -> None:
    """`data.packing` only where packed examples stay apart in this model's architecture (probed on a
    debug-size copy, `vela_ray.data.examples.check_packing`)."""
    if not data.packing:
        return
    from transformers import AutoConfig

    from vela_ray.data.examples import check_packing as probe

    probe(AutoConfig.from_pretrained(str(model.path)), f"model.path {model.path}")


PREFLIGHT_SAMPLE_RECORDS = 256  # records of a ray.data.Dataset the driver reads to check their format


def check_data(config: JobConfig) -> int:
    """Build the data set exactly as the master does (tokenizer, build, split) and return the
    training rows; refuse data that is empty, malformed, or too short for one batch."""
    from transformers import AutoTokenizer

    from vela_ray.data.datasets import build_dataset

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(config.model.path))
    except (ValueError, OSError) as err:
        raise ValueError(f"model.path {config.model.path}: no usable tokenizer ({first_line(err)}); save it "
                         "next to the model with tokenizer.save_pretrained") from None
    training, data = config.training, config.data
    sampled = data.records is not None  # a ray.data.Dataset: checked on a sample, the master reads it all
    if sampled:
        data = data.with_records(data.records.limit(PREFLIGHT_SAMPLE_RECORDS))
    try:
        train, _ = build_dataset(data, tokenizer).split(training.eval_fraction, training.seed)
    except UnicodeDecodeError as err:
        raise ValueError(f"data.path {config.data.path}: not UTF-8 text ({err.reason} at byte {err.start})") \
            from None
    except ValueError as err:
        raise ValueError(f"data: {first_line(err)}") from None
    check_kto_rows(config, train)
    examples = train.num_examples  # a preference pair is one example of two rows
    if examples < training.batch_size and not sampled:
        raise ValueError(
            f"training.batch_size {training.batch_size} exceeds the {examples} training examples of data.path "
            f"{config.data.path} (seq_len {config.data.seq_len}, eval_fraction {training.eval_fraction} held "
            f"out); lower training.batch_size to at most {examples} or use more data")
    return examples


def check_kto_rows(config: JobConfig, train) -> None:
    """KTO's KL baseline borrows each example's answer whole for another prompt (`preference.mismatched_rows`): a
    row cut at seq_len no longer holds it, so TRL's KL sequence could not be rebuilt. Refused, not approximated."""
    stats, preference = train.stats, config.training.preference
    if preference.objective != "kto" or preference.losses != ("kto",) or stats is None or not stats.truncated:
        return
    raise ValueError(f"data: {stats.truncated} examples are longer than data.seq_len {config.data.seq_len} (the "
                     f"longest {stats.longest} tokens): KTO's KL baseline pairs each prompt with another example's "
                     "whole answer, which a cut row no longer holds; raise data.seq_len to "
                     f"{stats.longest}, or use training.preference.loss_type apo_zero_unpaired (no KL baseline)")


# --- resume -----------------------------------------------------------------------------


def check_resume(config: JobConfig, model: ModelFacts) -> tuple[Path | None, int]:
    """(checkpoint, its step) to continue from, fully verified; (None, 0) for a fresh run.

    Refuses a checkpoint of another model or LoRA config, and one that already reached
    `training.steps` (the run is complete: there is nothing to continue). A `training.steps` other than the
    run's recomputes a decaying schedule over the new total: said in one line, with what it does."""
    from vela_ray.training import checkpoint
    from vela_ray.training.schedule import schedule_change

    spec = config.checkpoint.resume
    if spec is None:
        return None, 0
    path = checkpoint.resolve(spec, config.checkpoint_root)
    manifest = checkpoint.verify(path, checksums=False)  # resolve checked the checksums
    expected = {"model_type": model.model_type, "moe_layers": model.num_layers, "experts": model.num_experts,
                "lora_r": config.lora.r, "lora_alpha": config.lora.alpha}
    try:
        checkpoint.check_compatible(manifest, expected, path)
    except ValueError as err:
        raise ValueError(f"checkpoint.resume (--resume): {err}; resume a checkpoint of this job") from None
    saved_run = checkpoint.read_run(path)
    if saved_run is not None:
        check_same_math(saved_run["math"], config.model_dump(mode="json"), path)
    step, steps = int(manifest["step"]), config.training.steps
    if step >= steps:
        raise ValueError(f"checkpoint.resume (--resume): {path} is at step {step}: the run is complete at step "
                         f"{step} (training.steps {steps}); raise training.steps above {step} to continue")
    logger.info("will resume from %s (step %d of %d)", path, step, steps)
    planned = checkpoint.read_trainer(path).get("total_steps")
    if planned and (change := schedule_change(config.training.optimizer, step, planned, steps)):
        logger.warning(change)
    return path.resolve(), step


# --- output -----------------------------------------------------------------------------


def check_output_dirs(output: OutputSection, checkpoint: CheckpointSection, resume: Path | None) -> None:
    """output.dir holds no other run (`check_output_free`), and it (and checkpoint.dir when set apart) can be
    created and written."""
    check_output_free(output, resume)
    if not is_remote(output.dir):
        check_writable(output.dir, "output.dir")
    if is_remote(checkpoint.dir):
        check_remote_writable(checkpoint.dir, "checkpoint.dir")
    elif checkpoint.dir is not None:
        check_writable(checkpoint.dir, "checkpoint.dir")


def check_output_free(output: OutputSection, resume: Path | None) -> None:
    """output.dir holds no run but the one resumed from checkpoint `resume` (`runs.check_output_dir`; on object
    storage `check_remote_output`). Preflight checks it, and the run again once it holds output.dir
    (`VelaJob.run`, an in-process `JobRunner`): a run that ended there in between is found before any write."""
    from vela_ray.training import checkpoint

    resumed_run = checkpoint.read_run(resume) if resume else None
    resumed_id = resumed_run["run_id"] if resumed_run else None
    if is_remote(output.dir):
        check_remote_output(output.dir, output.overwrite, resume is not None, resumed_id)
    else:
        check_output_dir(output.dir, output.overwrite, resume is not None, resumed_id)


def check_remote_output(uri: str, overwrite: bool, resuming: bool, resumed_run: str | None) -> None:
    """`output.dir` on object storage: writable with the environment's credentials, and holding no other run
    (as `runs.check_output_dir` for a directory; moving a run aside there is not offered)."""
    from vela_ray.runs import RUN_ARTEFACTS, RUN_FILE, RunIdentity, other_run

    remote = check_remote_writable(uri, "output.dir")
    names = set(remote.dirs()) | {name.split("/")[0] for name in remote.files()}
    if not names & set(RUN_ARTEFACTS):
        return
    there = RunIdentity.model_validate_json(remote.read_bytes(RUN_FILE)) if remote.exists(RUN_FILE) else None
    which = other_run(there, resuming, resumed_run)
    if which is None:
        return
    fix = "; output.overwrite moves local directories only" if overwrite else ""
    raise ValueError(f"output.dir {uri} holds {which}; this job would mix with it: resume it with `--resume latest` "
                     f"or choose another output.dir{fix}")


def check_remote_writable(uri: str, field: str):
    """A probe object written and deleted under `uri`: the bucket exists and the environment's credentials may
    write there, found now rather than at the first checkpoint."""
    from vela_ray.storage import Remote, check_uri

    check_uri(uri, field)
    try:
        remote = Remote(uri)
        probe = f".vela-preflight-{os.getpid()}"
        remote.write_bytes(probe, b"")
        remote.delete(probe)
    except (OSError, ValueError) as err:
        raise ValueError(f"{field} {uri}: cannot write there ({first_line(err)}); check the bucket and the "
                         "credentials in the environment (e.g. AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL)") from None
    return remote


def check_writable(directory: Path, field: str) -> None:
    """Create `directory` and a probe file in it, then delete both: preflight leaves nothing behind (the run
    creates the directory when it starts, after the cluster's checks too)."""
    probe = directory / f".vela-preflight-{os.getpid()}"
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{field} {directory} is a file, not a directory; choose a directory for {field}")
    created = [d for d in (directory, *directory.parents) if not d.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"{field} {directory} cannot be created or written ({err.strerror or err}); "
                         f"choose a writable directory for {field}") from None
    finally:
        for made in created:  # deepest first
            with contextlib.suppress(OSError):
                made.rmdir()


# --- cluster ----------------------------------------------------------------------------


def check_cluster_resources(cluster: ClusterSection, available: dict[str, float]) -> None:
    """The Ray cluster can hold the workers the job asks for; else name the shortage and the fix.

    Call right after connecting, with `ray.available_resources()` (or, for a local Ray,
    what the machine has): without it Ray leaves the actors pending for minutes and
    then blames CPUs even when GPUs are what is missing. Pure: no Ray import.
    """
    workers = cluster.num_worker_actors
    gpus_needed, gpus = workers * cluster.num_gpus_per_worker, float(available.get("GPU", 0.0))
    if gpus_needed > gpus:
        raise ValueError(
            f"cluster.num_gpus_per_worker {cluster.num_gpus_per_worker} x cluster.num_workers {workers} needs "
            f"{gpus_needed} GPUs but the Ray cluster has {gpus:g}; set cluster.num_gpus_per_worker: 0 to train "
            "on CPUs, lower cluster.num_workers, or add GPU nodes")
    cpus_needed, cpus = workers * cluster.num_cpus_per_worker, float(available.get("CPU", 0.0))
    if cpus_needed > cpus + 1e-9:
        raise ValueError(
            f"cluster.num_workers {workers} x cluster.num_cpus_per_worker {cluster.num_cpus_per_worker:g} needs "
            f"{cpus_needed:g} CPUs but the Ray cluster has {cpus:g}; lower cluster.num_cpus_per_worker or "
            "cluster.num_workers, or add nodes")


def master_gpus(cluster: ClusterSection, available: dict[str, float], node: dict[str, float] | None = None,
                node_name: str = "the driver's node", stages: int = 1) -> int:
    """The master's GPU count: `cluster.master_gpus`, or 1 when a GPU the workers leave free is on `node`.

    `node` is the resources of the driver's node, where the master is pinned: a GPU elsewhere in the
    cluster is no use to it, and asking for one the node lacks leaves the actor pending forever. None
    counts the cluster only. `stages`: `masters.pipeline_stages`, each of `cluster.master_tp` ranks. Call after
    `check_cluster_resources`; ValueError if an explicit 1 does not fit. Pure: no Ray.
    """
    ranks = cluster.master_tp * stages  # a GPU per rank and stage, all on the master's node
    worker_gpus = cluster.num_worker_actors * cluster.num_gpus_per_worker
    spare = float(available.get("GPU", 0.0)) - worker_gpus
    node_gpus = float(node.get("GPU", 0.0)) if node is not None else spare
    if cluster.master_gpus is None:
        return 1 if min(spare, node_gpus) >= ranks else 0
    wanted = cluster.master_gpus * ranks
    asks = (f"cluster.master_gpus {cluster.master_gpus}" + (f" x cluster.master_tp {cluster.master_tp}"
            if cluster.master_tp > 1 else "") + (f" x masters.pipeline_stages {stages}" if stages > 1 else ""))
    if wanted > spare:
        raise ValueError(f"{asks} needs {f'{wanted} GPUs' if wanted > 1 else 'a GPU'} beyond the workers' "
                         f"{worker_gpus}, but the Ray cluster has {float(available.get('GPU', 0.0)):g}; "
                         "set cluster.master_gpus: 0 or free a GPU")
    if wanted > node_gpus:
        raise ValueError(f"{asks}: the MasterActor " + master_unschedulable(node_name, node or {}, wanted))
    return cluster.master_gpus


def master_unschedulable(node_name: str, node: dict[str, float], gpus: int) -> str:
    """The end of a one-line error for a master that cannot run on the driver's node (the caller names
    the master first): what the node has, what the master asks for, the fix."""
    return (f"is pinned to the driver's node {node_name}, which has {float(node.get('GPU', 0.0)):g} GPUs and "
            f"{float(node.get('CPU', 0.0)):g} CPUs, and asks for {gpus} GPU and 0 CPUs; run the driver on a "
            "node with a free GPU, or set cluster.master_gpus: 0")
