"""APTMoE's expert popularity predictor (paper §III-C 3, Fig. 9): which experts the next MoE layer will need.

The router of layer l+1 only runs once layer l is done, too late to load its experts while layer l
computes. The predictor is a copy of layer l+1's router applied to layer l's router input (the rows
layer l's experts receive), fitted to the routing layer l+1 really chose, so the next layer's busy
experts can be uploaded one layer ahead:

    pairs = routing_pairs(model, batches)                  # {l + 1: (layer l's rows [T, D], l + 1's top-k [T, K])}
    predictor = PopularityPredictor.from_model(model)      # the routers of layers 1..L-1, copied
    predictor.fit(pairs, steps=50)                          # a few full-batch steps on the real routing
    predictor.top_k_overlap(pairs)                          # {l + 1: mean |predicted top-k ∩ real top-k| / K}
    rows_E = predictor.predict_rows(1, rows_RD)             # predicted rows per expert of MoE layer 1

Only the router's linear map is copied (weight and bias): top-k of its logits is the family's choice for
softmax routers such as Mixtral's; a DeepSeek-style correction bias or group-limited choice is not
reproduced, which the fitting partly absorbs. Routed experts calls only (`experts(rows, index, weights)`).

Legend: T = tokens, D = hidden size, E = experts per layer, K = top-k, R = rows.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable

import torch
from torch import nn

from vela_ray.data.locality import profile_inputs, router_of
from vela_ray.model.modeling import MoeBlock, find_moe_blocks, top_k_of

RoutingPairs = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""{next MoE layer l + 1: (router input of layer l [T, D], experts layer l + 1 chose [T, K])}, tokens aligned."""


class PopularityPredictor(nn.Module):
    """One linear router copy per predicted MoE layer, keyed by that layer (1..L-1)."""

    def __init__(self, routers: dict[int, nn.Linear], top_k: int):
        super().__init__()
        self.routers = nn.ModuleDict({str(layer): router for layer, router in sorted(routers.items())})
        self.top_k = top_k

    @classmethod
    def from_model(cls, model: nn.Module, blocks: list[MoeBlock] | None = None) -> PopularityPredictor:
        """Copies of the routers of MoE layers 1..L-1 of `model` (the paper initialises with them)."""
        blocks = blocks if blocks is not None else find_moe_blocks(model)
        routers = {}
        for block in blocks[1:]:
            gate = router_of(block.block)
            weight = getattr(gate, "weight", None)
            if weight is None or weight.dim() != 2:
                raise ValueError(f"{block.path}: its router {type(gate).__name__} has no [experts, hidden] weight "
                                 "to copy; the popularity predictor needs a linear router")
            bias = getattr(gate, "bias", None)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=torch.float32)
            with torch.no_grad():
                linear.weight.copy_(weight.detach().float())
                if bias is not None:
                    linear.bias.copy_(bias.detach().float())
            routers[block.index] = linear
        return cls(routers, top_k_of(model))

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], top_k: int) -> PopularityPredictor:
        """Rebuild from `state_dict()` (what the master sends a worker)."""
        layers = sorted({int(name.split(".")[1]) for name in state})
        routers = {}
        for layer in layers:
            weight = state[f"routers.{layer}.weight"]
            routers[layer] = nn.Linear(weight.shape[1], weight.shape[0], bias=f"routers.{layer}.bias" in state)
        predictor = cls(routers, top_k)
        predictor.load_state_dict(state)
        return predictor

    def layers(self) -> list[int]:
        """The MoE layers this predicts (each from the layer before)."""
        return [int(layer) for layer in self.routers]

    def logits(self, next_layer: int, rows_RD: torch.Tensor) -> torch.Tensor:
        """[R, E] predicted router logits of `next_layer` for rows of the layer before."""
        router = self.routers[str(next_layer)]
        return router(rows_RD.to(router.weight.device, torch.float32))

    @torch.no_grad()
    def predict_top_k(self, next_layer: int, rows_RD: torch.Tensor) -> torch.Tensor:
        """[R, K] experts of `next_layer` each row is predicted to choose."""
        return self.logits(next_layer, rows_RD).topk(self.top_k, dim=-1).indices

    @torch.no_grad()
    def predict_rows(self, next_layer: int, rows_RD: torch.Tensor) -> torch.Tensor:
        """[E] predicted rows per expert of `next_layer`, from rows of the layer before."""
        num_experts = self.routers[str(next_layer)].out_features
        return torch.bincount(self.predict_top_k(next_layer, rows_RD).reshape(-1), minlength=num_experts)

    def fit(self, pairs: RoutingPairs, steps: int = 50, lr: float = 1e-2) -> list[float]:
        """Fit each router copy to the real routing: `steps` full-batch Adam steps on the cross-entropy of
        its softmax against the real top-k (each chosen expert a target of weight 1/K). Returns the
        mean loss per step.

        A layer whose fitted copy predicts the fit pairs' top-k worse than the router copy it started
        from keeps the start: cross-entropy is not the overlap the tiers use, and a next layer's own
        router can already score 0.96 there (the tiny model's last layer), which the fit then lowers."""
        layers = [layer for layer in pairs if str(layer) in self.routers]
        if not layers:
            return []
        start = {layer: copy.deepcopy(self.routers[str(layer)].state_dict()) for layer in layers}
        start_overlap = self.top_k_overlap(pairs)
        optimizer = torch.optim.Adam([p for layer in layers for p in self.routers[str(layer)].parameters()], lr=lr)
        losses = []
        with torch.enable_grad():
            for _ in range(steps):
                optimizer.zero_grad()
                loss = sum(self._loss(layer, *pairs[layer]) for layer in layers) / len(layers)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
        fitted_overlap = self.top_k_overlap(pairs)
        for layer in layers:
            if fitted_overlap[layer] < start_overlap[layer]:
                self.routers[str(layer)].load_state_dict(start[layer])
        return losses

    def _loss(self, next_layer: int, rows_TD: torch.Tensor, top_k_TK: torch.Tensor) -> torch.Tensor:
        log_probs_TE = self.logits(next_layer, rows_TD).log_softmax(dim=-1)
        return -log_probs_TE.gather(1, top_k_TK.to(log_probs_TE.device).long()).mean()

    @torch.no_grad()
    def top_k_overlap(self, pairs: RoutingPairs) -> dict[int, float]:
        """{next layer: mean over tokens of |predicted top-k ∩ real top-k| / K}; a uniform guess scores K / E."""
        return {layer: top_k_overlap(self.predict_top_k(layer, rows), real)
                for layer, (rows, real) in sorted(pairs.items()) if str(layer) in self.routers}


