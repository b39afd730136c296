"""`vela export` of a full-parameter ZO run (`training.zo.parameters: full`): every weight moved, so the merged
export replays the run's trajectory onto the base weights before merging the adapter; peft and per-expert refuse.

One 3-step run of the tiny debug Mixtral, checkpointed at its last step, is exported from its run dir and from that
checkpoint. The merged model is held to the run itself: its loss over the run's eval batches is the run's
`eval_loss`, which a merge of the adapter alone (onto the base checkpoint as it was) misses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.fixtures import job_dict, make_checkpoint, run_in_process
from vela_ray.config import JobConfig
from vela_ray.data.datasets import build_dataset, sequential_batches
from vela_ray.export import export_run
from vela_ray.model.merging import merge_checkpoint
from vela_ray.training import checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 3
# The run's eval loss (vela's master and experts) and transformers' forward of the merged model agree to a couple of
# fp32 ulps of a loss near 5.6 (4.8e-7; measured: equal). 3 steps at lr 1e-4 move it by ~1.2e-5 (measured), so the
# merge of the adapter alone onto the base as it was misses it by 25x this.
LOSS_MATCH = 1e-6


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[JobConfig, Path, float]:
    """(config, run dir, its eval_loss) of a finished full-parameter ZO run with a checkpoint of its last step."""
    tmp = tmp_path_factory.mktemp("full-zo")
    job = job_dict(make_checkpoint(tmp / "model"), tmp / "run", steps=STEPS, checkpoint={"every": STEPS, "keep": 2},
                   training={"method": "zo", "zo": {"eps": 1e-2, "parameters": "full"}, "optimizer": {"lr": 1e-4}})
    config = JobConfig.from_dict(job)
    summary = run_in_process(config)
    assert json.loads((tmp / "run" / checkpoint.STEPPER_FILE).read_text())["parameters"] == "full"
    return config, tmp / "run", summary.eval_loss


def eval_loss(config: JobConfig, model_dir: Path) -> float:
    """The loss of the model in `model_dir` over the run's eval batches, as the run computes its eval_loss."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    data = build_dataset(config.data, AutoTokenizer.from_pretrained(config.model.path))
    _, eval_set = data.split(config.training.eval_fraction, config.training.seed)
    batches = list(sequential_batches(eval_set, config.training.batch_size, config.training.eval_batches))
    with torch.no_grad():
        return sum(float(model(**batch).loss) for batch in batches) / len(batches)


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for file in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(file).items()}


def test_merged_export_of_a_full_zo_run_is_the_trained_model(run, tmp_path):
    config, run_dir, run_eval_loss = run
    exported = export_run(run_dir, "merged", tmp_path / "merged")
    assert "full-parameter ZO" in exported.note
    assert (tmp_path / "merged" / "tokenizer.json").is_file()  # servable: the base's other files came along
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]  # the replayed base beside it is gone
    assert eval_loss(config, tmp_path / "merged") == pytest.approx(run_eval_loss, abs=LOSS_MATCH)

    # the adapter alone on the base as it was is not what the run trained: the replay moved every weight
    plain = merge_checkpoint(run_dir / "adapter", config.model.path, tmp_path / "plain")
    assert abs(eval_loss(config, plain) - run_eval_loss) > 5 * LOSS_MATCH
    got, unreplayed = weights(tmp_path / "merged"), weights(plain)
    assert got.keys() == unreplayed.keys()
    assert not [name for name in got if torch.equal(got[name], unreplayed[name])]


def test_merged_export_of_the_last_checkpoint_equals_the_run_dirs(run, tmp_path):
    _, run_dir, _ = run
    export_run(run_dir, "merged", tmp_path / "from-run")
    export_run(run_dir / "checkpoints" / f"step-{STEPS:06d}", "merged", tmp_path / "from-checkpoint")
    a, b = weights(tmp_path / "from-run"), weights(tmp_path / "from-checkpoint")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fmt", ["peft", "per-expert"])
def test_adapter_only_formats_are_refused_for_a_full_zo_run(run, tmp_path, fmt):
    _, run_dir, _ = run
    with pytest.raises(ValueError, match=r"trained every weight \(training.zo.parameters: full\), so its adapter "
                                         r"alone is not the trained model .*use --format merged"):
        export_run(run_dir, fmt, tmp_path / "out")
    assert not any(tmp_path.iterdir())


def test_a_full_zo_run_without_its_trajectory_is_refused(run, tmp_path):
    _, run_dir, _ = run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))
    (copy / checkpoint.STEPPER_FILE).unlink()
    with pytest.raises(ValueError, match=r"stepper.json: no trajectory of the run's steps, which trained every weight"):
        export_run(copy, "merged", tmp_path / "out")
    assert not (tmp_path / "out").exists()
