"""Shared harness: train the same model with plain transformers + peft and with vela-ray.

Both sides start from the same random model and the same adapter (peft's,
with a random B so every LoRA factor gets gradients from step 0), see the same
micro-batches and learning rates, and clip the global grad norm. vela-ray's
side splits the experts over `num_workers` shards under a non-trivial placement
and moves rows through whichever transport `make_transport(shards)` returns.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Callable

import torch
from peft import get_peft_model, get_peft_model_state_dict

from vela_ray.model.adapters import full_lora_config
from vela_ray.model.experts import ExpertShard, LoraSpec
from vela_ray.model.families import debug_model
from vela_ray.model.modeling import expert_weights, experts_prototypes, find_moe_blocks
from vela_ray.training.optim import OptimizerConfig, ShardTrainer, lr_at, make_adamw
from vela_ray.training.step import ExpertWorkers, build_master, import_adapter, train_step
from vela_ray.model.transport import InProcessTransport

LORA = LoraSpec(r=4, alpha=8)
OPTIM = OptimizerConfig(lr=1e-2, max_grad_norm=0.5, warmup_steps=1)


def scattered_placement(num_layers: int, num_experts: int, num_workers: int = 3) -> torch.Tensor:
    """A placement that is neither sequential nor blocked: [L, E] -> worker."""
    return torch.tensor([[(l + 2 * e + e // 3) % num_workers for e in range(num_experts)] for l in range(num_layers)])


def micro_batches(step: int, vocab: int = 128, count: int = 2, batch: int = 2, seq: int = 12):
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


@dataclass
class Pair:
    reference: torch.nn.Module  # peft model
    ref_optimizer: torch.optim.Optimizer
    master: object  # training.MasterModel
    workers: object  # training.ExpertWorkers
    adapter_dir: str


def build_pair(family: str, make_transport: Callable | None = None, dtype=torch.float32,
               num_workers: int = 3, **config_overrides) -> Pair:
    reference = debug_model(family, seed=0, **config_overrides).to(dtype)
    cfg = full_lora_config(reference, LORA)
    cfg.init_lora_weights = False  # random A and B: every factor gets gradients at step 0
    torch.manual_seed(1)
    reference = get_peft_model(reference, cfg)
    adapter_dir = tempfile.mkdtemp(prefix="vela-eq-")
    reference.save_pretrained(adapter_dir)

    model = debug_model(family, seed=0, **config_overrides).to(dtype)
    blocks = find_moe_blocks(model)
    table = scattered_placement(len(blocks), blocks[0].layout.num_experts, num_workers)
    weights = expert_weights(blocks)
    shards = [
        ExpertShard.from_weights({k: w for k, w in weights.items() if table[k] == n}, LORA,
                                 experts_prototypes(model.config))
        for n in range(num_workers)
    ]
    transport = (make_transport or InProcessTransport)(shards)
    master = build_master(model, table, transport, LORA, OPTIM)
    workers = ExpertWorkers.in_process([ShardTrainer(s, OPTIM) for s in shards])
    import_adapter(master, workers, adapter_dir)
    ref_optimizer = make_adamw([p for p in reference.parameters() if p.requires_grad], OPTIM)
    return Pair(reference, ref_optimizer, master, workers, adapter_dir)


def reference_step(pair: Pair, batches, lr: float) -> float:
    model = pair.reference
    model.train()
    total = 0.0
    for batch in batches:
        loss = model(**batch).loss / len(batches)
        loss.backward()
        total += float(loss.detach())
    params = [p for p in model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, OPTIM.max_grad_norm)
    for group in pair.ref_optimizer.param_groups:
        group["lr"] = lr
    pair.ref_optimizer.step()
    pair.ref_optimizer.zero_grad()
    return total


def run_both(pair: Pair, steps: int = 5) -> tuple[list[float], list[float]]:
    ref_losses, vela_losses = [], []
    for step in range(steps):
        batches = micro_batches(step)
        lr = lr_at(OPTIM, step, steps)
        torch.manual_seed(step)  # both sides draw the same numbers (PhiMoE's router samples in training)
        ref_losses.append(reference_step(pair, batches, lr))
        torch.manual_seed(step)
        vela_losses.append(train_step(pair.master, pair.workers, batches, lr, OPTIM.max_grad_norm))
    return ref_losses, vela_losses


def reference_adapter_state(pair: Pair) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(pair.reference).items()}
