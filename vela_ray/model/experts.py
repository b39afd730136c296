"""ExpertShard: the experts one worker hosts, with frozen base weights and LoRA.

Legend: R = rows routed to this shard in one call, D = hidden size,
I = expert intermediate size, r = LoRA rank.

An expert (layer l, expert e) computes, for its rows x_RD,

    gate_up = x W_gu^T + s (x A_gu^T) B_gu^T          W_gu: [2I, D]
    h       = act(gate_up[:, :I]) * gate_up[:, I:]
    out     = h W_d^T  + s (h A_d^T)  B_d^T           W_d:  [D, I]

with s = alpha / r. This is peft's LoRA on the fused 3-D parameters
(`LoraConfig(target_parameters=["experts.gate_up_proj", "experts.down_proj"])`):
peft's fused A is [r*E, in] (expert e owns rows e*r:(e+1)*r) and its fused B is
[out, r*E] with expert e owning the interleaved columns e::E, so each expert's
slices map one to one onto A_* and B_* here (see `vela_ray.model.adapters`).

The routing weights are applied by the broker on the master, not here, so the
shard returns unweighted expert outputs and gradients flow to the router there.

Backward: `forward_rows(..., key=k)` keeps the autograd graph of that call;
`backward_rows(k, grad_out_RD)` runs it, accumulating LoRA gradients here and
returning d(loss)/d(rows) for the master.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable

import torch
from torch import nn
from transformers.activations import ACT2FN

ExpertKey = tuple[int, int]  # (MoE layer index, expert index): a *logical* expert


@dataclass(frozen=True)
class LoraSpec:
    """LoRA hyper-parameters of the expert adapters (the paper: r=8, alpha=16)."""

    r: int = 8
    alpha: float = 16.0

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


class LoraExpert(nn.Module):
    """One expert FFN: frozen `gate_up` [2I, D] and `down` [D, I], trainable LoRA factors."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, lora: LoraSpec, activation: str,
                 generator: torch.Generator | None = None):
        """`generator` draws the LoRA A init; None draws from torch's global RNG, as nn.Linear does."""
        super().__init__()
        two_i, hidden = gate_up.shape
        inter = two_i // 2
        self.register_buffer("gate_up", gate_up.detach().clone(), persistent=True)
        self.register_buffer("down", down.detach().clone(), persistent=True)
        dtype = gate_up.dtype
        self.lora_A_gate_up = nn.Parameter(torch.empty(lora.r, hidden, dtype=dtype))
        self.lora_B_gate_up = nn.Parameter(torch.zeros(two_i, lora.r, dtype=dtype))
        self.lora_A_down = nn.Parameter(torch.empty(lora.r, inter, dtype=dtype))
        self.lora_B_down = nn.Parameter(torch.zeros(hidden, lora.r, dtype=dtype))
        # peft's default init: kaiming-uniform A (as nn.Linear), zero B, so the adapter starts as identity.
        nn.init.kaiming_uniform_(self.lora_A_gate_up, a=math.sqrt(5), generator=generator)
        nn.init.kaiming_uniform_(self.lora_A_down, a=math.sqrt(5), generator=generator)
        self.scaling = lora.scaling
        self.act_fn = ACT2FN[activation]

    def forward(self, x_RD: torch.Tensor) -> torch.Tensor:
        s = self.scaling
        gate_up = nn.functional.linear(x_RD, self.gate_up)
        gate_up = gate_up + s * nn.functional.linear(nn.functional.linear(x_RD, self.lora_A_gate_up), self.lora_B_gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        out = nn.functional.linear(h, self.down)
        return out + s * nn.functional.linear(nn.functional.linear(h, self.lora_A_down), self.lora_B_down)


def expert_generator(seed: int, layer: int, expert: int) -> torch.Generator:
    """A CPU generator for one expert's LoRA init, the same for (seed, layer, expert) in any process.

    `hash` of a tuple of ints does not depend on PYTHONHASHSEED, so every worker derives the same seed.
    """
    return torch.Generator().manual_seed(hash((seed, layer, expert)) % (2**31))


def _module_key(layer: int, expert: int) -> str:
    return f"l{layer}_e{expert}"


class ExpertShard(nn.Module):
    """A set of logical experts (layer, expert) hosted together, e.g. by one ExpertManager.

    Stages of one training micro-batch, per MoE layer:
      1. `forward_rows(layer, expert_ids_R, rows_RD, key)`: run each row through its expert;
         with a key, keep the graph for backward.
      2. `backward_rows(key, grad_out_RD)`: backprop through that graph; LoRA grads accumulate
         here, d(rows) goes back to the master.
    """

    def __init__(self, experts: dict[ExpertKey, LoraExpert]):
        super().__init__()
        self.experts = nn.ModuleDict({_module_key(*key): mod for key, mod in sorted(experts.items())})
        self.keys: list[ExpertKey] = sorted(experts)
        self._saved: dict[Hashable, tuple[torch.Tensor, torch.Tensor] | None] = {}

    @classmethod
    def from_weights(
        cls,
        weights: dict[ExpertKey, tuple[torch.Tensor, torch.Tensor]],
        lora: LoraSpec,
        activation: str,
        seed: int | None = None,
    ) -> "ExpertShard":
        """Build from {(layer, expert): (gate_up [2I, D], down [D, I])}.

        With `seed`, each expert's LoRA init draws from its own generator seeded by
        (seed, layer, expert), so the init does not depend on which shard hosts it and
        building a shard leaves torch's global RNG (the caller's data order, dropout) alone.
        Without `seed`, the init draws from the global RNG like any nn.Module.
        """
        experts = {}
        for key in sorted(weights):
            gate_up, down = weights[key]
            generator = None if seed is None else expert_generator(seed, *key)
            experts[key] = LoraExpert(gate_up, down, lora, activation, generator)
        return cls(experts)

    def expert(self, layer: int, expert: int) -> LoraExpert:
        return self.experts[_module_key(layer, expert)]

    def forward_rows(
        self, layer: int, expert_ids_R: torch.Tensor, rows_RD: torch.Tensor, key: Hashable | None = None
    ) -> torch.Tensor:
        """Expert outputs for `rows_RD`, row i through expert `expert_ids_R[i]` of `layer`.

        Rows must be grouped by expert (the broker sends them sorted). With `key`,
        the graph is kept for `backward_rows(key, ...)`; without it no graph is built.
        """
        if rows_RD.shape[0] == 0:  # nothing routed here: an empty entry keeps backward_rows(key) valid
            if key is not None:
                self._saved[key] = None
            return rows_RD.new_zeros(rows_RD.shape)
        with torch.enable_grad() if key is not None else torch.no_grad():
            rows_RD = rows_RD.detach().requires_grad_(key is not None)
            out_RD = torch.cat([
                self.expert(layer, int(expert))(rows_RD[start:end])
                for expert, start, end in _runs(expert_ids_R)
            ])
        if key is not None:
            self._saved[key] = (rows_RD, out_RD)
        return out_RD.detach()

    def backward_rows(self, key: Hashable, grad_out_RD: torch.Tensor) -> torch.Tensor:
        """Backprop `grad_out_RD` through the graph saved under `key`; returns d(loss)/d(rows)."""
        if key not in self._saved:
            raise KeyError(f"no saved forward for {key!r}: backward_rows called twice or without forward_rows")
        saved = self._saved.pop(key)
        if saved is None:
            return grad_out_RD.new_zeros(grad_out_RD.shape)
        rows_RD, out_RD = saved
        out_RD.backward(grad_out_RD.to(out_RD.dtype))
        return rows_RD.grad

    def release(self) -> int:
        """Drop graphs kept for a backward that will not come (e.g. an eval pass). Returns how many."""
        count = len(self._saved)
        self._saved.clear()
        return count

    def lora_parameters(self) -> Iterable[nn.Parameter]:
        return (p for p in self.parameters() if p.requires_grad)

    def lora_state(self) -> dict[ExpertKey, dict[str, torch.Tensor]]:
        """{(layer, expert): {"lora_A_gate_up": ..., ...}}: the adapter keyed by logical expert."""
        return {
            key: {name: p.detach().clone() for name, p in self.expert(*key).named_parameters()}
            for key in self.keys
        }

    def load_lora_state(self, state: dict[ExpertKey, dict[str, torch.Tensor]]) -> None:
        missing = [key for key in self.keys if key not in state]
        if missing:
            raise ValueError(f"adapter state lacks experts {missing[:8]} (of {len(missing)}) hosted by this shard")
        with torch.no_grad():
            for key in self.keys:
                for name, param in self.expert(*key).named_parameters():
                    param.copy_(state[key][name])


def _runs(expert_ids_R: torch.Tensor) -> list[tuple[int, int, int]]:
    """[(expert, start, end)] for each run of equal ids in a grouped id vector."""
    ids, counts = torch.unique_consecutive(expert_ids_R, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    starts = [0] + ends[:-1]
    return list(zip(ids.tolist(), starts, ends))
