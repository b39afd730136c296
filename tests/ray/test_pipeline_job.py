"""A pipelined master through Ray (`masters.pipeline_stages`): master 0 holds the first decoder layers, a MasterRank
actor on its node the rest, each streaming its 3 layers' frozen weights through 2 slots (`masters.streaming`); the
hidden states and their gradients cross the stages' gloo group (host memory), and each stage sends its own layers'
rows over a collective data plane of its own.

Against single-process transformers + peft and the same job with one master in one process: equal losses, eval
losses, exported adapter, the bytes every worker saw, and the checkpoint (stage 0 gathers every stage's tensors).
The schedule, the families (Mixtral, Qwen3-MoE, DeepSeek-V3 at 2 and 4 stages), tiers, activation checkpointing
and resuming at another stage count are tested in one process (tests/unit/test_pipeline.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, run_in_process
from vela_ray.api import VelaJob
from vela_ray.config import JobConfig
from vela_ray.training.checkpoint import read_tensors

STEPS, EVERY = 4, 2


def test_a_pipelined_master_trains_equal_to_peft_and_to_one_master(ray_session, tmp_path):
    model_dir = make_checkpoint(tmp_path / "model", "mixtral", num_hidden_layers=6)
    lora = {"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))}

    def job(stages: int, transport: str) -> dict:
        return job_dict(model_dir, tmp_path / f"pp{stages}", steps=STEPS, lora=lora,
                        masters={"pipeline_stages": stages, "streaming": {"buffer_blocks": 2} if stages > 1 else {}},
                        data_plane={"transport": transport},
                        checkpoint={"every": EVERY, "keep": 10},
                        training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1},
                                  "eval_every": EVERY})

    one = run_in_process(JobConfig.from_dict(job(1, "object_ref")))
    config = JobConfig.from_dict(job(2, "collective"))
    piped = VelaJob(config).run()
    ref_losses, ref_state = reference_losses(config)
    torch.testing.assert_close(torch.tensor(piped.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    evals = [[h.eval_loss for h in s.history if h.eval_loss is not None] for s in (one, piped)]
    assert len(evals[1]) == STEPS // EVERY
    torch.testing.assert_close(torch.tensor(evals[1]), torch.tensor(evals[0]), rtol=1e-5, atol=0)
    exported = load_file(Path(piped.adapter_dir) / "adapter_model.safetensors")
    alone = load_file(Path(one.adapter_dir) / "adapter_model.safetensors")
    assert exported.keys() == alone.keys() == ref_state.keys()
    for key, value in alone.items():
        torch.testing.assert_close(exported[key], value, rtol=1e-4, atol=1e-6)
    assert piped.traffic_bytes_by_worker == one.traffic_bytes_by_worker
    assert len(piped.traffic_bytes_by_master) == 2 and min(piped.traffic_bytes_by_master) > 0
    assert piped.pipeline_stages == 2 and piped.streaming.layers == 3 and piped.streaming.uploads > 3 * STEPS
    # the checkpoint holds every stage's LoRA and AdamW tensors, as one master's does
    saved = [read_tensors(Path(s.checkpoint) / "backbone.safetensors") for s in (one, piped)]
    assert saved[1].keys() == saved[0].keys()
