"""Tests of vela_ray.data.locality: counts from hooks, padding, confidence, profiles on disk, drift metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from placement.io import load_profile
from tests.fixtures import KNOWN_FAILURES, REFUSED
from vela_ray.model.families import FAMILIES, debug_model, moe_families
from vela_ray.data.locality import (
    AccessProfile,
    DriftTracker,
    RoutingRecorder,
    profile_model,
    skew,
    skew_per_layer,
    total_variation,
)
from vela_ray.model.modeling import find_moe_blocks, top_k_of


def _batch(seed: int = 0, batch: int = 3, seq: int = 12) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 128, (batch, seq), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _reference_top_k(gate: nn.Module, logits_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k choice recomputed from router logits: softmax top-k, or DeepSeek-V3's grouped sigmoid choice."""
    if not hasattr(gate, "e_score_correction_bias"):
        return logits_TE.float().softmax(-1).topk(top_k, dim=-1).indices
    scores_TE = logits_TE.float().sigmoid() + gate.e_score_correction_bias
    tokens, experts = scores_TE.shape
    grouped = scores_TE.view(tokens, gate.num_group, experts // gate.num_group)
    kept_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(gate.topk_group, dim=-1).indices
    keep = torch.zeros(tokens, gate.num_group, dtype=torch.bool).scatter_(1, kept_groups, True)
    masked = grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts)
    return masked.topk(top_k, dim=-1).indices


