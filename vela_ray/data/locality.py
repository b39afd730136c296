"""Expert locality: which experts each MoE layer's tokens pick, and whether that drifts.

The VELA paper (Sec. III) passes the fine-tuning data through the pre-trained
model in inference mode, counts how many tokens each expert receives, and uses
the access probabilities ``P[l, e] = counts[l, e] / tokens`` (rows sum to top-k)
as the input of expert placement. This module measures exactly that:

* `RoutingRecorder`: forward hooks on each MoE block. A forward pre-hook on the
  block's ``experts`` submodule reads the chosen experts from its call (so it
  keeps working when the runtime swaps ``experts`` for an ExpertBroker with the
  same call): ``top_k_index``, or for Llama 4's grouped call the experts whose
  rows are non-zero. A forward hook on the router (``block.gate`` or
  ``block.router``) reads the router logits for the router confidence (paper
  Fig. 3b), where the router returns (logits, weights, index); for other
  routers the profile has no confidence. Padded positions are skipped using the
  attention mask the caller sets before each forward.
* `profile_model(model, batches) -> AccessProfile`: the inference-mode pass.
* `AccessProfile`: counts, P, confidence histograms; JSON and ``.npy`` (P only,
  the input of ``vela place``). Read either back with ``placement.io.load_profile``,
  the one profile reader.
* `DriftTracker`: per-step counts during fine-tuning (``record_step(counts)``)
  compared with the initial profile by total variation, plus the skew metric G.

Router confidence of a token = the share of routing score held by its selected
experts. Softmax routers (Mixtral, Qwen-MoE, OLMoE): the sum of the selected
experts' softmax probabilities over all E experts (the paper's definition).
Sigmoid routers (DeepSeek-V3 family, recognised by their
``e_score_correction_bias``): each expert's sigmoid score is independent, so
their sum is not a distribution; we normalise the sigmoid scores to sum to 1
over all experts and sum the selected ones. Both lie in [K/E, 1] for the top-K
choice of an unbiased router, and equal K/E when routing is uniform.

Shape legend: L = MoE layers, E = experts, K = top-k, T = tokens of a forward
(batch x sequence, flattened as the MoE blocks flatten them), C = histogram bins.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterable, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, computed_field, model_validator
from torch import nn
from tqdm.auto import tqdm

from placement.io import probs_from_counts  # the one home; DriftTracker turns step counts into P with it
from vela_ray.model.broker import grouped_routing
from vela_ray.model.modeling import MoeBlock, find_moe_blocks, top_k_of

log = logging.getLogger(__name__)

Scoring = Literal["softmax", "sigmoid"]
CONFIDENCE_BINS = 100


# --- metrics (pure functions over [L, E] access probabilities) ------------------------


def normalise(probs_LE: np.ndarray, top_k: int) -> np.ndarray:
    """Per-layer distributions: P / top_k, so each row sums to 1."""
    return np.asarray(probs_LE, dtype=np.float64) / top_k


def total_variation(probs_LE: np.ndarray, reference_LE: np.ndarray, top_k: int) -> np.ndarray:
    """[L] total-variation distance 0.5 * sum_e |p/K - q/K| per layer (0 = same, 1 = disjoint)."""
    return 0.5 * np.abs(normalise(probs_LE, top_k) - normalise(reference_LE, top_k)).sum(axis=1)


def skew_per_layer(probs_LE: np.ndarray, top_k: int) -> np.ndarray:
    """[L] sum_e p^2 of each layer's normalised distribution (1/E uniform, 1 all on one expert)."""
    return (normalise(probs_LE, top_k) ** 2).sum(axis=1)


def skew(probs_LE: np.ndarray, top_k: int) -> float:
    """G = (1/L) sum_l sum_e p_{l,e}^2 with p normalised per layer; 1/E for uniform routing."""
    return float(skew_per_layer(probs_LE, top_k).mean())


# --- the profile ---------------------------------------------------------------------------


