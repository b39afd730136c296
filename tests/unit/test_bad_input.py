"""Bad input is refused in the driver before Ray starts: one line naming the field or file, nothing written.

One row per mistake a user makes (issue 12, "bad input"): each builds its files
under tmp_path, then `JobConfig.from_yaml(...).with_resume(...).preflight()`
must raise a one-line ValueError matching the row's pattern and leave every
file under tmp_path exactly as it was (in particular no output.dir/config.json).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from placement import Placement
from tests.fixtures import init_adapter, job_dict, make_checkpoint, write_job
from vela_ray.config import JobConfig
from vela_ray.model.families import debug_model
from vela_ray.paths import data_dir
from vela_ray.training import checkpoint

# what MasterActor records for the fixture model (2 MoE layers x 6 experts) with the default LoRA
META = {"model_type": "mixtral", "moe_layers": 2, "experts": 6, "hidden_size": 32, "lora_r": 8, "lora_alpha": 16.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model"))


# --- builders: (tmp_path, model_dir) -> (job YAML, --resume spec) ----------------------------

Case = Callable[[Path, Path], tuple[Path, str | None]]


def _job(tmp: Path, model: Path, **sections) -> Path:
    return write_job(tmp / "job.yaml", job_dict(model, tmp / "out", **sections))


_CHAT_LINE = json.dumps({"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant",
                                                                            "content": "Hello."}]}) + "\n"


def _data(tmp: Path, name: str, text: str, kind: str = "instruct", **data) -> dict:
    (tmp / name).write_text(text)
    return {"kind": kind, "path": str(tmp / name), **data}


def _model_copy(tmp: Path, model: Path, edit: Callable[[Path], None]) -> Path:
    copy = Path(shutil.copytree(model, tmp / "model"))
    edit(copy)
    return copy


def _truncate(model: Path) -> None:
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def _placement_file(tmp: Path, layers: int, experts: int, workers: int) -> str:
    table = [[e % workers for e in range(experts)] for _ in range(layers)]
    Placement(expert_to_worker=table, num_workers=workers, capacities=[layers * experts] * workers,
              solver="sequential", expected_step_time=0.0).to_json(tmp / "placement.json")
    return str(tmp / "placement.json")


def _checkpoint(root: Path, step: int, meta: dict = META) -> Path:
    staging = checkpoint.begin(root, step)
    checkpoint.write_tensors(staging / "backbone.safetensors", {"w": torch.zeros(4)})
    checkpoint.write_json(staging / "trainer.json", {"step": step})
    return checkpoint.finalize(staging, step, meta)


def _resume_only_corrupt(tmp: Path, model: Path) -> tuple[Path, str]:
    path = _checkpoint(tmp / "out" / "checkpoints", 2)
    data = bytearray((path / "backbone.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, wrong checksum
    (path / "backbone.safetensors").write_bytes(bytes(data))
    return _job(tmp, model), "latest"


def _resume_finished(tmp: Path, model: Path) -> tuple[Path, str]:
    _checkpoint(tmp / "out" / "checkpoints", 3)
    return _job(tmp, model, training={"steps": 3}), "latest"


def _resume_other_rank(tmp: Path, model: Path) -> tuple[Path, str]:
    _checkpoint(tmp / "out" / "checkpoints", 1, {**META, "lora_r": 4})
    return _job(tmp, model, lora={"r": 8}), "latest"


def _output_under_a_file(tmp: Path, model: Path) -> tuple[Path, None]:
    (tmp / "blocker").write_text("")
    return write_job(tmp / "job.yaml", job_dict(model, tmp / "blocker" / "out")), None


def _output_is_a_file(tmp: Path, model: Path) -> tuple[Path, None]:
    (tmp / "out").write_text("")
    return _job(tmp, model), None


def _profile(tmp: Path, name: str, probs) -> dict:
    path = tmp / name
    if path.suffix == ".npy":
        np.save(path, np.asarray(probs))
    else:
        path.write_text(json.dumps(probs))
    return {"profile": str(path)}


def _adapter_of_another_model(tmp: Path, model: Path) -> tuple[Path, None]:
    other = tmp / "wider"  # same family, another hidden size
    debug_model("mixtral", hidden_size=48).save_pretrained(other)
    return _job(tmp, model, lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(other, tmp / "adapter"))}), None


def _yaml(tmp: Path, text: str) -> Path:
    (tmp / "job.yaml").write_text(text)
    return tmp / "job.yaml"


CASES: dict[str, tuple[Case, str]] = {
    "yaml syntax error": (
        lambda t, m: (_yaml(t, "model:\n  path: x\ndata: [unclosed\ntraining:\n  steps: 3\n"), None),
        r"job\.yaml: line \d+ column \d+: YAML syntax error"),
    "yaml not a mapping": (
        lambda t, m: (_yaml(t, "- model\n- data\n"), None),
        r"job\.yaml: expected a mapping of sections .*got a YAML list"),
    "config typo": (
        lambda t, m: (_job(t, m, training={"stpes": 3}), None),
        r"job\.yaml: training\.stpes: unknown field \(did you mean 'steps'\?\)"),
    "config.json without safetensors": (
        lambda t, m: (_job(t, _model_copy(t, m, lambda d: (d / "model.safetensors").unlink())), None),
        r"model\.path .*model: config\.json but no \*\.safetensors weights"),
    "truncated safetensors": (
        lambda t, m: (_job(t, _model_copy(t, m, _truncate)), None),
        r"model\.path: .*model\.safetensors is not a readable safetensors file \(.*incomplete metadata"),
    "empty text file": (
        lambda t, m: (_job(t, m, data=_data(t, "empty.txt", "", kind="text")), None),
        r"data: .*empty\.txt: 0 tokens: the file is empty"),
    "empty json file": (
        lambda t, m: (_job(t, m, data=_data(t, "d.json", "")), None),
        r"data: .*d\.json: the file is empty; expected a JSON list of records"),
    "malformed json": (
        lambda t, m: (_job(t, m, data=_data(t, "d.json", '[\n {"instruction": "a",\n  "output" "b"}\n]')), None),
        r"data: .*d\.json: line 3 column \d+: not valid JSON"),
    "json not a list": (
        lambda t, m: (_job(t, m, data=_data(t, "d.json", '{"instruction": "a", "output": "b"}')), None),
        r"data: .*d\.json: expected a JSON list of records .*got a dict"),
    "malformed jsonl line": (
        lambda t, m: (_job(t, m, data=_data(t, "d.jsonl", '{"instruction": "a", "output": "b"}\n{oops\n')), None),
        r"data: .*d\.jsonl: line 2: record 1 is not valid JSON"),
    "record without output": (
        lambda t, m: (_job(t, m, data=_data(t, "d.json", json.dumps(
            [{"instruction": "a", "output": "b"}, {"instruction": "c"}]))), None),
        r"data: .*d\.json: record 1: missing field 'output'; every record needs 'instruction' and 'output'"),
    "chat data, no chat template": (
        lambda t, m: (_job(t, m, data=_data(t, "c.jsonl", _CHAT_LINE * 3, kind="chat")), None),
        r"data: the tokenizer of .* has no chat template; set data\.chat_template to a Jinja template file or "
        r"string"),
    "chat template path mistyped": (
        lambda t, m: (_job(t, m, data=_data(t, "c.jsonl", _CHAT_LINE, kind="chat", chat_template="tmpl.jinja")),
                      None),
        r"data: data\.chat_template: 'tmpl\.jinja' is neither a file nor a Jinja template"),
    "chat record with an unknown role": (
        lambda t, m: (_job(t, m, data=_data(t, "c.jsonl", _CHAT_LINE + _CHAT_LINE.replace('"user"', '"bot"'),
                                            kind="chat")), None),
        r"data: .*c\.jsonl: record 1: message 0: unknown role 'bot'; use system, user or assistant"),
    "sharegpt record without a value": (
        lambda t, m: (_job(t, m, data=_data(t, "c.jsonl", '{"conversations": [{"from": "human"}]}\n',
                                            kind="chat")), None),
        r"data: .*c\.jsonl: record 0: message 0: missing field 'value'"),
    "mapped column missing": (
        lambda t, m: (_job(t, m, data=_data(t, "d.json", json.dumps([{"q": "a", "output": "b"}]),
                                            columns={"instruction": "question"})), None),
        r"data: .*d\.json: no column 'question' \(data\.columns\.instruction\); its columns are \['q', 'output'\]"),
    "parquet file that is not parquet": (
        lambda t, m: (_job(t, m, data=_data(t, "d.parquet", "not parquet")), None),
        r"data: .*d\.parquet: cannot read as parquet \("),
    "packing where the architecture mixes examples": (
        lambda t, m: (_job(t, make_checkpoint(t / "gpt_oss", "gpt_oss"), data={
            "kind": "instruct", "path": str(data_dir() / "instruct" / "alpaca_seed_tasks.jsonl"), "packing": True}),
                      None),
        r"model\.path .*gpt_oss: data\.packing would leak between examples in GptOssConfig models .*set "
        r"data\.packing: false"),
    "seq_len beyond max_position_embeddings": (
        lambda t, m: (_job(t, m, data={"seq_len": 256}), None),
        r"data\.seq_len 256 exceeds the model's max_position_embeddings 128 .*at most 128"),
    "batch larger than the training split": (
        lambda t, m: (_job(t, m, data={"limit": 20}, training={"batch_size": 32}), None),
        r"training\.batch_size 32 exceeds the 19 training examples of data\.path .*at most 19"),
    "placement file for another worker count": (
        lambda t, m: (_job(t, m, placement={"solver": "file", "file": _placement_file(t, 2, 6, 4)}), None),
        r"placement\.file .*placement\.json places 2x6 experts on 4 workers, but this job has 2x6 .* on 3"),
    "placement file for another model": (
        lambda t, m: (_job(t, m, placement={"solver": "file", "file": _placement_file(t, 3, 6, 3)}), None),
        r"placement\.file .*places 3x6 experts on 3 workers, but this job has 2x6"),
    "profile for another model": (
        lambda t, m: (_job(t, m, placement=_profile(t, "p.npy", np.full((3, 6), 1 / 3))), None),
        r"placement\.profile .*p\.npy is 3x6 \(layers x experts\) but model\.path has 2x6; profile this model"),
    "profile that is not a profile": (
        lambda t, m: (_job(t, m, placement=_profile(t, "p.json", {"layers": 2})), None),
        r"placement\.profile: profile .*p\.json: must be a \[layers\]\[experts\] list.*; write one with `vela profile`"),
    "initial adapter of another rank": (
        lambda t, m: (_job(t, m, lora={"init_adapter": str(init_adapter(m, t / "adapter"))}), None),
        r"lora\.init_adapter: .*the adapter was trained with r 4 \(lora\.r: 8\), lora_alpha 8 \(lora\.alpha: 16\.0\); "
        r"set the job's lora options to match"),
    "initial adapter trained without rsLoRA": (
        lambda t, m: (_job(t, m, lora={"r": 4, "alpha": 8, "use_rslora": True,
                                       "init_adapter": str(init_adapter(m, t / "adapter"))}), None),
        r"lora\.init_adapter: .*the adapter was trained with use_rslora None \(lora\.use_rslora: True\); set the "
        r"job's lora options to match"),
    "initial adapter of another model": (
        _adapter_of_another_model,
        r"lora\.init_adapter: .*adapter: \S+ has shape \[\d+, 48\] but this model needs \[\d+, 32\]; "
        r"use an adapter of this model"),
    "LoRA target that matches nothing": (
        lambda t, m: (_job(t, m, lora={"target_modules": ["q_proj", "qkv_proj"]}), None),
        r"lora\.target_modules entry 'qkv_proj' matches no module of MixtralForCausalLM"),
    "LoRA rank pattern that matches nothing": (
        lambda t, m: (_job(t, m, lora={"rank_pattern": {"w2": 4}}), None),
        r"lora\.rank_pattern key 'w2' matches no adapted module or expert stack"),
    "LoRA on a router that is no linear layer": (
        lambda t, m: (_job(t, m, lora={"target_modules": ["gate"]}), None),
        r"lora\.target_modules adapts the router model\.layers\.0\.mlp\.gate of MixtralForCausalLM, a "
        r"MixtralTopKRouter, not a linear layer.*lora\.modules_to_save instead"),
    "LoRA dropout outside [0, 1)": (
        lambda t, m: (_job(t, m, lora={"lora_dropout": 1.0, "expert_stacks": []}), None),
        r"lora\.lora_dropout.*less than 1"),
    "LoRA dropout on expert stacks": (
        lambda t, m: (_job(t, m, lora={"lora_dropout": 0.1}), None),
        r"lora\.lora_dropout above 0 and adapted expert stacks .* do not combine: peft's ParamWrapper cannot apply "
        r"dropout"),
    "output dir under a file": (
        _output_under_a_file, r"output\.dir .*blocker/out cannot be created or written"),
    "output dir is a file": (
        _output_is_a_file, r"output\.dir .*out is a file, not a directory"),
    "resume dir mistyped": (
        lambda t, m: (_job(t, m), str(t / "out" / "checkpoints" / "step-00003")),
        r"checkpoint\.resume \(--resume\) .*step-00003 does not exist"),
    "resume latest, only corrupt checkpoints": (
        _resume_only_corrupt,
        r"checkpoint\.resume \(--resume\) latest: no valid checkpoint under .* \(1 corrupt: step-000002\)"),
    "resume a finished run": (
        _resume_finished,
        r"step-000003 is at step 3: the run is complete at step 3 .*raise training\.steps above 3"),
    "resume another LoRA rank": (
        _resume_other_rank,
        r"checkpoint\.resume \(--resume\): .*lora_r: checkpoint 4 vs this job 8"),
}


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and mtime: a write anywhere shows up as a difference."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input_is_one_line_naming_the_field_and_nothing_is_written(case, model_dir, tmp_path):
    build, pattern = CASES[case]
    job_file, resume = build(tmp_path, model_dir)
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match=pattern) as raised:
        JobConfig.from_yaml(job_file).with_resume(resume).preflight()
    message = str(raised.value)
    assert "\n" not in message, message
    assert _snapshot(tmp_path) == before
    assert not (tmp_path / "out" / "config.json").exists()
