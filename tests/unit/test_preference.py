"""Preference objectives (`training.preference`): DPO through vela-ray equal to TRL's DPOTrainer with peft, the
reference model the base one with every adapter off, on the master and on the ExpertManagers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.fixtures import (LiveBytes, chat_tokenizer, init_adapter, make_checkpoint, peft_job, reference_losses,
                            run_in_process, trl_dpo_loss)
from vela_ray.config import DPO_LOSS_TYPES, JobConfig, PreferenceSection
from vela_ray.model.experts import ExpertShard, LoraSpec, without_adapters
from vela_ray.model.families import debug_model
from vela_ray.model.transport import ForwardRequest, InProcessTransport
from vela_ray.model.modeling import expert_weights, experts_prototypes, find_moe_blocks
from vela_ray.paths import data_dir
from vela_ray.training import tiered as tiered_module
from vela_ray.training.tiers import TierSpeeds
from vela_ray.training.equivalence import build_pair
from vela_ray.training.step import model_loss
from vela_ray.training.preference import (DpoLoss, answer_logps, metric_means, own_examples,
                                         reference_model)
from vela_ray.training.tiny_model import CHAT_TEMPLATE, tiny_model_path


def dpo_records(count: int = 12) -> list[dict]:
    """LLaMA-Factory's dpo_en_demo shape: ShareGPT `conversations` ending on a human turn, `chosen` and `rejected`
    one gpt message each. The texts are Tiny Shakespeare's lines: the prompt a line, the chosen answer the line
    that follows it, the rejected one the same words in another order (a preference a small model can learn and
    carry to pairs it has not seen: word order)."""
    lines = [line for line in (data_dir() / "tinyshakespeare" / "input.txt").read_text().splitlines()
             if len(line.split()) > 4][:2 * count]
    return [{"conversations": [{"from": "human", "value": lines[2 * i]}],
             "chosen": {"from": "gpt", "value": lines[2 * i + 1]},
             "rejected": {"from": "gpt", "value": " ".join(lines[2 * i + 1].split()[::-1])}} for i in range(count)]


def dpo_job(model_dir: Path, tmp_path: Path, steps: int = 5, **preference) -> dict:
    data = tmp_path / "dpo_en_demo.json"
    data.write_text(json.dumps(dpo_records()))
    return peft_job(model_dir, tmp_path, steps=steps,
                    data={"kind": "preference", "path": str(data), "seq_len": 96, "limit": None},
                    training={"batch_size": 2, "micro_batch_size": 2, "eval_fraction": 0.2, "eval_every": 5,
                              "eval_batches": 1, "preference": {"objective": "dpo", "beta": 0.2, **preference}})


def kto_records(count: int = 12) -> list[dict]:
    """LLaMA-Factory's kto_en_demo shape: OpenAI-style `messages` (a user turn, then the assistant's answer) and a
    boolean `label`: the line that follows marked desirable, the same words reversed not; three words each, so that
    every example fits a row whole (KTO's KL sequences borrow whole answers)."""
    def short(text: str) -> str:
        return " ".join(text.split()[:3])
    return [{"messages": [{"role": "user", "content": short(pair["conversations"][0]["value"])},
                          {"role": "assistant", "content": short(pair["chosen" if i % 2 else "rejected"]["value"])}],
             "label": bool(i % 2)} for i, pair in enumerate(dpo_records(count))]


KTO_ENTRY = {"formatting": "sharegpt", "columns": {"messages": "messages", "kto_tag": "label"},
             "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}
"""LLaMA-Factory's dataset_info.json entry of kto_en_demo.json."""


def kto_job(model_dir: Path, tmp_path: Path, steps: int = 5, **preference) -> dict:
    data = llama_factory_dir(tmp_path, kto_records(), "kto_en_demo.json", KTO_ENTRY)
    return peft_job(model_dir, tmp_path, steps=steps,
                    data={"kind": "unpaired_preference", "path": None, "dataset_info": str(data),
                          "name": "kto_en_demo", "seq_len": 96, "limit": None},
                    training={"batch_size": 4, "micro_batch_size": 4, "eval_fraction": 0.2, "eval_every": 5,
                              "eval_batches": 1, "preference": {"objective": "kto", "beta": 0.2, **preference}})


def assert_equal_to_trl(config: JobConfig, summary, rtol: float = 1e-5) -> None:
    trl_metrics: dict = {}
    ref_losses, ref_state = reference_losses(config, trl_metrics=trl_metrics)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected", "kl"):  # one micro-batch a step: TRL logs each step's
        if name not in trl_metrics["train"]:
            continue
        ours = [record.preference[name] for record in summary.history if name in record.preference]  # TRL: the
        # steps with such examples (a KTO micro-batch may hold no undesirable one)
        torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64),
                                   torch.tensor(trl_metrics["train"][name], dtype=torch.float64), rtol=2e-4, atol=2e-5)
    exported = load_file(Path(summary.adapter_dir) / "adapter_model.safetensors")
    assert exported.keys() == ref_state.keys()
    for key, value in ref_state.items():  # AdamW's first steps amplify rounding
        assert float((exported[key] - value).abs().max()) <= 2e-3 * float(value.abs().max()), key


