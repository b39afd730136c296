"""`vela train` on chat data as fine-tuners bring it: ShareGPT JSONL, and OpenAI-style messages in Parquet
with packing; both equal plain transformers + peft over the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, run_in_process, write_job
from vela_ray import cli
from vela_ray.config import JobConfig
from vela_ray.data.chat import alpaca_to_messages
from vela_ray.data.datasets import load_instruct_examples
from vela_ray.paths import data_dir
from vela_ray.training.summary import RunSummary
from vela_ray.training.tiny_model import CHAT_TEMPLATE

STEPS = 3
SEED_TASKS = data_dir() / "instruct" / "alpaca_seed_tasks.jsonl"


def _conversations(count: int) -> list[list[dict]]:
    """Alpaca seed tasks as conversations; every third gets a system prompt and a second turn."""
    examples = load_instruct_examples(SEED_TASKS, limit=2 * count)
    out = []
    for i in range(count):
        messages = alpaca_to_messages(examples[i], system="Answer briefly." if i % 3 == 0 else None)
        if i % 3 == 0:
            messages += alpaca_to_messages(examples[count + i])
        out.append(messages)
    return out


def _sharegpt_jsonl(path: Path, conversations) -> Path:
    sharegpt = {"user": "human", "assistant": "gpt", "system": "system"}
    with path.open("w") as f:
        for messages in conversations:
            f.write(json.dumps({"conversations": [{"from": sharegpt[m["role"]], "value": m["content"]}
                                                  for m in messages]}) + "\n")
    return path


def _messages_parquet(path: Path, conversations) -> Path:
    import datasets

    datasets.Dataset.from_list([{"dialog": messages} for messages in conversations]).to_parquet(str(path))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("chat") / "model", vocab=1024, chat_template=CHAT_TEMPLATE,
                           max_position_embeddings=256)


@pytest.mark.parametrize("layout", ["sharegpt_jsonl", "messages_parquet_packed"])
def test_vela_train_on_chat_files_equals_peft(ray_session, model_dir, tmp_path, layout):
    """ShareGPT runs as a user runs it (`vela train` over Ray); the packed Parquet file, whose difference
    is all in the data, runs the same job in one process (`InProcessPool`)."""
    conversations = _conversations(60)
    if layout == "sharegpt_jsonl":
        data = {"path": str(_sharegpt_jsonl(tmp_path / "chat.jsonl", conversations))}
    else:  # a column named otherwise, mapped; several conversations per row
        data = {"path": str(_messages_parquet(tmp_path / "chat.parquet", conversations)),
                "columns": {"messages": "dialog"}, "packing": True}
    job = job_dict(model_dir, tmp_path / "out", steps=STEPS, data={"kind": "chat", "seq_len": 128, **data},
                   lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))},
                   training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}})
    config = JobConfig.from_dict(job)
    if layout == "sharegpt_jsonl":
        assert cli.main(["train", "--config", str(write_job(tmp_path / "job.yaml", job))]) == 0
        summary = RunSummary.load(config.output.dir)
    else:
        config.preflight()
        summary = run_in_process(config)
    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert summary.data.kind == "chat" and summary.data.packing == (layout != "sharegpt_jsonl")
    assert summary.tokens_per_s > 0 and all(h.tokens > 0 for h in summary.history)
    assert 0 <= summary.data.padding_fraction < 1 and summary.data.tokens > 0
