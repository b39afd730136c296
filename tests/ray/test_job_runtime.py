"""The whole runtime through Ray: VelaJob -> MasterActor -> ExpertManagers, against plain peft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.fixtures import job_dict, make_checkpoint
from vela_ray.model.adapters import full_lora_config
from vela_ray.api import VelaJob
from vela_ray.config import JobConfig
from vela_ray.data.datasets import batch_at
from vela_ray.model.experts import LoraSpec
from vela_ray.training.optim import lr_at

STEPS = 4


def _init_adapter(model_dir: Path, out: Path) -> Path:
    """A random (non-zero B) adapter both sides start from."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = full_lora_config(model, LoraSpec(r=4, alpha=8))
    cfg.init_lora_weights = False
    torch.manual_seed(5)
    get_peft_model(model, cfg).save_pretrained(out)
    return out


def _reference_losses(config: JobConfig) -> tuple[list[float], dict]:
    """Plain transformers + peft over the very batches, learning rates and clipping of the job."""
    train = config.training
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    train_set, _ = config.data.build(tokenizer).split(train.eval_fraction, train.seed)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config.model.path),
                                      config.lora.init_adapter, is_trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=train.optimizer.lr, betas=train.optimizer.betas,
                            eps=train.optimizer.eps, weight_decay=train.optimizer.weight_decay)
    model.train()
    losses = []
    for step in range(train.steps):
        batch = batch_at(train_set, step, train.batch_size, train.seed)
        size = train.micro_batch_size
        total = 0.0
        for i in range(0, train.batch_size, size):
            micro = {k: v[i:i + size] for k, v in batch.items()}
            loss = model(**micro).loss / train.grad_accumulation
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, train.optimizer.max_grad_norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(train.optimizer, step, train.steps)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, get_peft_model_state_dict(model)


@pytest.mark.parametrize("family,transport", [("mixtral", "object_ref"), ("qwen3_moe", "object_ref"),
                                              ("mixtral", "compiled_graph")])
def test_job_through_ray_matches_single_process_peft(ray_session, tmp_path, family, transport):
    model_dir = make_checkpoint(tmp_path / "model", family)
    job = job_dict(model_dir, tmp_path / "out", steps=STEPS,
                   lora={"r": 4, "alpha": 8, "init_adapter": str(_init_adapter(model_dir, tmp_path / "init"))},
                   cluster={"transport": transport}, placement={"cost_model": "communication+compute"},
                   training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}})
    config = JobConfig.from_dict(job)
    summary = VelaJob(config).run()

    ref_losses, ref_state = _reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    exported = load_file(Path(summary["adapter_dir"]) / "adapter_model.safetensors")
    assert exported.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert float((exported[key] - value).abs().max()) <= 2e-3 * float(value.abs().max()), key

    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["losses"] == summary["losses"]
    assert sum(written["traffic_bytes_by_tier"].values()) > 0
    assert (tmp_path / "out" / "placement.json").is_file() and (tmp_path / "out" / "profile.npy").is_file()
    placed = written["placement"]  # the compute-aware cost model measured every worker's compute per row
    assert placed["cost_model"] == "communication+compute"
    assert len(placed["compute_seconds_per_row"]) == config.cluster.num_workers
    assert all(0 < s < 0.01 for s in placed["compute_seconds_per_row"])
    assert 0 < placed["expected_comm_time_s"] < placed["expected_step_time_s"]
    split = written["step_breakdown_s"]
    assert 0 < split["expert_round_trip"] < split["step"] and split["worker_compute_sum"] > 0
