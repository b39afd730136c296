"""Quantized jobs as a user runs them (`vela train` over Ray): the ExpertManager actors read their experts from the
checkpoint and hold them in NF4 (or as DeepSeek-V3's FP8 checkpoint ships them), the master actor its backbone's
linears; equal to plain peft on the dequantized checkpoint, with the workers' bytes per expert NF4's."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, write_job
from vela_ray import cli
from vela_ray.config import JobConfig
from vela_ray.model.shipped import write_shipped
from vela_ray.training.summary import RunSummary


@pytest.mark.job
def test_vela_train_with_nf4_experts_and_backbone_equals_peft_on_the_dequantized_model(ray_session, tmp_path):
    model_dir = make_checkpoint(tmp_path / "model", hidden_size=128, intermediate_size=128)
    job = job_dict(model_dir, tmp_path / "out", steps=3, model={"quantization": {"format": "nf4"}},
                   lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))},
                   training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}})
    assert cli.main(["train", "--config", str(write_job(tmp_path / "nf4.yaml", job))]) == 0
    config, summary = JobConfig.from_dict(job), RunSummary.load(tmp_path / "out")
    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert summary.quantization == "nf4: experts, backbone"
    # what an actor reports per hosted expert: its stacks, [256, 128] and [128, 128], in NF4 (half a byte a weight, a
    # 4-byte absmax per 64), and its r=4 fp32 LoRA factors four times over (values, gradients, AdamW's two moments)
    nf4 = 3 * 128 * 64 + 3 * 128 * 2 * 4
    lora = 4 * 4 * (4 * 128 + 256 * 4 + 4 * 128 + 128 * 4)
    assert summary.bytes_per_expert == nf4 + lora, summary.bytes_per_expert


@pytest.mark.job
def test_vela_train_on_deepseek_v3_shipped_in_fp8_equals_peft_on_its_dequantized_weights(ray_session, tmp_path):
    """DeepSeek-V3 as its FP8 checkpoint ships (weight_scale_inv, 128x128 blocks), trained as shipped over Ray: the
    ExpertManager actors keep each expert's codes as read, the master its backbone's; plain peft on the dequantized
    weights (the full-width checkpoint rounded through FP8) gives the same losses."""
    widths = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, q_lora_rank=128,
                  kv_lora_rank=128)
    full = make_checkpoint(tmp_path / "full", family="deepseek_v3", **widths)
    shipped = write_shipped(full, tmp_path / "fp8", "fp8")
    job = job_dict(shipped, tmp_path / "out", steps=3, model={"quantization": {"format": "fp8"}},
                   lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(full, tmp_path / "init"))},
                   training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}})
    assert cli.main(["train", "--config", str(write_job(tmp_path / "job.yaml", job))]) == 0
    config, summary = JobConfig.from_dict(job), RunSummary.load(tmp_path / "out")
    reference = config.model_copy(update={"model": config.model.model_copy(update={"path": full})})
    ref_losses, _ = reference_losses(reference)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert summary.quantization == "fp8: experts, backbone"
