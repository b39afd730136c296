"""Helpers for the Ray tests: a synthetic MoE model, ExpertManager specs, and spawning them.

Starting an ExpertManager costs a few seconds (each actor imports torch and
transformers), so tests share the synthetic cluster (see conftest.py) and
spawn their own actors only where they must.
"""

from __future__ import annotations

import torch

from actors.cluster import ExpertCluster, spawn_expert_managers
from vela_ray.training.expert_manager import ExpertManagerSpec
from actors.transports import data_plane_env
from tests.equivalence import LORA, OPTIM, scattered_placement
from vela_ray.config import DataPlaneSection
from vela_ray.model.experts import ExpertKey, ExpertShard, ExpertWeights, LoraSpec
from vela_ray.model.families import mixtral_debug
from vela_ray.model.modeling import experts_prototypes
from vela_ray.training.expert_workers import ExpertWorkers

RAY_CPUS = 4
CPUS_PER_WORKER = 0.25  # actors mostly wait; this lets a few clusters coexist on a 2-core machine
TIMEOUT_S = 60.0  # every remote wait in these tests; a hang fails instead of blocking CI

# The synthetic model: 2 MoE layers of 6 experts, hidden 16, intermediate 24, 3 workers.
NUM_LAYERS, NUM_EXPERTS, HIDDEN, INTER, NUM_WORKERS = 2, 6, 16, 24, 3
# the synthetic experts compute as Mixtral's (SwiGLU) do: its config is the experts' `hf_config`
SYNTHETIC_CONFIG = mixtral_debug(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=NUM_EXPERTS,
                                 num_hidden_layers=NUM_LAYERS)
DATA_PLANE_ENV = data_plane_env(DataPlaneSection().inline_bytes, DataPlaneSection().zero_copy_tensors)


def synthetic_weights(seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for key in [(layer, expert) for layer in range(NUM_LAYERS) for expert in range(NUM_EXPERTS)]:
        weights[key] = {"gate_up_proj": 0.3 * torch.randn(2 * INTER, HIDDEN, generator=g),
                        "down_proj": 0.3 * torch.randn(HIDDEN, INTER, generator=g)}
    return weights


def synthetic_prototypes() -> dict:
    return experts_prototypes(SYNTHETIC_CONFIG)


def synthetic_placement() -> torch.Tensor:
    return scattered_placement(NUM_LAYERS, NUM_EXPERTS, NUM_WORKERS)


def random_lora_state(keys, lora: LoraSpec = LORA, seed: int = 1) -> dict[ExpertKey, dict[str, torch.Tensor]]:
    """Non-zero A and B for every expert, so every LoRA factor gets a gradient."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"lora_A_gate_up": (lora.r, HIDDEN), "lora_B_gate_up": (2 * INTER, lora.r),
              "lora_A_down": (lora.r, INTER), "lora_B_down": (HIDDEN, lora.r)}
    return {key: {name: 0.2 * torch.randn(shape, generator=g) for name, shape in shapes.items()} for key in keys}


def split_weights(weights, placement: torch.Tensor, num_workers: int) -> list[dict]:
    return [{k: w for k, w in weights.items() if int(placement[k]) == n} for n in range(num_workers)]


def specs_for(parts: list[dict], hf_config=SYNTHETIC_CONFIG, lora: LoraSpec = LORA) -> list[ExpertManagerSpec]:
    return [
        ExpertManagerSpec(worker=n, keys=sorted(part), weights=part, hf_config=hf_config, lora=lora, optim=OPTIM)
        for n, part in enumerate(parts)
    ]


def specs_from_shards(shards: list[ExpertShard], hf_config) -> list[ExpertManagerSpec]:
    """Specs hosting exactly the experts (and frozen weights) of in-process shards."""
    return specs_for([s.weights() for s in shards], hf_config)


# Replicated experts (several masters, each using its nearest copy) on the synthetic model's 3 workers: expert
# (0, 0) copied on every worker, (1, 0) on workers 0 and 1, the others hosted once.
REPLICATED_KEYS = [[(0, 0), (0, 1), (1, 0)], [(0, 0), (0, 2), (1, 0)], [(0, 0), (0, 3)]]
REPLICATED_COPIES = {(0, 0): [0, 1, 2], (1, 0): [0, 1]}


def replicated_specs() -> list[ExpertManagerSpec]:
    weights = synthetic_weights()
    return specs_for([{key: weights[key] for key in keys} for keys in REPLICATED_KEYS])


def worker_rows(keys: list[ExpertKey], seed: int) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A worker's share of a step: per layer of `keys`, (layer, expert ids [R], rows [R, HIDDEN], d(outputs)
    [R, HIDDEN]) with 4 rows for each of its experts there, drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in sorted({layer for layer, _ in keys}):
        ids = torch.tensor([e for l, e in keys if l == layer]).repeat_interleave(4)
        out.append((layer, ids, torch.randn(len(ids), HIDDEN, generator=g), torch.randn(len(ids), HIDDEN, generator=g)))
    return out


def replicas_mid_step(workers: ExpertWorkers) -> list[dict]:
    """Workers of `replicated_specs` with the same random adapters, after each ran a share of rows of its own
    forward and backward (so copies of one expert have different gradients); each worker's gradients."""
    workers.load_lora_state(random_lora_state(sorted({key for keys in REPLICATED_KEYS for key in keys})))
    for worker, keys in enumerate(REPLICATED_KEYS):
        for layer, ids, rows, grad in worker_rows(keys, seed=worker):
            workers.wait([workers.call_one(worker, "forward_rows", layer, ids, rows, layer)])
            workers.wait([workers.call_one(worker, "backward_rows", layer, grad)])
    return workers.wait([workers.call_one(worker, "lora_grads") for worker in range(workers.num_workers)])


def summed_in_worker_order(grads: list[dict], copies: dict[ExpertKey, list[int]]) -> dict:
    """{copied expert: {factor: the sum of its copies' gradients `grads[worker]`, added in worker order}}."""
    summed = {}
    for key, workers in copies.items():
        summed[key] = {name: grads[workers[0]][key][name].clone() for name in grads[workers[0]][key]}
        for worker in workers[1:]:
            for name, grad in grads[worker][key].items():
                summed[key][name] += grad
    return summed


def spawn(specs: list[ExpertManagerSpec]) -> ExpertCluster:
    """ExpertManagers as jobs start them, with the default data-plane settings (`data_plane_env`)."""
    return spawn_expert_managers(specs, num_cpus_per_worker=CPUS_PER_WORKER, ready_timeout_s=120,
                                 env_vars=DATA_PLANE_ENV)