class AccessProfile(BaseModel):
    """How often each expert of each MoE layer was picked on some data (paper Fig. 3a / Fig. 7)."""

    model_config = ConfigDict(frozen=True)

    counts: list[list[int]]
    """[L, E] tokens routed to expert e of MoE layer l."""
    top_k: int
    """Experts per token; every row of `counts` sums to top_k * tokens."""
    tokens: int
    """Non-padding tokens profiled."""
    source: str = ""
    """What was profiled (model and data)."""
    scoring: Scoring = "softmax"
    """The routers' scoring function (see the module docstring for the confidence of each)."""
    confidence_edges: list[float] = []
    """[C + 1] bin edges of the router-confidence histograms (empty if not recorded)."""
    confidence_hist: list[list[int]] = []
    """[L, C] tokens per confidence bin, per layer."""
    confidence_mean: list[float] = []
    """[L] mean router confidence per layer."""

    @model_validator(mode="after")
    def _rows_sum_to_top_k(self) -> AccessProfile:
        if self.tokens <= 0:
            raise ValueError(f"profile of {self.source!r} has no tokens ({self.tokens})")
        sums = {sum(row) for row in self.counts}
        if sums != {self.top_k * self.tokens}:
            raise ValueError(f"counts rows sum to {sorted(sums)}, expected top_k * tokens = "
                             f"{self.top_k} * {self.tokens}")
        return self

    @computed_field  # stored in the JSON for readers that only want P
    @property
    def probs(self) -> list[list[float]]:
        """[L, E] access probability P = counts / tokens (rows sum to top_k)."""
        return self.probs_array().tolist()

    def probs_array(self) -> np.ndarray:
        return np.asarray(self.counts, dtype=np.float64) / self.tokens

    @property
    def num_layers(self) -> int:
        return len(self.counts)

    @property
    def num_experts(self) -> int:
        return len(self.counts[0])

    def confidence_cdf(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(edges [C + 1], fraction of tokens with confidence <= edge) for one MoE layer."""
        if not self.confidence_hist:
            raise ValueError(f"profile of {self.source!r} recorded no router confidence")
        hist = np.asarray(self.confidence_hist[layer], dtype=np.float64)
        return np.asarray(self.confidence_edges), np.concatenate([[0.0], np.cumsum(hist) / hist.sum()])

    def save(self, path: Path, npy_path: Path | None = None) -> None:
        """Write the JSON profile to `path` and, if given, P [L, E] as float64 to `npy_path`."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.model_dump_json(indent=1))
        if npy_path is not None:
            Path(npy_path).parent.mkdir(parents=True, exist_ok=True)
            np.save(npy_path, self.probs_array())

    @classmethod
    def load(cls, path: Path) -> AccessProfile:
        data = json.loads(Path(path).read_text())
        data.pop("probs", None)
        return cls.model_validate(data)


# --- hooks -------------------------------------------------------------------------------------


def router_scoring(gate: nn.Module) -> Scoring:
    """``sigmoid`` for DeepSeek-V3-style routers (they carry `e_score_correction_bias`), else ``softmax``."""
    return "sigmoid" if hasattr(gate, "e_score_correction_bias") else "softmax"


def router_of(block: nn.Module) -> nn.Module | None:
    """A MoE block's router: its `gate` or `router` child (None when it has neither)."""
    for name in ("gate", "router"):
        if isinstance(getattr(block, name, None), nn.Module):
            return getattr(block, name)
    return None


def _grouped_choices(grouped_XD: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, K] chosen experts of a grouped call (`broker.grouped_routing`); every token has the same K."""
    rows_R, expert_R = grouped_routing(grouped_XD, num_experts)
    num_tokens = grouped_XD.shape[0] // num_experts
    by_token = expert_R[torch.argsort(rows_R % num_tokens, stable=True)] if num_tokens else expert_R
    return by_token.reshape(num_tokens, len(rows_R) // num_tokens if num_tokens else 0)


def router_confidence(router_logits_TE: torch.Tensor, top_k_index_TK: torch.Tensor,
                      scoring: Scoring) -> torch.Tensor:
    """[T] share of the routing score held by each token's selected experts (module docstring)."""
    logits = router_logits_TE.float()
    if scoring == "softmax":
        scores_TE = logits.softmax(dim=-1)
    else:
        sigmoid_TE = logits.sigmoid()
        scores_TE = sigmoid_TE / sigmoid_TE.sum(dim=-1, keepdim=True)
    return scores_TE.gather(1, top_k_index_TK.long()).sum(dim=1)


class RoutingRecorder:
    """Counts the tokens each expert of each MoE block receives, via forward hooks.

    Per forward, in order:
      1. the caller sets the token mask (`set_attention_mask(batch["attention_mask"])`);
      2. the hook on ``block.gate`` turns router logits and the chosen experts into
         per-token confidences and adds them to a histogram (if `record_confidence`);
      3. the pre-hook on ``block.experts`` adds ``top_k_index`` of the unmasked
         tokens to the counts.
    The experts submodule is looked up when `attach` runs, so attach after any
    surgery that replaces it. `counts_LE` accumulates until `reset`; `take_counts`
    returns the counts since its last call (one training step, for `DriftTracker`).
    """

    def __init__(self, blocks: list[MoeBlock], top_k: int, record_confidence: bool = True,
                 confidence_bins: int = CONFIDENCE_BINS) -> None:
        num_experts = {b.layout.num_experts for b in blocks}
        if not blocks or len(num_experts) != 1:
            raise ValueError(f"need MoE blocks with one common expert count, got {sorted(num_experts)}")
        self.blocks, self.top_k, self.num_experts = blocks, top_k, num_experts.pop()
        routers = [router_of(b.block) for b in blocks]
        self.record_confidence = record_confidence and all(r is not None for r in routers)
        self.confidence_bins = confidence_bins
        self.scoring = router_scoring(routers[0]) if routers[0] is not None else "softmax"
        self._mask_T: torch.Tensor | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.reset()

    @classmethod
    def for_model(cls, model: nn.Module, blocks: list[MoeBlock] | None = None, **options) -> RoutingRecorder:
        """A recorder for `model`'s MoE blocks (`find_moe_blocks(model)` unless `blocks` is given); not attached."""
        return cls(blocks if blocks is not None else find_moe_blocks(model), top_k_of(model), **options)

    def reset(self) -> None:
        num_layers = len(self.blocks)
        self.counts_LE = torch.zeros(num_layers, self.num_experts, dtype=torch.long)
        self.tokens_L = torch.zeros(num_layers, dtype=torch.long)
        self.confidence_hist_LC = torch.zeros(num_layers, self.confidence_bins, dtype=torch.long)
        self.confidence_sum_L = torch.zeros(num_layers, dtype=torch.float64)
        self._since_take_LE = torch.zeros_like(self.counts_LE)

    def set_attention_mask(self, attention_mask: torch.Tensor | None) -> None:
        """Count only positions where `attention_mask` ([B, S]) is 1 in the next forwards (None: all)."""
        self._mask_T = None if attention_mask is None else attention_mask.reshape(-1).bool().cpu()

    def attach(self) -> RoutingRecorder:
        if self._handles:
            raise ValueError("RoutingRecorder is already attached; detach() it first")
        for layer, moe in enumerate(self.blocks):
            experts = moe.block.experts  # looked up now: the runtime may have swapped it
            self._handles.append(experts.register_forward_pre_hook(self._experts_hook(layer), with_kwargs=True))
            if self.record_confidence:
                self._handles.append(router_of(moe.block).register_forward_hook(self._gate_hook(layer)))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> RoutingRecorder:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def take_counts(self) -> torch.Tensor:
        """[L, E] counts recorded since the previous call."""
        counts, self._since_take_LE = self._since_take_LE, torch.zeros_like(self._since_take_LE)
        return counts

    def _valid_rows(self, num_tokens: int, layer: int) -> torch.Tensor | None:
        if self._mask_T is None:
            return None
        if self._mask_T.numel() != num_tokens:
            raise ValueError(
                f"MoE layer {layer} routed {num_tokens} tokens but the attention mask has "
                f"{self._mask_T.numel()}; call set_attention_mask(batch['attention_mask']) before each forward"
            )
        return self._mask_T

    def _experts_hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.blocks[layer].layout.call == "grouped":
                top_k_index_TK = _grouped_choices((args or tuple(kwargs.values()))[0], self.num_experts)
            else:
                top_k_index_TK = args[1] if len(args) > 1 else list(kwargs.values())[0]  # the family's own name
            top_k_index_TK = top_k_index_TK.detach().to("cpu")
            valid_T = self._valid_rows(top_k_index_TK.shape[0], layer)
            if valid_T is not None:
                top_k_index_TK = top_k_index_TK[valid_T]
            counts_E = torch.bincount(top_k_index_TK.reshape(-1), minlength=self.num_experts)
            self.counts_LE[layer] += counts_E
            self._since_take_LE[layer] += counts_E
            self.tokens_L[layer] += top_k_index_TK.shape[0]
        return hook

    def _gate_hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, output) -> None:
            if not isinstance(output, tuple) or len(output) != 3:  # another router: no confidence to read
                log.info("%s returns %s, not (router_logits, top_k_weights, top_k_index): the profile has no "
                            "router confidence", type(module).__name__, type(output).__name__)
                self.record_confidence = False
                return
            router_logits, _, top_k_index = output
            confidence_T = router_confidence(router_logits.detach(), top_k_index.detach(), self.scoring).cpu()
            valid_T = self._valid_rows(confidence_T.shape[0], layer)
            if valid_T is not None:
                confidence_T = confidence_T[valid_T]
            hist = torch.histc(confidence_T.clamp(0.0, 1.0), bins=self.confidence_bins, min=0.0, max=1.0)
            self.confidence_hist_LC[layer] += hist.long()
            self.confidence_sum_L[layer] += confidence_T.double().sum()
        return hook

    def counts(self) -> dict[str, Any]:
        """What it recorded, as `add` takes it: a pipeline stage's counts of its own layers, which stage 0 adds to
        its own (`runtime.masters.stage_profile`)."""
        return {"counts_LE": self.counts_LE, "tokens_L": self.tokens_L, "confidence_hist_LC": self.confidence_hist_LC,
                "confidence_sum_L": self.confidence_sum_L, "record_confidence": self.record_confidence}

    def add(self, counts: dict[str, Any]) -> None:
        """Another recorder's `counts` of the same blocks added to this one's."""
        for name in ("counts_LE", "tokens_L", "confidence_hist_LC", "confidence_sum_L"):
            getattr(self, name).add_(counts[name])
        self.record_confidence = self.record_confidence and counts["record_confidence"]

    def profile(self, source: str = "") -> AccessProfile:
        """The counts recorded so far as an `AccessProfile`."""
        tokens = int(self.tokens_L[0])
        if not bool((self.tokens_L == tokens).all()):
            raise ValueError(f"MoE layers saw different token counts {self.tokens_L.tolist()}")
        confidence = {}
        if self.record_confidence and tokens:
            confidence = dict(
                confidence_edges=np.linspace(0.0, 1.0, self.confidence_bins + 1).tolist(),
                confidence_hist=self.confidence_hist_LC.tolist(),
                confidence_mean=(self.confidence_sum_L / tokens).tolist(),
            )
        return AccessProfile(counts=self.counts_LE.tolist(), top_k=self.top_k, tokens=tokens,
                             source=source, scoring=self.scoring, **confidence)