@pytest.mark.job
@pytest.mark.parametrize("objective,family,preference", [
    ("dpo", "mixtral", {}),                                    # the router aux loss at the config's coefficient
    ("dpo", "qwen3_moe", {"router_aux_loss_coef": 0.0, "loss_type": ["sigmoid", "sft"]}),
    ("dpo", "deepseek_v3", {"loss_type": "ipo"}),              # shared experts, a length-normalised loss
    ("kto", "mixtral", {}),                                    # kto, its KL baseline, the aux loss
    ("kto", "qwen3_moe", {"router_aux_loss_coef": 0.0, "loss_type": "apo_zero_unpaired"}),
    ("kto", "deepseek_v3", {"desirable_weight": 1.5, "undesirable_weight": 0.5}),
])
def test_preference_in_one_process_equals_trl(tmp_path, objective, family, preference):
    model_dir = make_checkpoint(tmp_path / "model", family, chat_template=CHAT_TEMPLATE)
    job = {"dpo": dpo_job, "kto": kto_job}[objective](model_dir, tmp_path, **preference)
    config = JobConfig.from_dict(job)
    config.preflight()
    summary = run_in_process(config)
    assert_equal_to_trl(config, summary)
    assert summary.history[-1].eval_preference is not None and summary.history[-1].eval_loss is not None


def test_the_reference_is_the_base_model_with_every_adapter_off(tmp_path):
    """`reference_model`: peft's adapters off on the master and the experts' LoRA off on the shard that computes
    them, to the bit; outside it the adapters are back. The start adapter is random (B != 0): it changes the
    output, so a reference that kept any adapter on would differ."""
    model_dir = make_checkpoint(tmp_path / "model", "mixtral")
    adapter = init_adapter(model_dir, tmp_path / "init")
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    ids = torch.randint(3, 200, (2, 10))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        with reference_model(peft_model):
            reference = peft_model(input_ids=ids).logits
        adapted = peft_model(input_ids=ids).logits
    assert torch.equal(reference, plain)
    assert not torch.allclose(adapted, plain)
    # the expert side: a shard's LoRA (B != 0) left out within without_adapters, and only on this thread's calls
    blocks = find_moe_blocks(base)
    shard = ExpertShard.from_weights(expert_weights(blocks), LoraSpec(r=4, alpha=8), experts_prototypes(base.config))
    for factor in shard.lora_parameters():
        torch.nn.init.normal_(factor)
    rows, expert_ids = torch.randn(6, base.config.hidden_size), torch.tensor([0, 1, 2, 3, 0, 1])
    with torch.no_grad():
        lora = shard.forward_rows(0, expert_ids, rows)
        with without_adapters():
            frozen = shard.forward_rows(0, expert_ids, rows)
        asked = shard.forward_rows(0, expert_ids, rows, adapters=False)
    assert torch.equal(frozen, asked) and not torch.allclose(lora, frozen)
    # what travels: a request asking for the base model gets it from a transport's worker, whatever thread asks
    request = ForwardRequest(0, expert_ids, rows, adapters=False)
    with torch.no_grad():
        answered = InProcessTransport([shard]).forward({0: request})[0]
    assert torch.equal(answered, frozen)


