"""Activation checkpointing through the expert broker (`modeling.enable_activation_checkpointing`).

Checkpointed decoder layers recompute their activations in backward; the broker replays the
experts' outputs from the first forward instead of sending the rows again. Shown against plain
transformers + peft with its own checkpointing, against vela-ray without checkpointing (the same
numbers and the same rows on every link), and through the in-process workers' saved graphs.
"""

from __future__ import annotations

import pytest
import torch

from tests.equivalence import build_pair, run_both
from vela_ray.model.modeling import enable_activation_checkpointing, find_moe_blocks
from vela_ray.training.adapter_io import export
from safetensors.torch import load_file

FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]


def checkpointed(pair):
    """Both sides of an equivalence pair with activation checkpointing on: peft's reference with
    transformers' own (non-reentrant), vela-ray's master with the broker's recompute contexts."""
    pair.reference.base_model.model.activation_checkpointing_enable({"use_reentrant": False})
    enable_activation_checkpointing(pair.master.peft_model.base_model.model)
    return pair


def _rows(pair) -> torch.Tensor:
    """Rows counted on every (layer, worker, direction) so far."""
    return torch.tensor(pair.master.dispatcher.traffic().rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointed_training_equals_peft_and_sends_each_row_once(family, tmp_path):
    torch.set_num_threads(1)
    plain = build_pair(family)
    plain_ref, plain_vela = run_both(plain, steps=3)
    pair = checkpointed(build_pair(family))
    ref_losses, vela_losses = run_both(pair, steps=3)

    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(ref_losses), torch.tensor(plain_ref), rtol=1e-5, atol=0)
    # the recompute changes nothing in vela-ray's arithmetic: the same losses and adapter as without it
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(plain_vela), rtol=1e-6, atol=0)
    export(plain.master, plain.workers, tmp_path / "plain")
    export(pair.master, pair.workers, tmp_path / "checkpointed")
    want, got = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("plain", "checkpointed"))
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, msg=key)
    # every row crossed each link once per step each way, as without checkpointing; no graph left behind
    assert torch.equal(_rows(pair), _rows(plain))
    assert _rows(pair)[:, :, 0].sum() > 0
    assert all(not trainer.shard._saved for trainer in pair.trainers)
    # routing counted once per forward
    assert pair.master.dispatcher.traffic().routed == plain.master.dispatcher.traffic().routed


def test_a_layer_that_is_checkpointed_really_recomputes():
    """The premise: transformers' checkpointing runs each decoder layer's forward twice per step (else the
    test above would pass with checkpointing off)."""
    pair = checkpointed(build_pair("mixtral"))
    calls = []
    layer = pair.master.peft_model.base_model.model.model.layers[0]
    layer.self_attn.register_forward_hook(lambda *_: calls.append(1))
    run_both(pair, steps=1)
    assert len(calls) == 2 * 2  # two micro-batches, forward + recompute each


def test_a_model_checkpointed_by_the_user_gets_the_broker_replay():
    """A model whose checkpointing the user turned on before vela-ray attached brokers is not refused:
    the brokers' recompute contexts are installed, and no row travels twice."""
    from vela_ray.model.families import debug_model
    from vela_ray.model.modeling import attach_brokers
    from vela_ray.model.broker import ExpertDispatcher
    from vela_ray.model.transport import InProcessTransport
    from vela_ray.model.experts import ExpertShard, LoraSpec
    from vela_ray.model.modeling import expert_weights, experts_prototypes

    model = debug_model("mixtral", seed=0)
    blocks = find_moe_blocks(model)
    shard = ExpertShard.from_weights(expert_weights(blocks), LoraSpec(r=4, alpha=8), experts_prototypes(model.config))
    model.activation_checkpointing_enable()
    dispatcher = ExpertDispatcher(torch.zeros(len(blocks), blocks[0].layout.num_experts, dtype=torch.long),
                                  InProcessTransport([shard]))
    attach_brokers(model, dispatcher)
    model.train()
    ids = torch.randint(3, 100, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    rows = torch.tensor(dispatcher.traffic().rows)
    assert torch.equal(rows[:, :, 0], rows[:, :, 2])  # dispatched once, gradients once
    assert not shard._saved


# -- whole jobs: every feature that touches the broker, with and without checkpointing -------------------------

NODES = ["node-a", "node-b", "node-c"]
COMBINATIONS = {
    "three masters, sequence migration": {"masters": {"count": 3, "sequence_migration": True}},
    "two masters, replicated experts": {"masters": {"count": 2}, "placement": {"replicas": True}},
    "condensation (lossy)": {"training": {"condensation": {"enabled": True}}},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.fixtures import init_adapter, make_checkpoint

    model = make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")
    init_adapter(model, model.parent / "adapter")
    return model


def _job(model_dir, out, sections: dict, checkpointing: bool):
    from tests.fixtures import job_dict
    from vela_ray.config import JobConfig

    training = {"optimizer": {"lr": 5e-3, "warmup_steps": 1}, "batch_size": 6, "micro_batch_size": 6,
                "activation_checkpointing": checkpointing}
    sections = {**sections, "training": {**training, **sections.get("training", {})}}
    return JobConfig.from_dict(job_dict(model_dir, out, steps=3, **sections,
                                        lora={"r": 4, "alpha": 8, "init_adapter": str(model_dir.parent / "adapter")}))


@pytest.mark.job
@pytest.mark.parametrize("combination", COMBINATIONS)
def test_checkpointed_jobs_train_and_send_like_unchecked_ones(model_dir, tmp_path, combination, monkeypatch):
    from tests.fixtures import run_in_process
    from vela_ray.model import checkpoint_replay

    replayed = []
    replay = checkpoint_replay._LayerCalls.replay
    monkeypatch.setattr(checkpoint_replay._LayerCalls, "replay", lambda self: replayed.append(1) or replay(self))
    runs = {}
    for on in (False, True):
        runs[on] = run_in_process(_job(model_dir, tmp_path / str(on), COMBINATIONS[combination], on),
                                  master_node=NODES[0], worker_nodes=NODES)
        assert bool(replayed) == on  # the checkpointed job did recompute its layers (and replayed the experts)
    torch.testing.assert_close(torch.tensor(runs[True].losses), torch.tensor(runs[False].losses), rtol=1e-6, atol=0)
    assert runs[True].traffic_bytes_by_tier == runs[False].traffic_bytes_by_tier
    assert runs[True].traffic_bytes_by_worker == runs[False].traffic_bytes_by_worker
    assert runs[True].tokens_routed == runs[False].tokens_routed  # routing counted once per forward
    assert sum(runs[True].traffic_bytes_by_tier.values()) > 0


def test_zo_says_it_needs_no_checkpointing(model_dir, tmp_path, caplog):
    config = _job(model_dir, tmp_path, {"training": {"method": "zo"}}, True)
    assert "training.activation_checkpointing is unused by method: zo" in caplog.text
    from vela_ray.runtime.masters import master_spec

    assert not master_spec(config).activation_checkpointing
