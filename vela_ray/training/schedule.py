"""The optimizer's settings and its learning-rate schedule: `OptimizerConfig` (AdamW and the schedule,
the VELA paper's defaults) and `lr_at`. Pure Python: `vela_ray.config` reads the settings without torch,
and every side (master, ExpertManagers, the baselines) computes the same rate from them."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class OptimizerConfig(BaseModel):
    """AdamW and schedule; defaults are the VELA paper's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(3e-5, gt=0, description="peak learning rate")
    betas: tuple[float, float] = (0.8, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(3e-7, ge=0)
    max_grad_norm: float | None = Field(1.0, description="global grad-norm clip; None disables")
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)


def lr_at(cfg: OptimizerConfig, step: int, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based) of `total_steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or total_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - progress)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule_change(cfg: OptimizerConfig, step: int, old_total: int, new_total: int) -> str | None:
    """One line saying what resuming at `step` with `new_total` steps instead of the run's `old_total` does to
    the learning rate (the schedule is recomputed over the new total, as the optimizer sees `training.steps`);
    None where the next step's learning rate is the same either way (a constant schedule, still warming up)."""
    old, new = lr_at(cfg, step, old_total), lr_at(cfg, step, new_total)
    if math.isclose(old, new, rel_tol=1e-9, abs_tol=1e-15):
        return None
    change = f" (x{new / old:.3g})" if old else ""
    return (f"training.steps is {new_total}, the checkpoint's run had {old_total}: the {cfg.schedule} schedule now "
            f"spans {new_total} steps, so step {step + 1}'s learning rate is {new:.3g} where the run's schedule "
            f"gave {old:.3g}{change}; keep training.steps {old_total} to finish the run as it was planned")