def top_k_overlap(predicted_TK: torch.Tensor, real_TK: torch.Tensor) -> float:
    """Mean over tokens of |predicted ∩ real| / K (both [T, K] expert ids; 1.0: every choice predicted)."""
    if predicted_TK.shape[0] == 0:
        return 0.0
    hits = (predicted_TK.cpu()[:, :, None] == real_TK.cpu()[:, None, :]).any(dim=2).sum(dim=1)
    return float(hits.float().mean() / real_TK.shape[1])


def demand_overlap(predicted_E: torch.Tensor, real_E: torch.Tensor) -> float | None:
    """sum_e min(predicted share, real share): how much of the real demand the prediction covered (1 - TV
    distance; 1.0: the same shares). None when either side has no rows."""
    predicted, real = predicted_E.double(), real_E.double()
    if predicted.sum() <= 0 or real.sum() <= 0:
        return None
    return float(torch.minimum(predicted / predicted.sum(), real / real.sum()).sum())


def routing_pairs(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]],
                  blocks: list[MoeBlock] | None = None) -> RoutingPairs:
    """Run `batches` through `model` in eval mode and pair each MoE layer's router input with the experts
    the next MoE layer chose, per token; padding (attention_mask 0) left out. Batches as
    `vela_ray.data.locality.profile_model` takes them (packed rows: `position_ids`, the mask only counts
    tokens). Works through brokers too; pass `blocks` (found before any surgery) for a wrapped model."""
    blocks = blocks if blocks is not None else find_moe_blocks(model)
    return pairs_of(routing_calls(model, batches, blocks), blocks)


Calls = dict[int, list[tuple[torch.Tensor, torch.Tensor]]]  # by MoE layer: each forward's (rows, chosen experts)


@torch.no_grad()
def routing_calls(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], blocks: list[MoeBlock],
                  run: Callable[[list, Callable], object] | None = None) -> Calls:
    """What `routing_pairs` pairs: each MoE layer's experts calls over `batches` (the real tokens'). `run(batches,
    forward)`: how the forwards run (a pipeline stage's through the stages, `PipelineStage.forwards`, each
    recording its own layers'); None: one after another."""
    if any(b.layout.call != "routed" for b in blocks):
        raise ValueError("the popularity predictor needs routed experts calls (experts(rows, index, weights)); "
                         f"{blocks[0].layout.experts_class} is called on rows grouped by expert")
    calls: Calls = {b.index: [] for b in blocks}
    handles = [b.block.experts.register_forward_pre_hook(_record(calls[b.index]), with_kwargs=True) for b in blocks]
    device, was_training = next(model.parameters()).device, model.training

    def forward(batch: dict[str, torch.Tensor]) -> None:
        made = {layer: len(layer_calls) for layer, layer_calls in calls.items()}
        model(**profile_inputs(batch, device))
        mask = batch.get("attention_mask")
        if mask is not None:  # this batch's calls: keep the real tokens
            keep_T = mask.reshape(-1).bool().cpu()
            for layer, layer_calls in calls.items():
                if len(layer_calls) > made[layer]:
                    layer_calls[-1] = tuple(t[keep_T] for t in layer_calls[-1])

    model.eval()
    try:
        if run is None:
            for batch in batches:
                forward(batch)
        else:
            run(list(batches), forward)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return calls


def pairs_of(calls: Calls, blocks: list[MoeBlock]) -> RoutingPairs:
    """Each MoE layer after the first: (the layer before's router inputs, this layer's chosen experts)."""
    layers = [b.index for b in blocks]
    return {nxt: (torch.cat([rows for rows, _ in calls[prev]]), torch.cat([index for _, index in calls[nxt]]))
            for prev, nxt in zip(layers, layers[1:])}


def _record(calls: list[tuple[torch.Tensor, torch.Tensor]]):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        values = [*args, *kwargs.values()]
        calls.append((values[0].detach().float().cpu(), values[1].detach().cpu()))
    return hook
