"""bf16 experts in real ExpertManager actors train as peft's do at lr 3e-5 (issue 30), over both Ray transports.

The unit test (tests/unit/test_bf16_expert_adapters.py) shows it in one process; here the factors and
their AdamW moments live in the actors, stay fp32 there, and their updates after 10 steps equal peft's
within what bf16 rounding alone does to peft (`tests.equivalence.assert_updates_within_rounding`).
"""

from __future__ import annotations

import pytest
import ray
import torch

from actors.transports import RayObjectRefTransport, collective_transport
from actors.workers import actor_workers
from tests.equivalence import LORA, Pair, assert_updates_within_rounding, build_pair, expert_drifts
from tests.ray.helpers import TIMEOUT_S
from vela_ray.model.experts import ExpertShard
from vela_ray.model.families import debug_config
from vela_ray.training.expert_manager import ExpertManagerSpec
from vela_ray.training.schedule import OptimizerConfig

FAMILY = "mixtral"
BF16_OPTIM = OptimizerConfig(lr=3e-5, schedule="constant")
STEPS = 10  # through actors a step takes ~2.5 s on 2 cores; 10 already tell fp32 from bf16 factors
RAY_TRANSPORTS = {"object_refs": RayObjectRefTransport, "collective": collective_transport}


def _actor_pair(kind: str, ray_pool) -> tuple[Pair, list]:
    """build_pair in bf16 with its experts in ExpertManager actors (the in-process shards' keys and bf16
    weights, the same AdamW), the adapter loaded into them; (pair, actor handles)."""
    clusters = []

    def make_transport(shards: list[ExpertShard]):
        specs = [ExpertManagerSpec(worker=n, keys=sorted(weights), weights=weights, hf_config=debug_config(FAMILY),
                                   lora=LORA, optim=BF16_OPTIM)
                 for n, weights in enumerate(shard.weights() for shard in shards)]
        clusters.append(ray_pool.spawn(specs))
        return ray_pool.track(RAY_TRANSPORTS[kind](clusters[0].handles, clusters[0].worker_tiers(),
                                                   timeout_s=TIMEOUT_S))

    pair = build_pair(FAMILY, make_transport, dtype=torch.bfloat16, optim=BF16_OPTIM)
    actors = actor_workers(clusters[0].handles, timeout_s=TIMEOUT_S)
    actors.load_lora_state(pair.workers.lora_state())  # build_pair imported the adapter in-process
    pair.workers = actors
    return pair, clusters[0].handles


@pytest.mark.parametrize("kind", sorted(RAY_TRANSPORTS))
def test_bf16_experts_in_actors_keep_fp32_state_and_move_as_peft_s(kind, ray_pool):
    pair, handles = _actor_pair(kind, ray_pool)
    assert_updates_within_rounding(expert_drifts(pair, FAMILY, torch.bfloat16, STEPS), f"{FAMILY} over {kind}")
    for handle in handles:  # factors and AdamW moments fp32 where they live, in the actors
        keys = list(ray.get(handle.lora_state.remote(), timeout=TIMEOUT_S))
        for key, named in ray.get(handle.expert_states.remote(keys), timeout=TIMEOUT_S).items():
            assert any(n.endswith(".exp_avg_sq") for n in named), key
            assert {t.dtype for n, t in named.items() if not n.endswith(".step")} == {torch.float32}, key
