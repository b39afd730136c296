"""`vela export`: serve what you trained, from a finished run or any verified checkpoint.

    export_run("runs/job", "merged", "serve/job-merged")       # or vela export runs/job --format merged --out ...

Formats (`FORMATS`):
- `peft`: the adapter as training writes it (peft's fused layout: `target_parameters` on the 3-D expert
  stacks); from a checkpoint, the checkpoint's state, so an interrupted run exports too.
- `merged`: the base model with every LoRA delta folded in, in the base checkpoint's own layout, names,
  dtype and shards (`vela_ray.model.merging`); loads with `from_pretrained`. A run on quantized frozen weights
  (`model.quantization`) is merged into what it computed with: those weights dequantized, then the delta; a
  checkpoint shipped quantized (FP8, MXFP4) into its dequantized bf16 copy.
- `per-expert`: the adapter with its expert factors under the checkpoint's per-expert module names
  (`experts.{e}.w1`, `experts.{e}.gate_proj`, ...), as serving engines load MoE LoRA; where the checkpoint
  stores its experts fused (gpt-oss, Qwen3.5-MoE), the fused adapter, and the note says so. Either way at
  one rank and one lora_alpha / r, each module's own scale baked into its B (rank and alpha patterns, rsLoRA),
  and with its targets as a list of module names (`vela_ray.model.merging.serving_adapter`).

A run of full-parameter ZO (`training.zo.parameters: full`) trained every weight, not only its adapter: `merged`
first rebuilds its base weights by replaying the run's trajectory (`stepper.json`, or a checkpoint's `trainer.json`)
onto the base checkpoint loaded in the run's `model.dtype` (`_replayed_base`, MeZO's seed trick), then merges the
adapter into those, written in that dtype and transformers' own layout; `peft` and `per-expert` are refused.

Where vLLM cannot take an export as trained, one warning line names the export it can take
(`_warn_for_vllm`): it refuses `modules_to_save` (a trained router: --format merged), and applies one
lora_alpha / r to every module (a peft export with rank/alpha patterns: --format per-expert or merged).

What is exported (`locate`): a run dir's `adapter/`; a run dir without one (interrupted), its newest
verified checkpoint; a checkpoint dir (`step-*`), after its checksums pass. Bad input is one ValueError
line: no adapter, a corrupt checkpoint, a format the family cannot take and why, an output dir that is not
empty (unless `force`) or that is, holds or lies inside what the export reads (the run, its adapter,
checkpoints and records, the base model: `check_out_apart`), too little disk for a merged model (checked
before writing).

Nothing at `out` is touched until the export is whole: it is written into a sibling dir that then takes
`out`'s place (`_staged`), so a failing export leaves `out` as it was, and `force` replaces it only then.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

from peft import LoraConfig
from safetensors.torch import save_file

from vela_ray.config import LoraSection
from vela_ray.model.adapters import ADAPTER_FILE, export_adapter, full_lora_config
from vela_ray.model.loading import meta_model, moe_layout, register_model_code
from vela_ray.model.merging import (
    checkpoint_files, merge_checkpoint, merge_in_place, plan_merge, plan_round_trips, serving_adapter,
)
from vela_ray.runs import RUN_ARTEFACTS
from vela_ray.training import checkpoint

logger = logging.getLogger(__name__)

Format = Literal["peft", "merged", "per-expert"]
FORMATS: tuple[str, ...] = ("peft", "merged", "per-expert")
# Families whose serving engine takes MoE LoRA in peft's fused layout (`target_parameters` on the 3-D stacks)
# whatever the checkpoint stores: `per-expert` writes that layout for them, and says so.
SERVED_FUSED = {"gpt_oss": "vLLM", "qwen3_5_moe": "vLLM", "qwen3_5_moe_text": "vLLM"}


@dataclass(frozen=True)
class Trained:
    """What a run dir or checkpoint holds to export."""

    model_dir: Path  # the base checkpoint the run trained
    adapter_dir: Path | None  # its peft adapter; None: build it from `checkpoint`
    checkpoint: Path | None  # a verified checkpoint (step-*), when there is no adapter
    lora: dict  # the run's `lora` config section (rank, alpha, targets, ...)
    trust_remote_code: bool = False
    quantization: dict | None = None  # the run's `model.quantization` section
    dtype: str = "float32"  # the run's `model.dtype`
    full_zo: dict | None = None  # full-parameter ZO's state (seed, eps, trajectory): the base weights moved too


@dataclass(frozen=True)
class Exported:
    out_dir: Path
    format: str
    source: str  # what was exported, in words
    note: str = ""  # e.g. why per-expert wrote the fused layout


def locate(path: str | Path, model_dir: str | Path | None = None) -> Trained:
    """The adapter (or verified checkpoint) and base model behind a run dir or checkpoint dir."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} does not exist; give a run's output.dir or one of its checkpoints (step-*)")
    if (path / checkpoint.MANIFEST).is_file() or path.name.startswith("step-"):
        checkpoint.verify(path)  # sizes and sha256: a corrupt checkpoint is refused here, by name
        trainer = json.loads((path / "trainer.json").read_text())
        return _trained(trainer["config"], model_dir, None, path, trainer.get("stepper"))
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is neither a vela-ray run dir (no config.json) nor a checkpoint (no manifest.json)")
    config = json.loads((path / "config.json").read_text())
    if not {"model", "lora"} <= set(config):
        raise ValueError(f"{path} is not a vela-ray run dir (its config.json is no job config: a model dir?)")
    if (path / "adapter" / ADAPTER_FILE).is_file():
        stepper = path / checkpoint.STEPPER_FILE
        return _trained(config, model_dir, path / "adapter", None,
                        json.loads(stepper.read_text()) if stepper.is_file() else None, stepper)
    root = Path(config.get("checkpoint", {}).get("dir") or path / "checkpoints")
    newest = checkpoint.latest(root)
    if newest is None:
        raise ValueError(f"{path}: the run has no adapter and no valid checkpoint under {root}; nothing to export")
    checkpoint.verify(newest)
    logger.info("%s has no adapter (interrupted run?): exporting its newest checkpoint %s", path, newest)
    return _trained(config, model_dir, None, newest, json.loads((newest / "trainer.json").read_text()).get("stepper"))


