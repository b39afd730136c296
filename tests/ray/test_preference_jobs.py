"""DPO as a user runs it (`vela train` over Ray): two data-parallel master actors, each scoring its whole pairs, and
the ExpertManager actors answering the reference pass's rows without LoRA over the collective plane; equal to TRL's
DPOTrainer with peft. (KTO's two masters, summing their KL baseline, run in one process: test_preference.py.)"""

from __future__ import annotations

import pytest

from tests.fixtures import make_checkpoint, write_job
from tests.unit.test_preference import assert_equal_to_trl, dpo_job
from vela_ray import cli
from vela_ray.config import JobConfig
from vela_ray.training.summary import RunSummary
from vela_ray.training.tiny_model import CHAT_TEMPLATE


@pytest.mark.job
def test_vela_train_dpo_with_two_masters_equals_trl(ray_session, tmp_path):
    model_dir = make_checkpoint(tmp_path / "model", chat_template=CHAT_TEMPLATE)
    job = dpo_job(model_dir, tmp_path, steps=3, router_aux_loss_coef=0.0)  # a router aux loss does not split
    job["training"].update(batch_size=4, micro_batch_size=4)
    job["masters"] = {"count": 2}
    assert cli.main(["train", "--config", str(write_job(tmp_path / "dpo.yaml", job))]) == 0
    summary = RunSummary.load(tmp_path / "out")
    assert summary.objective == "dpo (sigmoid, beta 0.2)" and len(summary.master_nodes) == 2
    assert_equal_to_trl(JobConfig.from_dict(job), summary)