# --- profiling ------------------------------------------------------------------------------------


def profile_model(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], *,
                  blocks: list[MoeBlock] | None = None, source: str = "",
                  progress: bool = False) -> AccessProfile:
    """Run `batches` through `model` in inference mode and count expert accesses per MoE layer.

    `batches` yield ``input_ids`` and optionally ``attention_mask`` [B, S] (padding
    is not counted) and ``position_ids`` (packed rows: then the mask only counts tokens, and
    the model masks attention per example from the positions; see `vela_ray.data.examples`). Pass `blocks` (from `find_moe_blocks` before any surgery) when
    the model has been wrapped, e.g. by peft. The model's train/eval mode is restored.
    """
    recorder = RoutingRecorder.for_model(model, blocks)
    with recorder:
        profile_forwards(model, batches, progress, on_batch=recorder.set_attention_mask)
    if int(recorder.tokens_L[0]) == 0:
        raise ValueError(f"no tokens profiled for {source!r}: the batches were empty or fully padded")
    return recorder.profile(source)


def profile_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """A profile forward's arguments: the token ids and the positions of packed rows, else the mask."""
    positions = batch.get("position_ids")
    inputs = {"position_ids": positions} if positions is not None else {"attention_mask": batch.get("attention_mask")}
    return {"input_ids": batch["input_ids"].to(device), "use_cache": False,
            **{k: None if v is None else v.to(device) for k, v in inputs.items()}}


