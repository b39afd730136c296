"""Expert parallelism through Ray: N ranks, all-to-all over gloo, equals single-process peft training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.expert_parallel import run_expert_parallel
from tests.fixtures import job_dict
from tests.ray.test_job_runtime import _init_adapter, _reference_losses
from vela_ray.config import JobConfig
from vela_ray.model.families import debug_model
from vela_ray.paths import data_dir
from vela_ray.training.tiny_model import train_tokenizer

STEPS = 3


def _checkpoint_for_instructions(out_dir: Path) -> Path:
    """Like tests.fixtures.make_checkpoint, with a 1024-token vocabulary and 256 positions, so the
    Alpaca prompt leaves room for the response in 128 tokens."""
    text = (data_dir() / "tinyshakespeare" / "input.txt").read_text()[:200_000]
    tokenizer = train_tokenizer(text, 1024)
    model = debug_model("mixtral", seed=0, vocab_size=len(tokenizer), max_position_embeddings=256)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def test_expert_parallel_losses_match_single_process_training(ray_session, tmp_path):
    model_dir = _checkpoint_for_instructions(tmp_path / "model")
    # 4 rows over 3 ranks (2, 1, 1) of padded instruction data with masked prompts: uneven shards with
    # different label counts must still add up to the global-batch loss
    instruct = {"kind": "instruct", "path": str(data_dir() / "instruct" / "alpaca_seed_tasks.jsonl"), "seq_len": 128,
                "limit": 120}
    job = job_dict(model_dir, tmp_path / "out", steps=STEPS, data=instruct,
                   lora={"r": 4, "alpha": 8, "init_adapter": str(_init_adapter(model_dir, tmp_path / "init"))},
                   training={"micro_batch_size": None, "optimizer": {"lr": 5e-3, "max_grad_norm": 0.5,
                                                                     "warmup_steps": 1}})
    config = JobConfig.from_dict(job)
    summary = run_expert_parallel(config, mode="expert_parallel")

    ref_losses, _ = _reference_losses(config.model_copy(update={"training": config.training.model_copy(
        update={"micro_batch_size": config.training.batch_size})}))
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    # one process per rank, experts e mod 3: each rank sends rows to the two others and keeps a third
    by_tier = summary["traffic_bytes_by_tier"]
    assert by_tier["same_node"] > 0 and by_tier["cross_node"] == 0  # one Ray node here
    assert summary["allreduce_bytes_per_step"] > 0
    assert summary["placement"]["expert_to_worker"][0] == [0, 1, 2, 0, 1, 2]


def test_vela_mode_is_refused_here(ray_session, tmp_path):
    config = JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out"))  # refused before the model is read
    with pytest.raises(ValueError, match="runs mode 'expert_parallel', got 'vela'"):
        run_expert_parallel(config, mode="vela")
