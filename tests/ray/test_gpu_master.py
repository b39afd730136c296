"""Through Ray: the master on the machine's GPU (given by default when the workers ask for none), two
CPU ExpertManagers over the collective data plane (gloo); equal to plain peft on the GPU."""

from __future__ import annotations

import json

import pytest
import torch

from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses
from vela_ray.api import VelaJob
from vela_ray.config import JobConfig

pytestmark = pytest.mark.gpu


def test_master_on_gpu_with_cpu_workers_over_gloo_equals_peft(ray_session, tmp_path):
    model_dir = make_checkpoint(tmp_path / "model")
    job = job_dict(model_dir, tmp_path / "out", steps=4, cluster={"num_workers": 2},
                   data_plane={"transport": "collective"},
                   lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))},
                   training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}})
    config = JobConfig.from_dict(job)
    summary = VelaJob(config).run()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["cluster"]["master_gpus"] == 1
    ref_losses, _ = reference_losses(config, device="cuda")
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def test_one_gpu_holds_the_backbone_and_every_expert_and_equals_peft(ray_session, tmp_path):
    """`cluster.workers_on_master: num_workers`: the ExpertManagers on the master's GPU, rows by direct call."""
    model_dir = make_checkpoint(tmp_path / "model")
    job = job_dict(model_dir, tmp_path / "out", steps=4, cluster={"num_workers": 2, "workers_on_master": 2},
                   lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))},
                   training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}})
    config = JobConfig.from_dict(job)
    summary = VelaJob(config).run()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["cluster"]["master_gpus"] == 1
    assert {tier for tier, n in summary.traffic_bytes_by_tier.items() if n} == {"same_process"}
    ref_losses, _ = reference_losses(config, device="cuda")
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a tensor-parallel master needs a GPU per rank (NCCL refuses "
                                                          "two ranks on one GPU)")
def test_a_tensor_parallel_master_over_two_gpus_equals_peft(ray_session, tmp_path):
    """`cluster.master_tp: 2` with `master_gpus: 1`: two master ranks, a GPU each, NCCL between them (device
    tensors) and gloo for host ones; each reads only its shards; CPU ExpertManagers over object refs."""
    model_dir = make_checkpoint(tmp_path / "model", vocab=264)  # vocab-parallel embedding and LM head
    job = job_dict(model_dir, tmp_path / "out", steps=4, cluster={"num_workers": 2, "master_tp": 2, "master_gpus": 1},
                   lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))},
                   training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}})
    config = JobConfig.from_dict(job)
    summary = VelaJob(config).run()
    assert summary.master_tp == 2
    ref_losses, _ = reference_losses(config, device="cuda")
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