def profile_forwards(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], progress: bool = False,
                     on_batch=None, run=None) -> None:
    """The forwards of `profile_model` (eval mode, no gradients; the mode restored), each batch's mask handed to
    `on_batch` first: what a rank that shares the model's layers with the profiling one runs beside it. `run(batches,
    forward)`: how the forwards run (a pipeline stage's through the stages, `PipelineStage.forwards`); None: one
    after another."""
    device = next(model.parameters()).device

    def forward(batch: dict[str, torch.Tensor]) -> None:
        if on_batch is not None:
            on_batch(batch.get("attention_mask"))
        model(**profile_inputs(batch, device))

    was_training = model.training
    model.eval()
    try:
        # no_grad, not inference_mode: FSDP2 (`masters.shard_frozen_backbone`) all-gathers into buffers it updates
        # in place later, which a tensor made under inference mode refuses
        with torch.no_grad():
            if run is not None:
                run(list(batches), forward)
            else:
                for batch in tqdm(batches, desc="profile", unit="batch", disable=not progress):
                    forward(batch)
    finally:
        model.train(was_training)


# --- drift during fine-tuning -----------------------------------------------------------------------


class DriftTracker:
    """Expert access per fine-tuning step, compared with the profile taken before fine-tuning.

    Feed it one [L, E] count matrix per step, from a `RoutingRecorder.take_counts()`
    or from the runtime's expert broker. Step probabilities are windowed over the
    last `window` steps before comparing, because one step's batch is a small sample.
    """

    def __init__(self, initial_probs_LE: np.ndarray, top_k: int) -> None:
        self.initial_LE = np.asarray(initial_probs_LE, dtype=np.float64)
        if self.initial_LE.ndim != 2:
            raise ValueError(f"initial probabilities must be [L, E], got shape {self.initial_LE.shape}")
        self.top_k = top_k
        self._counts: list[np.ndarray] = []

    @classmethod
    def from_profile(cls, profile: AccessProfile) -> DriftTracker:
        return cls(profile.probs_array(), profile.top_k)

    @property
    def num_steps(self) -> int:
        return len(self._counts)

    def record_step(self, counts_LE: np.ndarray | torch.Tensor) -> np.ndarray:
        """Record one step's [L, E] expert counts; returns that step's [L] TV distance to the initial profile."""
        counts_LE = np.asarray(counts_LE.cpu() if isinstance(counts_LE, torch.Tensor) else counts_LE,
                               dtype=np.int64)
        if counts_LE.shape != self.initial_LE.shape:
            raise ValueError(f"step counts have shape {counts_LE.shape}, the initial profile {self.initial_LE.shape}")
        probs_LE = probs_from_counts(counts_LE, self.top_k)
        self._counts.append(counts_LE)
        return total_variation(probs_LE, self.initial_LE, self.top_k)

    def probs(self, window: int = 1) -> np.ndarray:
        """[steps, L, E] P of each step, summed over the trailing `window` steps (fewer at the start)."""
        if not self._counts:
            raise ValueError("DriftTracker has no recorded steps")
        if window < 1:
            raise ValueError(f"window must be >= 1 step, got {window}")
        cumulative = np.cumsum(np.stack(self._counts), axis=0)
        windowed = cumulative.copy()
        windowed[window:] -= cumulative[:-window]
        return np.stack([probs_from_counts(c, self.top_k) for c in windowed])

    def tv(self, window: int = 1) -> np.ndarray:
        """[steps, L] total-variation distance of each (windowed) step to the initial profile."""
        return np.stack([total_variation(p, self.initial_LE, self.top_k) for p in self.probs(window)])

    def skew(self, window: int = 1) -> np.ndarray:
        """[steps] skew G of each (windowed) step."""
        return np.array([skew(p, self.top_k) for p in self.probs(window)])
