"""The equivalence harness (`vela_ray.training.equivalence`) on the debug families, and its bf16 yardstick.

`build_pair(family, ...)` builds the peft reference and vela-ray's master + shards from `family`'s
debug model. Low precision (`build_pair(..., dtype=torch.bfloat16, optim=...)`): rounding makes the
two sides' updates differ, so `expert_drifts` measures by how much against what it does to peft alone
(peft's `exact_reference`: the same weights computed in fp32), and `assert_updates_within_rounding`
holds vela-ray to that.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch
from peft import PeftModel

from vela_ray.model.adapters import backbone_state_of
from vela_ray.model.families import debug_model
from vela_ray.training import equivalence
from vela_ray.training.equivalence import (  # noqa: F401 - the tests' names for the harness
    LORA, OPTIM, Pair, exported_adapter, micro_batches, reference_adapter_state, run_both,
    run_reference, scattered_placement, start_adapter)
from vela_ray.training.optim import make_adamw
from vela_ray.training.schedule import OptimizerConfig

logger = logging.getLogger(__name__)


def build_pair(family: str, make_transport: Callable | None = None, dtype=torch.float32,
               num_workers: int = 3, optim: OptimizerConfig = OPTIM, **config_overrides) -> Pair:
    """The peft reference and vela-ray's master + `num_workers` shards of `family`'s debug model in
    `dtype`, both with the same adapter and `optim` (which `run_both` then uses)."""
    make_model = functools.partial(debug_model, family, seed=0, **config_overrides)
    return equivalence.build_pair(make_model, make_transport, dtype, num_workers, optim)


def exact_reference(pair: Pair, family: str, dtype: torch.dtype, **config_overrides) -> Pair:
    """peft on `pair`'s model in exact arithmetic: the same `dtype`-valued weights and start adapter,
    computed in fp32 (no master or workers). `run_reference` it as far as `run_both` ran `pair` to see
    what rounding in `dtype` alone does to peft's updates."""
    model = debug_model(family, seed=0, **config_overrides).to(dtype).float()
    reference = PeftModel.from_pretrained(model, pair.adapter_dir, is_trainable=True)
    optimizer = make_adamw([p for p in reference.parameters() if p.requires_grad], pair.optim)
    return Pair(reference, optimizer, None, None, pair.adapter_dir, pair.optim)


def expert_keys(pair: Pair) -> list[str]:
    """peft keys of the fused expert factors: the adapter's keys the master's backbone lacks."""
    backbone = backbone_state_of(pair.master.peft_model)
    return sorted(k for k in start_adapter(pair) if k not in backbone)


@dataclass(frozen=True)
class Drifts:
    """Per fused expert LoRA tensor (peft key), after the same steps: how far one side's update is from
    another's (`factor_drift`). `exact`: peft on the same weights in exact arithmetic (`exact_reference`)."""

    vela_vs_peft: dict[str, float]
    peft_vs_exact: dict[str, float]
    vela_vs_exact: dict[str, float]

    @property
    def rounding(self) -> float:
        """What rounding alone does to peft's own update: its largest drift from the exact run."""
        return max(self.peft_vs_exact.values())


def expert_drifts(pair: Pair, family: str, dtype: torch.dtype, steps: int) -> Drifts:
    """`run_both(pair, steps)` and peft's exact run of the same steps; how the expert updates compare."""
    run_both(pair, steps)
    exact = exact_reference(pair, family, dtype)
    run_reference(exact, steps)
    keys, start = expert_keys(pair), start_adapter(pair)
    vela, peft, truth = exported_adapter(pair), reference_adapter_state(pair), reference_adapter_state(exact)
    return Drifts(factor_drift(vela, peft, start, keys), factor_drift(peft, truth, start, keys),
                  factor_drift(vela, truth, start, keys))


def factor_drift(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                 start: dict[str, torch.Tensor], keys: list[str]) -> dict[str, float]:
    """Per key, how far `state`'s change from `start` is from `reference`'s: |d_state - d_ref| / |d_ref|
    (L2 over the tensor; 0: the same update, ~1: unrelated or no update)."""
    drift = {}
    for key in keys:
        moved_ref = reference[key].float() - start[key].float()
        moved = state[key].float() - start[key].float()
        drift[key] = float((moved - moved_ref).norm() / moved_ref.norm())
    return drift


def assert_updates_within_rounding(drifts: Drifts, label: str) -> None:
    """vela-ray's expert updates equal peft's up to rounding, which `drifts.rounding` measures: two runs each
    off the exact one by that much differ by up to sqrt(2) times it, and vela-ray's own drift from the exact
    run stays within 25% of peft's. Above 0.5 the runs no longer follow the exact one: the bound says nothing."""
    eps = drifts.rounding
    logger.info("%s: peft vs exact %.3f, vela vs peft %.3f, vela vs exact %.3f", label, eps,
                max(drifts.vela_vs_peft.values()), max(drifts.vela_vs_exact.values()))
    assert eps < 0.5, f"{label}: peft's own run drifted {eps:.2f} from exact arithmetic"
    for key, drift in drifts.vela_vs_peft.items():
        assert drift <= math.sqrt(2) * eps, f"{label} {key}: vela-ray's update is {drift:.3f} off peft's " \
                                            f"(rounding alone: {eps:.3f})"
    assert max(drifts.vela_vs_exact.values()) <= 1.25 * eps, f"{label}: vela-ray further from exact than peft"
