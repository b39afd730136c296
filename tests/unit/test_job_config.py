"""Bad job configs are refused before any actor starts, with the field named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from tests.fixtures import job_dict, make_checkpoint, write_job
from vela_ray.config import JobConfig


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _config(checkpoint, tmp_path, **sections) -> JobConfig:
    return JobConfig.from_dict(job_dict(checkpoint, tmp_path / "out", **sections))


def test_a_good_config_passes_preflight(checkpoint, tmp_path):
    _config(checkpoint, tmp_path).preflight()


def test_missing_model_path_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"model.path .*no config.json"):
        _config(tmp_path / "nowhere", tmp_path).preflight()


def test_model_without_moe_layers_is_named(tmp_path):
    dense = tmp_path / "dense"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(dense)
    with pytest.raises(ValueError, match=r"model.path .*LlamaForCausalLM has no MoE block"):
        _config(dense, tmp_path).preflight()


def test_capacity_too_small_says_how_many_slots_are_missing(checkpoint, tmp_path):
    # 2 MoE layers x 6 experts = 12; 3 workers x 3 = 9 -> 3 short
    with pytest.raises(ValueError, match=r"need 3 more expert slots"):
        _config(checkpoint, tmp_path, placement={"capacity": 3}).preflight()


def test_unknown_solver_is_named(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"placement.solver: Input should be 'improved', 'vela'"):
        _config(checkpoint, tmp_path, placement={"solver": "magic"})


def test_unreadable_data_is_named(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"data.path: .*does not exist"):
        _config(checkpoint, tmp_path, data={"path": str(tmp_path / "missing.txt")})


def test_micro_batch_must_divide_batch(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"micro_batch_size \(3\) must divide training.batch_size \(4\)"):
        _config(checkpoint, tmp_path, training={"micro_batch_size": 3})


def test_placement_file_solver_needs_a_file(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"placement.solver is 'file' but placement.file is not set"):
        _config(checkpoint, tmp_path, placement={"solver": "file"})


def test_cli_refuses_a_bad_config_before_starting_ray(checkpoint, tmp_path):
    job = write_job(tmp_path / "job.yaml", job_dict(checkpoint, tmp_path / "out", placement={"capacity": 1}))
    result = subprocess.run([sys.executable, "-m", "vela_ray.cli", "train", "--config", str(job)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "need 9 more expert slots" in result.stderr
    assert "Ray" not in result.stderr + result.stdout  # failed before ray.init
