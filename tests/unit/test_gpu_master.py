"""The master on a GPU (`cluster.master_gpus: 1`): backbone, LoRA and optimizer state on CUDA, experts on
CPU ExpertManagers; equal to plain peft on the same GPU. Needs CUDA (`make test-gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, run_in_process
from vela_ray.config import JobConfig
from vela_ray.runtime.masters import master_spec

pytestmark = pytest.mark.gpu


def test_master_device_follows_master_gpus(tmp_path):
    job = job_dict(make_checkpoint(tmp_path / "model"), tmp_path / "out")
    assert master_spec(JobConfig.from_dict(job)).device.type == "cpu"
    job["cluster"]["master_gpus"] = 1
    assert master_spec(JobConfig.from_dict(job)).device.type == "cuda"


@pytest.mark.job
def test_a_job_with_its_master_on_the_gpu_equals_peft_on_the_gpu(tmp_path):
    model_dir = make_checkpoint(tmp_path / "model")
    job = job_dict(model_dir, tmp_path / "out", steps=4, cluster={"num_workers": 2, "master_gpus": 1},
                   lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))},
                   placement={"solver": "sequential", "profile": "uniform"},
                   training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}})
    config = JobConfig.from_dict(job)
    config.preflight()
    summary = run_in_process(config)
    ref_losses, _ = reference_losses(config, device="cuda")
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert Path(summary.adapter_dir, "adapter_model.safetensors").is_file()