def _recount(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[np.ndarray, list[torch.Tensor]]:
    """[L, E] counts and per-layer logits captured by plain hooks on the gates, independent of the recorder."""
    blocks = find_moe_blocks(model)
    logits: list[torch.Tensor] = [None] * len(blocks)
    handles = [b.block.gate.register_forward_hook(
        lambda m, a, out, i=b.index: logits.__setitem__(i, out[0].detach())) for b in blocks]
    with torch.no_grad():
        model(input_ids=batch["input_ids"])
    for handle in handles:
        handle.remove()
    counts = np.zeros((len(blocks), blocks[0].layout.num_experts), dtype=np.int64)
    for layer, block in enumerate(blocks):
        chosen = _reference_top_k(block.block.gate, logits[layer], top_k_of(model))
        counts[layer] = np.bincount(chosen.flatten().numpy(), minlength=counts.shape[1])
    return counts, logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_profile_counts_match_a_recount_from_router_logits(family):
    model, batch = debug_model(family), _batch()
    profile = profile_model(model, [batch])
    expected_counts, _ = _recount(model, batch)
    assert profile.tokens == 36
    assert np.array_equal(np.asarray(profile.counts), expected_counts)
    assert np.allclose(profile.probs_array().sum(axis=1), top_k_of(model))
    assert profile.scoring == ("sigmoid" if family == "deepseek_v3" else "softmax")


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_router_confidence_is_the_share_of_score_on_the_selected_experts(family):
    model, batch = debug_model(family), _batch()
    profile = profile_model(model, [batch])
    _, logits = _recount(model, batch)
    gate = find_moe_blocks(model)[0].block.gate
    chosen = _reference_top_k(gate, logits[0], top_k_of(model))
    scores = logits[0].softmax(-1) if family == "mixtral" else logits[0].sigmoid() / logits[0].sigmoid().sum(-1, True)
    expected = scores.gather(1, chosen).sum(1)
    assert profile.confidence_mean[0] == pytest.approx(float(expected.mean()), abs=1e-5)
    edges, cdf = profile.confidence_cdf(0)
    assert profile.confidence_hist[0] == np.histogram(expected.numpy(), bins=edges)[0].tolist()
    assert cdf[0] == 0.0 and cdf[-1] == pytest.approx(1.0)


def test_profiling_the_same_data_twice_gives_the_same_profile():
    model = debug_model("qwen3_moe")
    batches = [_batch(0), _batch(1)]
    assert profile_model(model, batches).counts == profile_model(model, batches).counts


def test_padded_positions_are_not_counted():
    # right padding under causal attention leaves the real tokens' routing unchanged
    model, full = debug_model("mixtral"), _batch(batch=2, seq=10)
    padded = {"input_ids": full["input_ids"].clone(), "attention_mask": full["attention_mask"].clone()}
    padded["attention_mask"][1, 4:] = 0
    padded["input_ids"][1, 4:] = 0
    separate = [{"input_ids": full["input_ids"][:1]}, {"input_ids": full["input_ids"][1:, :4]}]
    got, want = profile_model(model, [padded]), profile_model(model, separate)
    assert got.tokens == want.tokens == 14
    assert got.counts == want.counts
    assert sum(got.confidence_hist[0]) == 14


def test_fully_padded_batches_are_an_error():
    batch = _batch()
    batch["attention_mask"].zero_()
    with pytest.raises(ValueError, match="no tokens profiled"):
        profile_model(debug_model("olmoe"), [batch])


def test_a_stale_attention_mask_is_an_error():
    model = debug_model("mixtral")
    recorder = RoutingRecorder(find_moe_blocks(model), top_k_of(model))
    with recorder, torch.no_grad():
        recorder.set_attention_mask(torch.ones(1, 5))
        with pytest.raises(ValueError, match=r"routed 36 tokens but the attention mask has 5"):
            model(input_ids=_batch()["input_ids"])


class _Wrapped(nn.Module):
    """Stands in for the runtime's ExpertBroker: same call signature as the experts it replaces."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.inner = experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.inner(hidden_states, top_k_index=top_k_index, top_k_weights=top_k_weights)


def test_hooks_follow_an_experts_module_swapped_before_attach():
    model, batch = debug_model("mixtral"), _batch()
    blocks = find_moe_blocks(model)
    before = profile_model(model, [batch], blocks=blocks)
    for block in blocks:
        block.block.experts = _Wrapped(block.block.experts)
    assert profile_model(model, [batch], blocks=blocks).counts == before.counts


def test_take_counts_returns_counts_per_training_step_and_detach_stops_counting():
    model = debug_model("mixtral").train()
    recorder = RoutingRecorder.for_model(model, record_confidence=False).attach()
    for seed in range(2):
        batch = _batch(seed)
        recorder.set_attention_mask(batch["attention_mask"])
        model(**batch, labels=batch["input_ids"]).loss.backward()
        assert recorder.take_counts().sum(dim=1).tolist() == [72, 72]  # 36 tokens x top-2 per layer
    recorder.detach()
    model(input_ids=_batch()["input_ids"])
    assert recorder.take_counts().sum() == 0 and recorder.tokens_L.tolist() == [72, 72]


def test_profile_round_trips_through_json_and_npy(tmp_path):
    profile = profile_model(debug_model("deepseek_v3"), [_batch()], source="debug deepseek")
    profile.save(tmp_path / "p.json", tmp_path / "p.npy")
    loaded = AccessProfile.load(tmp_path / "p.json")
    assert loaded == profile
    assert np.array_equal(np.load(tmp_path / "p.npy"), profile.probs_array())
    # placement.io.load_profile, the one profile reader, reads both files back the same (with top_k from the JSON)
    assert np.array_equal(load_profile(tmp_path / "p.json")[0], load_profile(tmp_path / "p.npy")[0])
    assert load_profile(tmp_path / "p.json")[1] == 2 and load_profile(tmp_path / "p.npy")[1] is None
    raw = (tmp_path / "p.json").read_text()
    assert '"probs"' in raw and '"top_k": 2' in raw and '"tokens": 36' in raw


def test_profile_rows_must_sum_to_top_k_times_tokens():
    with pytest.raises(ValueError, match=r"counts rows sum to \[5, 6\], expected top_k \* tokens = 2 \* 3"):
        AccessProfile(counts=[[3, 2], [3, 3]], top_k=2, tokens=3)


# --- metrics, worked by hand ------------------------------------------------------------------


def test_skew_is_one_over_e_for_uniform_routing_and_grows_with_concentration():
    uniform = np.full((2, 4), 0.5)  # E = 4, top-2: every expert sees half the tokens
    assert skew(uniform, top_k=2) == pytest.approx(0.25)
    # layer 0 all on experts 0 and 1: p = [.5, .5, 0, 0] -> .25 + .25 = .5; layer 1 uniform -> .25
    mixed = np.array([[1.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    assert skew_per_layer(mixed, top_k=2).tolist() == pytest.approx([0.5, 0.25])
    assert skew(mixed, top_k=2) == pytest.approx(0.375)


def test_total_variation_per_layer():
    p = np.array([[1.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    q = np.array([[0.0, 0.0, 1.0, 1.0], [1.0, 0.5, 0.5, 0.0]])
    # layer 0 disjoint -> 1; layer 1: 0.5 * (|.25-.5| + 0 + 0 + |.25-0|) = 0.25
    assert total_variation(p, q, top_k=2).tolist() == pytest.approx([1.0, 0.25])
    assert total_variation(p, p, top_k=2).tolist() == [0.0, 0.0]


def test_drift_tracker_compares_windowed_steps_with_the_initial_profile():
    initial = np.array([[1.0, 0.5, 0.5, 0.0]])  # one layer, E = 4, top-2
    tracker = DriftTracker(initial, top_k=2)
    # 10 tokens per step: counts sum to 20
    assert tracker.record_step(np.array([[10, 5, 5, 0]])).tolist() == [0.0]
    # shares [0, .25, .25, .5] vs [.5, .25, .25, 0] -> 0.5 * (.5 + .5) = .5
    assert tracker.record_step(torch.tensor([[0, 5, 5, 10]])).tolist() == [0.5]
    assert tracker.tv(window=1)[:, 0].tolist() == [0.0, 0.5]
    # window 2 pools both steps: [.25, .25, .25, .25] vs initial -> 0.5 * (.25 + 0 + 0 + .25) = .25
    assert tracker.tv(window=2)[:, 0].tolist() == pytest.approx([0.0, 0.25])
    assert tracker.skew(window=2).tolist() == pytest.approx([0.375, 0.25])
    assert tracker.probs(window=2).shape == (2, 1, 4)


def test_drift_tracker_rejects_bad_step_counts():
    tracker = DriftTracker(np.full((2, 4), 0.5), top_k=2)
    with pytest.raises(ValueError, match=r"step counts have shape \(1, 4\), the initial profile \(2, 4\)"):
        tracker.record_step(np.ones((1, 4)))
    with pytest.raises(ValueError, match="tokens in every layer"):
        tracker.record_step(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="no recorded steps"):
        tracker.tv()


@pytest.mark.parametrize("family", [f for f in moe_families() if f not in REFUSED and f not in KNOWN_FAILURES])
def test_profiling_counts_every_tokens_top_k_choices_in_every_family(family):
    """Routers named gate or router (or neither), keyword calls (gpt-oss), Llama 4's grouped call."""
    torch.set_num_threads(1)
    model = debug_model(family)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    profile = profile_model(model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])
    assert profile.tokens == 24
    assert all(sum(row) == profile.tokens * profile.top_k for row in profile.counts)
