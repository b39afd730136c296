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
from typing import Callable

import torch

from vela_ray.model.families import debug_model
from vela_ray.training import equivalence
from vela_ray.training.equivalence import (  # noqa: F401 - the tests' names for the harness
    LORA, OPTIM, Drifts, Pair, expert_keys, exported_adapter, factor_drift, micro_batches, reference_adapter_state,
    rounding_excess, run_both, run_reference, scattered_placement, start_adapter)
from vela_ray.training.schedule import OptimizerConfig

logger = logging.getLogger(__name__)


def build_pair(family: str, make_transport: Callable | None = None, dtype=torch.float32,
               num_workers: int = 3, optim: OptimizerConfig = OPTIM, shared_experts: bool = True,
               **config_overrides) -> Pair:
    """The peft reference and vela-ray's master + `num_workers` shards of `family`'s debug model in
    `dtype`, both with the same adapter and `optim` (which `run_both` then uses); `shared_experts`:
    `training.overlap.shared_experts`."""
    make_model = functools.partial(debug_model, family, seed=0, **config_overrides)
    return equivalence.build_pair(make_model, make_transport, dtype, num_workers, optim,
                                  overlap_shared_experts=shared_experts)


def exact_reference(pair: Pair, family: str, dtype: torch.dtype, **config_overrides) -> Pair:
    """peft on `pair`'s `family` model in exact arithmetic (`equivalence.exact_reference`)."""
    return equivalence.exact_reference(pair, functools.partial(debug_model, family, seed=0, **config_overrides), dtype)


def expert_drifts(pair: Pair, family: str, dtype: torch.dtype, steps: int) -> Drifts:
    """`run_both(pair, steps)` and peft's exact run of the same steps (`equivalence.expert_drifts`)."""
    return equivalence.expert_drifts(pair, functools.partial(debug_model, family, seed=0), dtype, steps)


def assert_updates_within_rounding(drifts: Drifts, label: str) -> None:
    """vela-ray's expert updates equal peft's up to rounding, which `drifts.rounding` measures: two runs each
    off the exact one by that much differ by up to sqrt(2) times it, and vela-ray's own drift from the exact
    run stays within 25% of peft's. Above 0.5 the runs no longer follow the exact one: the bound says nothing."""
    logger.info("%s: %s", label, drifts.summary())
    problems = rounding_excess(drifts)
    assert not problems, f"{label}: " + "; ".join(problems)
