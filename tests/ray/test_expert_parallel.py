"""Expert parallelism through Ray: N ranks, all-to-all over gloo, equals single-process peft training,
and the run leaves in output.dir what a vela-ray run leaves (adapter, summary, report)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, write_job
from vela_ray import cli
from vela_ray.config import JobConfig
from vela_ray.paths import data_dir
from vela_ray.training.summary import RunSummary

STEPS = 3


@dataclass
class EpRun:
    config: JobConfig
    summary: RunSummary
    ref_losses: list[float]
    ref_state: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def ep_run(ray_session, tmp_path_factory) -> EpRun:
    """One 3-rank EP job through `vela train` and its plain-peft reference (the job is slow: run it once)."""
    tmp = tmp_path_factory.mktemp("ep")
    # a 1024-token vocabulary and 256 positions: the Alpaca prompt leaves room for the response in 128 tokens
    model_dir = make_checkpoint(tmp / "model", vocab=1024, max_position_embeddings=256)
    # 4 rows over 3 ranks (2, 1, 1) of padded instruction data with masked prompts: uneven shards with
    # different label counts must still add up to the global-batch loss
    instruct = {"kind": "instruct", "path": str(data_dir() / "instruct" / "alpaca_seed_tasks.jsonl"), "seq_len": 128,
                "limit": 120}
    job = job_dict(model_dir, tmp / "out", steps=STEPS, data=instruct,
                   lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp / "init"))},
                   training={"micro_batch_size": None, "optimizer": {"lr": 5e-3, "max_grad_norm": 0.5,
                                                                     "warmup_steps": 1}})
    job["mode"] = "expert_parallel"
    config = JobConfig.from_dict(job)
    assert cli.main(["train", "--config", str(write_job(tmp / "job.yaml", job))]) == 0  # as a user runs it
    summary = RunSummary.load(config.output.dir)
    ref_losses, ref_state = reference_losses(config.model_copy(update={"training": config.training.model_copy(
        update={"micro_batch_size": config.training.batch_size})}))
    return EpRun(config, summary, ref_losses, ref_state)


def test_expert_parallel_losses_match_single_process_training(ep_run):
    summary = ep_run.summary
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ep_run.ref_losses), rtol=1e-5, atol=0)
    # one process per rank, experts e mod 3: each rank sends rows to the two others and keeps a third
    by_tier = summary.traffic_bytes_by_tier
    assert by_tier["same_node"] > 0 and by_tier["cross_node"] == 0  # one Ray node here
    assert summary.allreduce_bytes_per_step > 0 and summary.control_bytes > 0
    assert summary.placement.expert_to_worker[0] == [0, 1, 2, 0, 1, 2]
    assert summary.worker_tiers == ["same_node"] * 3 and summary.history[-1].eval_loss == summary.eval_loss
    assert summary.data_plane == "all-to-all (gloo)"


def test_the_run_writes_a_loadable_adapter_equal_to_peft_training_with_its_summary_and_report(ep_run):
    out = Path(ep_run.config.output.dir)
    assert RunSummary.load(out) == ep_run.summary and ep_run.summary.mode == "expert_parallel"
    assert json.loads((out / "config.json").read_text())["mode"] == "expert_parallel"
    assert Path(ep_run.summary.report) == (out / "report.html").resolve() and (out / "report.html").stat().st_size
    adapter = Path(ep_run.summary.adapter_dir)
    assert adapter == (out / "adapter").resolve()

    exported = load_file(adapter / "adapter_model.safetensors")  # backbone from rank 0, experts from every rank
    assert exported.keys() == ep_run.ref_state.keys()
    for key, value in ep_run.ref_state.items():
        assert float((exported[key] - value).abs().max()) <= 2e-3 * float(value.abs().max()), key
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ep_run.config.model.path), adapter)
    assert get_peft_model_state_dict(loaded).keys() == ep_run.ref_state.keys()