def test_several_masters_score_whole_pairs_that_add_up_to_the_micro_batch(tmp_path):
    """Each master takes whole pairs (`own_examples`); their loss shares add up to the one-master loss, and the
    metric sums to the same means."""
    assert own_examples(5, 0, 2, 2).tolist() == [0, 1, 2, 3, 4, 5] and own_examples(5, 1, 2, 2).tolist() == [6, 7, 8, 9]
    with pytest.raises(ValueError, match="2 preference examples cannot feed 3 masters"):
        own_examples(2, 0, 3, 2)
    model_dir = make_checkpoint(tmp_path / "model", "mixtral")
    adapter = init_adapter(model_dir, tmp_path / "init")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    section = PreferenceSection(objective="dpo", router_aux_loss_coef=0.0)
    ids = torch.randint(3, 200, (6, 12))
    labels = ids.clone()
    labels[:, :4] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    whole = DpoLoss(section, model.config)
    shares = [DpoLoss(section, model.config, rank, 2) for rank in range(2)]
    with torch.no_grad():
        total = float(whole(model, batch))
        parts = [float(share(model, batch)) for share in shares]
    assert sum(parts) == pytest.approx(total, rel=1e-6)
    means = metric_means([s.take_sums() for s in shares])
    assert means == pytest.approx(metric_means([whole.take_sums()]), rel=1e-6)
    assert answer_logps(torch.zeros(1, 3, 5), torch.tensor([[-100, 1, 2]])).item() == pytest.approx(2 * -1.6094379)


def test_the_reference_costs_no_memory_beyond_sfts_on_the_same_rows():
    """No second copy and no extra peak: a DPO step's forward and backward (reference pass included) allocate at
    their peak at most 1.1x what SFT's do on the same rows, counted over the master and its in-process workers (the
    tensors alive at once, `LiveBytes`); and the reference pass leaves no graph on the workers (as many saved
    forwards after the step's forward as SFT's)."""
    pair = build_pair(lambda: debug_model("mixtral", seed=0))
    model, shards = pair.master.peft_model, [trainer.shard for trainer in pair.trainers]
    ids = torch.randint(3, 100, (8, 32), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :12] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    section = PreferenceSection(objective="dpo")
    peaks, saved = {}, {}
    for name, loss_fn in (("sft", model_loss), ("dpo", DpoLoss(section, model.config))):
        with LiveBytes() as live:
            loss = loss_fn(model, batch)
            saved[name] = sum(len(shard._saved) for shard in shards)
            loss.backward()
        peaks[name] = live.peak
        model.zero_grad(set_to_none=True)
        for shard in shards:
            shard.zero_grad(set_to_none=True)
    assert saved["dpo"] == saved["sft"] > 0
    assert peaks["dpo"] <= 1.1 * peaks["sft"], peaks


def llama_factory_dir(tmp_path: Path, records: list[dict], file_name: str, entry: dict) -> Path:
    """A LLaMA-Factory `data/` directory: `records` in `file_name` and a dataset_info.json naming them."""
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / file_name).write_text(json.dumps(records))
    info = data / "dataset_info.json"
    entries = json.loads(info.read_text()) if info.exists() else {}
    info.write_text(json.dumps({**entries, file_name.removesuffix(".json"): {"file_name": file_name, **entry}}))
    return data