def _trained(config: dict, model_dir, adapter_dir: Path | None, ckpt: Path | None, stepper: dict | None = None,
             stepper_file: Path | None = None) -> Trained:
    """`stepper`: the run's steps' state (`checkpoint.STEPPER_FILE` beside a run's adapter, a checkpoint's
    `trainer.json` "stepper"); a full-parameter ZO run without it is refused: its base weights cannot be rebuilt."""
    model = Path(model_dir or config["model"]["path"])
    if not (model / "config.json").is_file():
        raise ValueError(f"the base model {model} is not a model directory (no config.json); give it with --model")
    trust_remote_code = bool(config["model"].get("trust_remote_code", False))
    training = config.get("training") or {}
    full = training.get("method") == "zo" and (training.get("zo") or {}).get("parameters") == "full"
    if full and (stepper or {}).get("parameters") != "full":
        where = stepper_file or ckpt / "trainer.json"
        raise ValueError(f"{where}: no trajectory of the run's steps, which trained every weight "
                         "(training.zo.parameters: full) and which its weights are rebuilt from; export one of its "
                         "checkpoints (step-*)")
    return Trained(model, adapter_dir, ckpt, dict(config["lora"]), trust_remote_code,
                   config["model"].get("quantization"), config["model"].get("dtype", "float32"),
                   stepper if full else None)


@contextmanager
def adapter_of(trained: Trained) -> Iterator[Path]:
    """A peft adapter dir of `trained`: its own, or one written from its checkpoint into a temporary dir."""
    if trained.adapter_dir is not None:
        yield trained.adapter_dir
        return
    with tempfile.TemporaryDirectory(prefix="vela-export-") as tmp:
        yield _adapter_from_checkpoint(trained, Path(tmp) / "adapter")


def _adapter_from_checkpoint(trained: Trained, out: Path) -> Path:
    """The peft adapter of checkpoint `trained.checkpoint`: its backbone LoRA, the modules it trains in full
    (`modules_to_save`) and every expert's factors."""
    skeleton = meta_model(trained.model_dir, trained.trust_remote_code)
    lora_config = full_lora_config(skeleton, LoraSection.model_construct(**trained.lora).spec())
    tensors = checkpoint.read_tensors(trained.checkpoint / "backbone.safetensors")
    backbone = {key: t for name, t in tensors.items() if (key := _adapter_key(name)) is not None}
    layers, experts = moe_layout(trained.model_dir, trained.trust_remote_code)
    manifest = checkpoint.verify(trained.checkpoint, checksums=False)
    keys = [(layer, e) for layer in range(layers) for e in range(experts)]
    states = checkpoint.read_expert_states(trained.checkpoint, manifest, keys)
    return export_adapter(out, skeleton.config, lora_config, backbone, states)


