"""Optimizer pieces shared by the master and the expert hosts.

The master steps the backbone adapters; every expert host steps its own
experts' adapters (`ShardTrainer`). Together they must equal one AdamW over
all adapters of the original model with global grad-norm clipping, so:
- the learning rate of each step is computed once, on the master (`schedule.lr_at`), and sent;
- the clip coefficient comes from the global norm sqrt(master^2 + sum of workers^2);
- expert gradients start as zeros, not None, so an expert that saw no token in a step
  still gets its AdamW update (weight decay, momentum), exactly as peft's fused matrix does.

Zeroth-order training (`vela_ray.training.zo`) shares one piece the same way: `apply_zo_terms`
adds coefficient * z to each tensor, z drawn from (step seed, the tensor's name) by `zo_noise`,
so each side draws the noise of its own tensors and only seeds and scalars travel.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Iterable, Literal, Mapping, Sequence

import torch
from torch.nn.utils import get_total_norm

from vela_ray.training.schedule import OptimizerConfig

if TYPE_CHECKING:
    from vela_ray.model.experts import ExpertShard


def make_adamw(params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """One param group, which may be empty: frozen experts (`lora.expert_stacks: []`) or an experts-only job's
    backbone train nothing on that side."""
    return torch.optim.AdamW([{"params": list(params)}], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def grad_sq_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """Sum of squared gradient entries, the piece each side reports: per-tensor norms in fused kernels
    grouped by device and dtype (`get_total_norm`, as `clip_grad_norm_` computes them), read back with one
    host sync whatever the number of tensors. An expert host has one tensor per (expert, factor), thousands
    for a real MoE, so one sync each would stall every step on a GPU."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    return float(get_total_norm(grads, 2.0)) ** 2 if grads else 0.0


def clip_coefficient(total_sq_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor for the global norm."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(total_sq_norm) + 1e-6))


def apply_step(optimizer: torch.optim.Optimizer, lr: float, clip_coef: float) -> None:
    """Clip by `clip_coef` (fused over all gradients, no host sync) and step at `lr`."""
    for group in optimizer.param_groups:
        group["lr"] = lr
        grads = [p.grad for p in group["params"] if p.grad is not None]
        if clip_coef != 1.0 and grads:
            torch._foreach_mul_(grads, clip_coef)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


class ShardTrainer:
    """An ExpertShard with its own AdamW: what an ExpertManager runs per step."""
    def __init__(self, shard: ExpertShard, cfg: OptimizerConfig):
        self.shard = shard
        self.params = list(shard.lora_parameters())
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer = make_adamw(self.params, cfg)

    def grad_sq_norm(self) -> float:
        return grad_sq_norm(self.params)

    def step(self, lr: float, clip_coef: float) -> None:
        apply_step(self.optimizer, lr, clip_coef)
        self.shard.release()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        self.shard.release()

    def lora_state(self) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
        return self.shard.lora_state()

    def load_lora_state(self, state: dict[tuple[int, int], dict[str, torch.Tensor]]) -> None:
        self.shard.load_lora_state({key: state[key] for key in self.shard.keys})

    def optimizer_state(self) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
        """AdamW moments and step per logical expert: {(l, e): {"lora_A_down.exp_avg": ..., ...}}."""
        out: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for key in self.shard.keys:
            for name, param in self.shard.expert(*key).named_parameters():
                for slot, value in self.optimizer.state.get(param, {}).items():
                    out.setdefault(key, {})[f"{name}.{slot}"] = torch.as_tensor(value).detach().clone()
        return out

    def load_optimizer_state(self, state: dict[tuple[int, int], dict[str, torch.Tensor]]) -> None:
        """Inverse of `optimizer_state` for the experts this shard hosts (missing experts: fresh state).

        The moments take the parameter's dtype: a checkpoint written while expert factors of a bf16
        model were bf16 (before they became fp32, `experts.adapter_dtype`) resumes with fp32 moments."""
        for key in self.shard.keys:
            for name, param in self.shard.expert(*key).named_parameters():
                slots = {n.split(".", 1)[1]: v for n, v in state.get(key, {}).items() if n.split(".", 1)[0] == name}
                if slots:
                    # AdamW keeps `step` on the CPU unless capturable; the moments live with the parameter
                    self.optimizer.state[param] = {
                        k: v.clone() if k == "step" else v.to(param.device, param.dtype, copy=True)
                        for k, v in slots.items()}


# --- zeroth-order (ZO-SGD): what every owner of LoRA tensors applies to its own -----------------------

ZoTerm = tuple[int, float]
"""(step seed, coefficient): add coefficient * z(step seed, tensor name) to a tensor."""
ZoTensors = Literal["lora", "frozen", "full"]
"""The tensors a ZO term goes to: the LoRA adapters, the frozen weights (a full-parameter resume's replay, whose
adapters come from the checkpoint), or both."""


def zo_tensor_seed(step_seed: int, name: str) -> int:
    """The generator seed of one tensor's noise: a stable hash of (step seed, canonical tensor name).

    blake2b, not Python's `hash` (salted per process for strings): every process derives the same
    seed for the same tensor, whichever worker hosts it."""
    digest = hashlib.blake2b(f"{step_seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def zo_noise(step_seed: int, name: str, like: torch.Tensor) -> torch.Tensor:
    """z ~ N(0, I) shaped like `like`, for the tensor called `name` in the step of `step_seed`.

    Drawn on the CPU in fp32 whatever `like`'s device and dtype (a CUDA generator draws other
    numbers), then moved there: the master's GPU and a CPU worker add the same z."""
    generator = torch.Generator().manual_seed(zo_tensor_seed(step_seed, name))
    return torch.randn(like.shape, generator=generator, dtype=torch.float32).to(like.device, like.dtype)


def apply_zo_terms(named: Mapping[str, torch.Tensor], terms: Sequence[ZoTerm]) -> None:
    """One pass over the tensors: each gets every term in order, its noise drawn once per step seed.

    One add per term, not one add of the summed coefficients, so a fused pass (restore, update and
    next perturbation together) rounds exactly as MeZO's separate passes do, and a run that settles
    between steps (for a checkpoint) keeps the same bits as one that never does."""
    last_use = {seed: index for index, (seed, _) in enumerate(terms)}  # a seed's noise is dropped after its last term
    with torch.no_grad():
        for name, tensor in named.items():
            noise: dict[int, torch.Tensor] = {}
            for index, (seed, coefficient) in enumerate(terms):
                if seed not in noise:
                    noise[seed] = zo_noise(seed, name, tensor)
                tensor.add_(noise[seed], alpha=coefficient)
                if last_use[seed] == index:  # a replay's thousands of steps hold one noise at a time, not all
                    del noise[seed]