@pytest.mark.job
def test_dpo_on_llama_factorys_dpo_en_demo_raises_the_reward_accuracy(tmp_path):
    """The tiny pre-trained model, DPO on a dpo_en_demo-shaped file read through dataset_info.json (ranking: true):
    the chosen answer's reward overtakes the rejected one's in training and on the held-out pairs."""
    data = llama_factory_dir(tmp_path, dpo_records(48), "dpo_en_demo.json",
                             {"ranking": True, "formatting": "sharegpt",
                              "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}})
    job = peft_job(tiny_model_path(), tmp_path, steps=16,
                   data={"kind": "preference", "path": None, "dataset_info": str(data), "name": "dpo_en_demo",
                         "seq_len": 96, "limit": None},
                   training={"batch_size": 4, "eval_fraction": 0.25, "eval_every": 16, "eval_batches": 3,
                             "optimizer": {"lr": 2e-3, "warmup_steps": 2},
                             "preference": {"objective": "dpo", "beta": 0.1}})
    del job["lora"]["init_adapter"]  # a fresh adapter: the policy starts as the reference, every reward 0
    summary = run_in_process(JobConfig.from_dict(job))
    accuracies = [record.preference["rewards/accuracies"] for record in summary.history]
    assert accuracies[0] == 0.0  # step 1: policy = reference, no pair is ahead yet
    assert sum(accuracies[-4:]) / 4 >= 0.75, accuracies
    assert summary.history[-1].eval_preference["rewards/accuracies"] >= 0.75, summary.history[-1].eval_preference
    assert np.mean([record.preference["rewards/margins"] for record in summary.history[-4:]]) > 0  # one batch may dip


@pytest.mark.job
def test_dpo_with_cpu_and_device_expert_tiers_equals_trl(tmp_path, monkeypatch):
    """APTMoE's tiers answer the reference's rows from either tier without LoRA (speeds as if a device were there:
    the busy experts go to the CPU-backed device tier, as in tests/unit/test_tiers.py)."""
    monkeypatch.setattr(tiered_module, "measure_speeds", lambda tiered: TierSpeeds(
        cpu_s_per_row=1e-5, device_s_per_row=1e-7, upload_bytes_per_s=1e8, bytes_per_expert=10**4))
    model_dir = make_checkpoint(tmp_path / "model", chat_template=CHAT_TEMPLATE)
    job = dpo_job(model_dir, tmp_path, steps=3)
    job.update(cluster={**job["cluster"], "num_workers": 2}, expert_tiers={"enabled": True, "cache_experts": 3})
    config = JobConfig.from_dict(job)
    summary = run_in_process(config)
    assert_equal_to_trl(config, summary)
    assert all(stats.experts_device > 0 for stats in summary.expert_tiers)


def test_bad_preference_settings_are_one_line_before_anything_runs(tmp_path):
    base = dpo_job(make_checkpoint(tmp_path / "model", chat_template=CHAT_TEMPLATE), tmp_path)

    def refused(change: dict, match: str) -> None:
        raw = json.loads(json.dumps(base))
        for section, values in change.items():
            raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
        with pytest.raises(ValueError, match=match):
            JobConfig.from_dict(raw)

    training = base["training"]
    refused({"training": {**training, "method": "zo"}},
            r"objective dpo or kto and training.method: zo.* do not combine: .* Fix: use objective: sft")
    refused({"training": {**training, "condensation": {"enabled": True}}}, r"training.condensation.enabled")
    refused({"masters": {"count": 2, "sequence_migration": True}}, r"masters.sequence_migration")
    refused({"mode": "expert_parallel"}, r"training.preference\) do not combine")
    refused({"data": {**base["data"], "kind": "chat"}}, r"objective dpo trains on data.kind preference, not chat")
    refused({"training": {**training, "preference": {"objective": "sft"}}},
            r"data.kind preference holds preference data.* set training.preference.objective: dpo")
    refused({"training": {**training, "preference": {"objective": "dpo", "loss_type": "kto"}}},
            r"loss_type \['kto'\] is not a loss of objective dpo")
    refused({"training": {**training, "preference": {"objective": "dpo", "loss_type": ["sigmoid", "sft"],
                                                     "loss_weights": [1.0]}}}, r"1 weights for 2 loss types")
    refused({"training": {**training, "micro_batch_size": 1, "preference": {"objective": "kto"}},
             "data": {**base["data"], "kind": "unpaired_preference"}}, r"micro_batch_size 1 with KTO")
    # KTO's KL sequences borrow answers whole: data cut at seq_len is refused by preflight, naming the seq_len
    kto = JobConfig.from_dict({**kto_job(Path(base["model"]["path"]), tmp_path / "kto"),
                               "data": {"kind": "unpaired_preference", "dataset_info": str(tmp_path / "kto" / "data"),
                                        "name": "kto_en_demo", "seq_len": 64}})
    with pytest.raises(ValueError, match=r"examples are longer than data.seq_len 64 .* raise data.seq_len to \d+, "
                                         r"or use training.preference.loss_type apo_zero_unpaired"):
        kto.preflight()


@pytest.mark.job
def test_kto_on_llama_factorys_kto_en_demo_raises_the_reward_margin(tmp_path):
    """The tiny pre-trained model, KTO on a kto_en_demo-shaped file through dataset_info.json (its kto_tag column):
    the desirable answers' rewards overtake the undesirable ones', in training and on held-out examples."""
    data = llama_factory_dir(tmp_path, kto_records(64), "kto_en_demo.json", KTO_ENTRY)
    job = peft_job(tiny_model_path(), tmp_path, steps=16,
                   data={"kind": "unpaired_preference", "path": None, "dataset_info": str(data),
                         "name": "kto_en_demo", "seq_len": 96, "limit": None},
                   training={"batch_size": 8, "eval_fraction": 0.25, "eval_every": 16, "eval_batches": 2,
                             "optimizer": {"lr": 2e-3, "warmup_steps": 2},
                             "preference": {"objective": "kto", "beta": 0.1}})
    del job["lora"]["init_adapter"]
    summary = run_in_process(JobConfig.from_dict(job))
    margins = [record.preference["rewards/margins"] for record in summary.history]
    assert margins[0] == 0.0
    # each step's margin is its own batch's (one may dip below 0: -0.014 once among 0.3-0.5), so the last steps' mean
    # against the first steps': 0.34-0.45 against -0.005-0.009 on the tiny model built on one or two threads
    assert np.mean(margins[-4:]) > np.mean(margins[:4]) + 0.1 and np.mean(margins[-4:]) > 0.1, margins
    assert summary.history[-1].eval_preference["rewards/margins"] > 0, summary.history[-1].eval_preference


@pytest.fixture(scope="module")
def adapted_mixtral(tmp_path_factory):
    """A debug Mixtral with a chat template and a random start adapter (B != 0: the reference differs)."""
    tmp = tmp_path_factory.mktemp("adapted")
    model_dir = make_checkpoint(tmp / "model", chat_template=CHAT_TEMPLATE)
    return model_dir, init_adapter(model_dir, tmp / "init")


@pytest.mark.parametrize("objective,settings", [
    *[("dpo", {"loss_type": t}) for t in DPO_LOSS_TYPES if t not in ("sigmoid", "ipo", "exo_pair")],
    ("dpo", {"loss_type": "exo_pair", "label_smoothing": 1e-3}),
    ("dpo", {"loss_type": "robust", "label_smoothing": 0.2, "router_aux_loss_coef": 0.0}),
    ("dpo", {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0], "beta": 0.5}),
])
def test_every_loss_type_equals_trls_on_one_micro_batch(adapted_mixtral, tmp_path, objective, settings):
    """Each of TRL's loss types the whole-job tests leave out: loss, gradients and metrics of one micro-batch equal
    TRL's `compute_loss` on the same rows (rel 1e-5)."""
    model_dir, adapter = adapted_mixtral
    section = PreferenceSection(objective=objective, **{"beta": 0.2, **settings})

    def model():
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, use_cache=False), adapter,
                                         is_trainable=True)
    ids = torch.randint(3, 200, (6, 14), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[1, -3:] = attention[4, -5:] = 0
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :5] = -100
    batch = {"input_ids": ids, "attention_mask": attention, "labels": labels}
    ours, theirs = model(), model()
    vela = DpoLoss(section, ours.config)
    loss = vela(ours, batch)
    loss.backward()
    trl = trl_dpo_loss(theirs, section, chat_tokenizer(), tmp_path / "trl")
    reference = trl(batch)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    grads = {name: p.grad for name, p in theirs.named_parameters() if p.grad is not None}
    for name, p in ours.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-5 * float(grads[name].abs().max()))
    means = metric_means([vela.take_sums()])
    for name, values in trl.metrics.items():
        if name in means:
            assert means[name] == pytest.approx(values[-1], rel=1e-4, abs=1e-6), name


