"""A run's adapter in and out: `export` writes the standard peft adapter of the original model (backbone and
experts, a tensor-parallel master's LoRA gathered whole), `import_adapter` loads one into a master and its
workers (`lora.init_adapter`)."""

from __future__ import annotations

import re
import torch

from vela_ray.model.adapters import backbone_state_of, export_adapter
from vela_ray.training.expert_workers import ExpertWorkers
from vela_ray.training.master import MasterModel, load_master_state, master_state, parameters_of




def export(master: MasterModel, workers: ExpertWorkers, out_dir) -> None:
    """Write the standard peft adapter of the original model (see vela_ray.model.adapters); a tensor-parallel
    master's LoRA gathered whole, a pipeline's from every stage (`MasterModel.stage_states`)."""
    full = None
    if master.tp is not None:
        full = parameters_of(master_state(master))
    backbone = backbone_state_of(master.peft_model, full)
    if master.stage is not None:  # each stage's LoRA layers are its model's: peft reads them stage by stage
        for state in master.stage_states(False, adapter=True):
            backbone.update(state)
    export_adapter(out_dir, master.peft_model.base_model.model.config, master.full_lora_config, backbone,
                   workers.lora_state())


def import_adapter(master: MasterModel, workers: "ExpertWorkers", adapter_dir) -> dict[str, torch.Tensor]:
    """Load a peft adapter directory of the original model into master and workers (any placement). Returns the
    master's state after it (`master_state`: full tensors), for the other masters or ranks to load."""
    from vela_ray.model.adapters import check_adapter_matches, read_adapter

    config = master.peft_model.base_model.model.config
    lora_config, backbone_state, expert_state = read_adapter(adapter_dir, config)
    check_adapter_matches(lora_config, master.full_lora_config, adapter_dir)
    state = _with_backbone_adapter(master, backbone_state, adapter_dir)
    load_master_state(master, state)
    workers.load_lora_state(expert_state)
    return state


def _with_backbone_adapter(master: MasterModel, state: dict[str, torch.Tensor], adapter_dir) -> dict[str, torch.Tensor]:
    """The master's state (`master_state`) with a saved adapter's backbone factors in place of its LoRA parameters,
    by name.

    Not `peft.set_peft_model_state_dict`: peft 0.21 applies transformers' checkpoint renames to
    adapter keys at load time, and some rules are regexes that also match adapted names (laguna's
    "mlp.shared_expert." hits "mlp.shared_experts.", giving "shared_experts..down_proj"; inkling2's
    rename hits "k_sconv.weight_proj"), so the keys it loads no longer exist. The backbone adapts
    only plain nn.Linear layers, whose saved key "<module>.lora_A.weight" is parameter
    "<module>.lora_A.<adapter>.weight": no conversion is needed.
    """
    adapter = master.peft_model.active_adapter
    full = master_state(master)
    names = list(parameters_of(full))  # a pipeline's: every stage's
    by_key = {re.sub(rf"\.(lora_[AB])\.{adapter}\.weight$", r".\1.weight", n): n for n in names}
    # modules_to_save (the router trained in full): peft saves "<module>.<name>" of its trained copy, buffers too
    # (DeepSeek's e_score_correction_bias)
    buffers = {n: b for n, b in master.peft_model.named_buffers() if f".modules_to_save.{adapter}." in n}
    saved = {**by_key, **{n: n for n in buffers}}
    by_key = {re.sub(rf"\.modules_to_save\.{adapter}\.", ".", k): n for k, n in saved.items()}
    unknown = sorted(set(state) - set(by_key))
    if unknown:
        raise ValueError(f"{adapter_dir}: adapter keys not in this model: {unknown[:5]}")
    missing = sorted(set(by_key) - set(state))
    if missing:
        raise ValueError(f"{adapter_dir}: adapter lacks {missing[:3]} ({len(missing)} in all) of this model's "
                         "backbone LoRA layers")
    with torch.no_grad():
        for key, value in state.items():
            name = by_key[key]
            if name in buffers:  # not trained, so not in the state: copied in place (never sharded)
                buffers[name].copy_(value)
            else:
                full[name] = value.to(full[name].dtype).clone()
    return full