# A checkpoint's backbone tensor -> its key in a peft adapter (as `get_peft_model_state_dict` names it): the
# adapter name out of LoRA factors and of modules trained in full; optimizer state (`.exp_avg`, ...) has none.
_ADAPTER_KEYS = ((re.compile(r"(.*\.lora_[AB])\.default(\.weight)"), r"\1\2"),
                 (re.compile(r"(.*)\.modules_to_save\.default(\.(?:weight|bias))"), r"\1\2"))


def _adapter_key(name: str) -> str | None:
    """`X.lora_A.default.weight` -> `X.lora_A.weight`, `X.modules_to_save.default.weight` -> `X.weight`, else
    None (`_ADAPTER_KEYS`)."""
    return next((pattern.sub(key, name) for pattern, key in _ADAPTER_KEYS if pattern.fullmatch(name)), None)


def check_out_dir(out: Path, force: bool) -> None:
    """Refuse an output dir that is a file, or exists and is not empty unless `force` (which replaces it once the
    export is written: `_staged`)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} exists and is not empty; give another directory or --force to replace it")


def check_out_apart(out: Path, path: Path, trained: Trained, fmt: str) -> None:
    """Refuse an --out that is or holds the run dir or checkpoint `path`, or is, holds or lies inside anything the
    export reads (`reads_of`): replacing it (--force) would delete what is exported, and writing into it would
    change it. An --out inside a run dir apart from its records (`runs/x/exports`) is fine."""
    named = Path(os.path.abspath(path))
    beside = (named.parent.parent if trained.checkpoint == path else named.parent) / f"{named.name}-{fmt}"
    for read in [path, *reads_of(path, trained)]:
        if _forms(out) & _forms(read):
            where, harm = "is", "--force would delete it"
        elif _overlaps(read, out):
            where, harm = "holds", "--force would delete it"
        elif read != path and _overlaps(out, read):
            where, harm = "lies inside", "writing there would change it"
        else:
            continue
        raise ValueError(f"--out {out} {where} {read}, which this export reads ({harm}); give an --out apart from "
                         f"it, e.g. {beside}")


def reads_of(path: Path, trained: Trained) -> list[Path]:
    """What exporting `path` reads, or belongs to the run it exports: a run dir's records, adapter and
    checkpoints (`vela_ray.runs.RUN_ARTEFACTS`), the checkpoint exported, the base model."""
    own = [] if trained.checkpoint == path else [path / name for name in RUN_ARTEFACTS if (path / name).exists()]
    return [*own, *(p for p in (trained.adapter_dir, trained.checkpoint) if p is not None), trained.model_dir]


def _forms(path: Path) -> set[Path]:
    """`path` made absolute as named, and with its links followed: two paths meet if either form does."""
    named = Path(os.path.abspath(path))
    return {named, named.resolve()}


def _overlaps(inner: Path, outer: Path) -> bool:
    """Whether `inner` is `outer` or lies under it."""
    return any(i.is_relative_to(o) for i in _forms(inner) for o in _forms(outer))


@contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A new sibling dir of `out` to write the export into (same filesystem: the swap is a rename). When the
    block ends it takes `out`'s place, the old `out` deleted only then; when the block fails it is deleted and
    `out` is left as it was."""
    out = Path(os.path.abspath(out))  # `.` has a name too
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.export-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        yield staging
        _swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone once swapped in; else the partial export


def _swap_in(staging: Path, out: Path) -> None:
    """`staging` renamed to `out`; an `out` already there moved aside first and deleted after."""
    if not out.exists() and not out.is_symlink():
        os.rename(staging, out)
        return
    replaced = out.with_name(f".{out.name}.replaced-{uuid.uuid4().hex[:8]}")
    os.rename(out, replaced)
    try:
        os.rename(staging, out)
    except OSError:
        os.rename(replaced, out)
        raise
    if replaced.is_symlink():  # an --out that was a link: the link goes, not what it points to
        replaced.unlink()
    else:
        shutil.rmtree(replaced)


def check_disk(out: Path, needed: int) -> None:
    """Refuse before writing when the filesystem of `out` has less than `needed` bytes free."""
    probe = out
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise ValueError(f"--out {out}: a merged model needs {needed / 1e9:.2f} GB but only {free / 1e9:.2f} GB "
                         "are free there; free some space or write elsewhere")