@pytest.mark.job
def test_a_dpo_run_resumed_from_its_checkpoint_trains_as_the_whole_run(tmp_path):
    """Checkpoints hold what a DPO run needs, as an SFT run's (adapters, AdamW, RNG, step): resumed at step 2 of 4,
    the losses, TRL's metrics and the adapter are the whole run's."""
    model_dir = make_checkpoint(tmp_path / "model", chat_template=CHAT_TEMPLATE)
    job = dpo_job(model_dir, tmp_path, steps=4)
    job["checkpoint"] = {"every": 2, "keep": 2}
    full = run_in_process(JobConfig.from_dict(job))
    job["output"] = {"dir": str(tmp_path / "resumed")}
    job["checkpoint"].update(dir=str(tmp_path / "out" / "checkpoints"),
                             resume=str(tmp_path / "out" / "checkpoints" / "step-000002"))
    resumed = run_in_process(JobConfig.from_dict(job))
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses), rtol=1e-5, atol=0)
    for ours, whole in zip(resumed.history[2:], full.history[2:]):
        assert ours.preference == pytest.approx(whole.preference, rel=1e-5)
    exported, whole = (load_file(Path(s.adapter_dir) / "adapter_model.safetensors") for s in (resumed, full))
    for key, value in whole.items():
        torch.testing.assert_close(exported[key], value, rtol=1e-4, atol=1e-6)


