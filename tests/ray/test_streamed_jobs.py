"""A master whose backbone is streamed from host memory (`masters.streaming`), run as a user runs it (`vela train` over
Ray): DeepSeek-V3 with its dense first layer and MLA attention, micro-batches in flight through a 2-slot buffer
(GPipe's waves), their activations beyond a small budget offloaded, and the experts behind APTMoE's tiers on the
ExpertManager actors. Equal to plain peft, each block uploaded once per wave."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import make_checkpoint, peft_job, reference_losses, write_job
from vela_ray import cli
from vela_ray.config import JobConfig
from vela_ray.training.summary import RunSummary

LAYERS = 4


@pytest.mark.job
def test_a_streamed_deepseek_v3_job_with_waves_offload_and_tiers_equals_peft(ray_session, tmp_path):
    model_dir = make_checkpoint(tmp_path / "model", family="deepseek_v3", num_hidden_layers=LAYERS)
    job = peft_job(model_dir, tmp_path, steps=2,
                   masters={"streaming": {"buffer_blocks": 2, "activation_budget_bytes": 32 * 1024}},
                   training={"batch_size": 4, "micro_batch_size": 1, "overlap": {"micro_batches_in_flight": 4}},
                   expert_tiers={"enabled": True, "cache_experts": 4})
    assert cli.main(["train", "--config", str(write_job(tmp_path / "streamed.yaml", job))]) == 0
    config, summary = JobConfig.from_dict(job), RunSummary.load(tmp_path / "out")
    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    streamed = summary.streaming
    assert streamed.layers == LAYERS and streamed.buffer_blocks == 2 and streamed.offloaded_bytes > 0
    assert 0 < streamed.peak_bytes <= 2 * streamed.slot_bytes < streamed.frozen_bytes
    assert summary.expert_tiers  # the workers' tiers ran