def export_run(path: str | Path, fmt: str, out: str | Path, *, model_dir: str | Path | None = None,
               force: bool = False) -> Exported:
    """Export the run dir or checkpoint `path` as `fmt` into `out` (see the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    path, out = Path(path), Path(out)
    trained = locate(path, model_dir)
    if trained.full_zo is not None and fmt != "merged":
        raise ValueError(f"{path}: the run trained every weight (training.zo.parameters: full), so its adapter alone "
                         f"is not the trained model and --format {fmt} cannot hold it; use --format merged")
    check_out_apart(out, path, trained, fmt)
    check_out_dir(out, force)
    if trained.trust_remote_code:  # the model's own code, as the run read it
        register_model_code(str(trained.model_dir.resolve()))
    source = str(trained.adapter_dir or trained.checkpoint)
    with adapter_of(trained) as adapter_dir:
        if fmt != "merged":
            _warn_for_vllm(LoraConfig.from_pretrained(str(adapter_dir)), fmt)
        if fmt == "peft":
            with _staged(out) as staging:
                shutil.copytree(adapter_dir, staging, dirs_exist_ok=True)
            return Exported(out, fmt, source)
        if fmt == "merged":
            if trained.full_zo is None:
                return _export_merged(adapter_dir, trained.model_dir, out, source, _quantized(trained))
            with _replayed_base(trained, adapter_dir, out) as (base_dir, note):
                return dataclasses.replace(_export_merged(adapter_dir, base_dir, out, source), note=note)
        return _export_per_expert(adapter_dir, trained.model_dir, out, source)


@contextmanager
def _replayed_base(trained: Trained, adapter_dir: Path, out: Path) -> Iterator[tuple[Path, str]]:
    """(model dir, note): the base weights a full-parameter ZO run (`trained.full_zo`) trained, in a temporary
    hidden sibling of `out` (the same filesystem; deleted on the way out). The base checkpoint is loaded in the
    run's `model.dtype` (a checkpoint shipped quantized: its dequantized copy), wrapped with the run's adapter (a
    backbone tensor's noise is seeded by its peft name), the trajectory replayed onto its frozen tensors
    (`zo.replayed_terms`: the run's very adds), the LoRA wrappers taken off without merging, and `save_pretrained`
    in that dtype; the base dir's other files (tokenizer, ...) copied beside. The whole model is held in memory."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from vela_ray.model.dtypes import torch_dtype
    from vela_ray.model.modeling import find_moe_blocks
    from vela_ray.model.shipped import shipped_format, write_dequantized
    from vela_ray.training.optim import apply_zo_terms
    from vela_ray.training.zo import full_model_frozen_tensors, replayed_terms

    state, dtype, base = trained.full_zo, torch_dtype(trained.dtype), trained.model_dir
    shipped = shipped_format(base)
    if shipped is None:
        plan_merge(adapter_dir, base)  # a family the merge cannot take is refused before the model is read
    width = torch.empty((), dtype=dtype).element_size()
    weights = width * sum(p.numel() for p in meta_model(base, trained.trust_remote_code).parameters())
    check_disk(out, (3 if shipped else 2) * weights)  # the replayed base (a dequantized copy) and the merged model
    out = Path(os.path.abspath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.replayed-", dir=out.parent) as tmp:
        replayed = Path(tmp) / "model"
        if shipped is not None:
            base = write_dequantized(base, Path(tmp) / "dequantized", dtype)
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype,
                                                     trust_remote_code=trained.trust_remote_code)
        experts_paths = {block.experts_path: block.index for block in find_moe_blocks(model)}
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)  # frozen: the base's
        apply_zo_terms(full_model_frozen_tensors(peft_model, experts_paths),
                       replayed_terms(state["seed"], state["eps"], state["trajectory"]))
        peft_model.unload().save_pretrained(str(replayed))
        del model, peft_model
        if shipped is not None:
            shutil.rmtree(base)
        for file in checkpoint_files(trained.model_dir):
            if not (replayed / file.name).exists() and not _weights_file(file.name):
                shutil.copyfile(file, replayed / file.name)
        steps = len(state["trajectory"])
        yield replayed, (f"full-parameter ZO: the base weights rebuilt from the run's {steps} steps (its trajectory "
                         f"replayed), the adapter merged into them; written in {trained.dtype} (model.dtype), "
                         "transformers' layout")


def _weights_file(name: str) -> bool:
    """Whether a file of a model dir holds (or indexes) its weights."""
    return name.endswith((".safetensors", ".bin", ".pt", ".pth", ".index.json"))


def _quantized(trained: Trained):
    """The `QuantizationSpec` the run held its frozen weights in (None: at the checkpoint's width, or as a checkpoint
    shipped quantized stores them: `_export_merged` dequantizes those)."""
    from vela_ray.config import QuantizationSection
    from vela_ray.model.quantized_model import QuantizationSpec
    from vela_ray.model.shipped import shipped_format

    section = QuantizationSection.model_validate(trained.quantization or {})
    if not section.on or shipped_format(trained.model_dir) is not None:
        return None
    return QuantizationSpec(section.format, section.experts, section.backbone,
                            tuple(trained.lora.get("modules_to_save") or ()))


def _export_merged(adapter_dir: Path, model_dir: Path, out: Path, source: str, quantization=None) -> Exported:
    """`quantization`: the run's `QuantizationSpec`: the tensors it held quantized are written as it computed
    with them, dequantized, the delta added (`merging.plan_round_trips`). A checkpoint shipped quantized (FP8,
    MXFP4) is merged into its dequantized bf16 copy (`shipped.write_dequantized`): its own layout holds codes."""
    from vela_ray.model.quantization import FORMATS
    from vela_ray.model.shipped import shipped_format, write_dequantized

    files = checkpoint_files(model_dir)
    shipped = shipped_format(model_dir)
    if shipped is not None:
        grows = 16 / FORMATS[shipped].bits  # bf16 over the shipped codes, an upper bound (scales and bf16 tensors)
        check_disk(out, int(grows * sum(f.stat().st_size for f in files)))
        with _staged(out) as staging:
            write_dequantized(model_dir, staging)
            merge_in_place(adapter_dir, staging)  # a family the merge cannot take is refused here, nothing kept
        return Exported(out, "merged", source, note=f"{model_dir} ships in {shipped}: merged into its weights "
                        f"dequantized to bf16 (any engine loads it); to serve it in {shipped}, load the peft export "
                        "on the shipped checkpoint")
    plan_merge(adapter_dir, model_dir)  # a family the merge cannot take is refused before the disk check
    if quantization is not None:
        plan_round_trips(model_dir, quantization)
    check_disk(out, sum(f.stat().st_size for f in files))  # the old out goes only after
    with _staged(out) as staging:
        merge_checkpoint(adapter_dir, model_dir, staging, progress=lambda name: logger.info("merged %s", name),
                         quantization=quantization)
    return Exported(out, "merged", source)


def _export_per_expert(adapter_dir: Path, model_dir: Path, out: Path, source: str) -> Exported:
    family = json.loads((model_dir / "config.json").read_text()).get("model_type")
    config, state, per_expert = serving_adapter(adapter_dir, model_dir, fused=family in SERVED_FUSED)
    if family in SERVED_FUSED:
        note = (f"{family}: {SERVED_FUSED[family]} takes MoE LoRA in peft's fused layout (target_parameters on the "
                "3-D expert stacks), so the fused adapter was written")
    elif not per_expert:
        note = (f"{model_dir} stores its experts fused (3-D stacks), so serving engines take peft's fused layout "
                "(target_parameters) for it: wrote that")
    else:
        note = "experts as per-expert linear modules, the checkpoint's names"
    with _staged(out) as staging:
        save_file(state, str(staging / ADAPTER_FILE), metadata={"format": "pt"})
        config.save_pretrained(str(staging))
    return Exported(out, "per-expert", source, note=note)


def _warn_for_vllm(config: LoraConfig, fmt: str) -> None:
    """One warning line where vLLM cannot take the `fmt` export of an adapter with `config` as trained, naming
    the export it can take (vLLM's peft_helper refuses modules_to_save, reads one lora_alpha / r for all)."""
    if config.modules_to_save:
        logger.warning("the run trains %s in full (lora.modules_to_save), which vLLM refuses in an adapter: for "
                       "vLLM, export it with --format merged", ", ".join(config.modules_to_save))
    elif fmt == "peft" and (config.rank_pattern or config.alpha_pattern):
        logger.warning("the adapter has a rank_pattern/alpha_pattern, which vLLM ignores (one lora_alpha / r for "
                       "every module): for vLLM, export it with --format per-expert or merged")