@pytest.mark.job
def test_dpo_with_a_tensor_parallel_master_equals_trl(tmp_path):
    """peft's `disable_adapter` reaches the tensor-parallel master's sharded LoRA layers: the reference of a master
    split over 2 ranks is the base model too."""
    model_dir = make_checkpoint(tmp_path / "model", chat_template=CHAT_TEMPLATE)
    job = dpo_job(model_dir, tmp_path, steps=3, router_aux_loss_coef=0.0)
    job["cluster"] = {**job["cluster"], "master_tp": 2}
    config = JobConfig.from_dict(job)
    summary = run_in_process(config)
    assert summary.master_tp == 2
    assert_equal_to_trl(config, summary)


@pytest.mark.job
def test_kto_with_two_masters_sums_its_kl_baseline_over_them_and_equals_trl(tmp_path):
    """KTO's KL baseline is the whole micro-batch's mean: each of two data-parallel masters scores its own examples
    and the two sum their KL terms over their group (each alone would differ: rel 5e-4 here)."""
    model_dir = make_checkpoint(tmp_path / "model", chat_template=CHAT_TEMPLATE)
    job = kto_job(model_dir, tmp_path, steps=3, router_aux_loss_coef=0.0)  # a router aux loss does not split
    job["masters"] = {"count": 2}
    config = JobConfig.from_dict(job)
    summary = run_in_process(config)
    assert summary.objective == "kto (kto, beta 0.2)" and len(summary.master_nodes) == 2
    assert all(record.preference["kl"] >= 0 for record in summary.history)
    assert_equal_to_trl(config, summary)
