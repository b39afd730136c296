"""Token condensation (LUFFY §V, `vela_ray.model.condensation`): which rows travel, the autograd of the
condensed computation, and whole jobs in one process with it off (exact, unchanged) and on (lossy, fewer bytes).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.fixtures import job_dict, make_checkpoint, run_in_process
from vela_ray.config import CondensationSection, JobConfig
from vela_ray.model.broker import ExpertBroker, ExpertDispatcher
from vela_ray.model.condensation import Condenser, adaptive_threshold, select_representatives
from vela_ray.model.traffic import DIRECTIONS
from vela_ray.model.transport import InProcessTransport
from vela_ray.observability.report import summary_text
from vela_ray.training.summary import RunSummary

D = 4
E0, E1, E2, E3 = torch.eye(D)


def _one_expert(num_rows: int) -> torch.Tensor:
    return torch.zeros(num_rows, dtype=torch.long)


def _condenser(threshold: float | str = 0.9, **fields) -> Condenser:
    return Condenser(CondensationSection(enabled=True, threshold=threshold, **fields))


# --- selection -------------------------------------------------------------------------------------------


def test_identical_rows_of_one_expert_collapse_to_one_representative():
    rows = torch.stack([E0 + E1, E2, E0 + E1, E0 + E1, E3])
    selection = select_representatives(rows, _one_expert(5), 0.9)
    assert selection.representative_R.tolist() == [0, 1, 0, 0, 4]
    assert selection.kept_R.tolist() == [True, True, False, False, True]
    assert selection.source_R.tolist() == [0, 1, 0, 0, 2]  # positions among the 3 rows that travel
    assert selection.num_condensed == 2


def test_the_same_rows_routed_to_different_experts_never_condense():
    rows = (E0 + E1).repeat(4, 1)
    selection = select_representatives(rows, torch.tensor([0, 1, 2, 1]), 0.5)
    assert selection.representative_R.tolist() == [0, 1, 2, 1]  # only the two rows of expert 1 condense
    assert selection.pairs_computed == 1  # and only their pair was compared


def test_orthogonal_and_opposite_rows_never_condense_whatever_the_threshold():
    rows = torch.stack([E0, E1, E2, -E0, -E1])  # cosines 0 or -1: similarity 0 on the clamped scale
    selection = select_representatives(rows, _one_expert(5), 1e-6)
    assert selection.num_condensed == 0


def test_a_threshold_of_one_condenses_nothing_even_identical_rows():
    selection = select_representatives(E0.repeat(3, 1), _one_expert(3), 1.0)
    assert selection.num_condensed == 0


def test_the_highest_degree_row_is_kept_and_its_neighbours_condensed():
    # A star: the hub (last row) has cosine 0.5 with each of 4 orthogonal leaves. Keeping rows in
    # index order would keep leaf 0, condense the hub into it and keep leaves 1-3; by degree the hub
    # is kept and every leaf condenses into it.
    hub = (E0 + E1 + E2 + E3) / 2
    selection = select_representatives(torch.stack([E0, E1, E2, E3, hub]), _one_expert(5), 0.4)
    assert selection.representative_R.tolist() == [4, 4, 4, 4, 4]


def test_a_condensed_row_is_never_a_representative_of_others():
    # a chain a - b - c (cos(a, c) = 0): b is the hub; a and c both condense into it
    a, c = E0, E1
    b = (a + c) / math.sqrt(2)
    selection = select_representatives(torch.stack([a, b, c]), _one_expert(3), 0.6)
    assert selection.representative_R.tolist() == [1, 1, 1]


def test_no_rows_and_one_row():
    assert select_representatives(torch.zeros(0, D), _one_expert(0), 0.5).representative_R.tolist() == []
    assert select_representatives(E0[None], _one_expert(1), 0.5).representative_R.tolist() == [0]


def test_blockwise_similarity_gives_the_same_selection_as_one_block():
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(6, 16, generator=gen)
    rows = centres[torch.randint(0, 6, (60,), generator=gen)] + 0.3 * torch.randn(60, 16, generator=gen)
    experts = torch.randint(0, 3, (60,), generator=gen)
    whole = select_representatives(rows, experts, 0.8)
    blocks = select_representatives(rows, experts, 0.8, block=7)
    assert whole.num_condensed > 0
    assert torch.equal(whole.representative_R, blocks.representative_R)
    assert whole.pairs_computed == blocks.pairs_computed


# --- history ---------------------------------------------------------------------------------------------


def test_a_pair_similar_in_the_previous_layer_condenses_without_recomputation():
    condenser = _condenser(0.9)  # S1 = 0.8, S2 = 0.2
    tokens = torch.tensor([0, 1, 2])
    first = condenser.select(0, torch.stack([E0, E0, E1]), _one_expert(3), tokens)
    assert first.representative_R.tolist() == [0, 0, 2] and first.pairs_computed == 3
    # Layer 1: tokens 0 and 1 are now orthogonal, token 2 equals token 0. History decides every pair:
    # (0, 1) similar -> condensed; (0, 2) and (1, 2) dissimilar -> kept apart, though identical now.
    second = condenser.select(1, torch.stack([E0, E1, E0]), _one_expert(3), tokens)
    assert (second.pairs_computed, second.pairs_from_history) == (0, 3)
    assert second.representative_R.tolist() == [0, 0, 2]


def test_history_is_keyed_by_token_and_only_for_pairs_the_previous_layer_compared():
    condenser = _condenser(0.9)
    # layer 0: tokens 5 and 7 share expert 0 (similar); token 9 is alone on expert 1
    condenser.select(0, torch.stack([E0, E0, E0]), torch.tensor([0, 0, 1]), torch.tensor([5, 7, 9]))
    # layer 1, rows in another order: (5, 7) comes from history; (5, 9) and (7, 9) were never compared
    second = condenser.select(1, torch.stack([E1, E2, E1]), _one_expert(3), torch.tensor([9, 7, 5]))
    assert (second.pairs_computed, second.pairs_from_history) == (2, 1)
    # token 5 (row 2) is similar to 7 by history and to 9 by cosine (1.0): the hub of all three
    assert second.representative_R.tolist() == [2, 2, 2]


def test_history_is_used_only_from_the_layer_just_before_in_the_same_forward():
    condenser = _condenser(0.9)
    tokens = torch.tensor([0, 1])
    condenser.select(0, torch.stack([E0, E0]), _one_expert(2), tokens)
    skipped = condenser.select(2, torch.stack([E0, E1]), _one_expert(2), tokens)  # layer 1 did not run
    assert (skipped.pairs_computed, skipped.num_condensed) == (1, 0)
    next_forward = condenser.select(0, torch.stack([E0, E1]), _one_expert(2), tokens)
    assert (next_forward.pairs_from_history, next_forward.num_condensed) == (0, 0)


# --- threshold and config --------------------------------------------------------------------------------


def test_the_adaptive_threshold_follows_the_loss_as_eq_2():
    condenser = _condenser("adaptive")
    assert condenser.threshold == 0.5  # no loss yet: l_norm = 0
    condenser.observe_loss(4.0)
    assert condenser.threshold == 0.5
    condenser.observe_loss(2.0)  # l_norm = (4 - 2) / 4 = 0.5
    assert condenser.threshold == pytest.approx(1 / (1 + math.exp(0.5)))
    condenser.observe_loss(float("nan"))  # skipped
    assert condenser.threshold == pytest.approx(0.3775, abs=1e-4)
    assert adaptive_threshold(4.0, 8.0) == pytest.approx(1 / (1 + math.exp(-1)))  # a rising loss condenses less
    assert _condenser(0.7).threshold == 0.7 and _condenser(0.7).policy == "fixed 0.7"


@pytest.mark.parametrize("fields,message", [
    ({"threshold": 0}, r"training\.condensation\.threshold is 0: give a similarity in \(0, 1\]"),
    ({"threshold": 1.5}, r"training\.condensation\.threshold is 1\.5"),
    ({"threshold": "adapt"}, r"training\.condensation\.threshold is 'adapt'.*'adaptive'"),
    ({"similar_above": 0.1}, r"training\.condensation\.dissimilar_below \(0\.2\) must be below "
                             r"training\.condensation\.similar_above \(0\.1\)"),
])
def test_bad_condensation_settings_get_one_error_naming_the_field(tmp_path, fields, message):
    job = job_dict(tmp_path, tmp_path / "out", training={"condensation": {"enabled": True, **fields}})
    with pytest.raises(ValueError, match=message) as err:
        JobConfig.from_dict(job)
    assert "; " not in str(err.value)  # one error (`JobConfig.from_dict` joins several with "; ")


def test_condensation_is_off_by_default():
    section = CondensationSection()
    assert (section.enabled, section.threshold, section.similar_above, section.dissimilar_below) == (
        False, "adaptive", 0.8, 0.2)


# --- the broker: autograd of the condensed computation ------------------------------------------------------


class LinearExperts:
    """A worker whose expert e of every layer is x -> x @ W[e], keeping its graph per key as ExpertShard does."""

    def __init__(self, weight_EDD: torch.Tensor):
        self.weight = weight_EDD.clone().requires_grad_()
        self.saved: dict = {}

    def forward_rows(self, layer, expert_ids, rows, key):
        x = rows.detach().requires_grad_(key is not None)
        with torch.enable_grad():  # the broker calls in from an autograd Function's forward
            out = torch.einsum("rd,rde->re", x, self.weight[expert_ids])
        if key is not None:
            self.saved[key] = (x, out)
        return out.detach()

    def backward_rows(self, key, grad):
        x, out = self.saved.pop(key)
        out.backward(grad)
        return x.grad


def _broker(condenser: Condenser | None) -> tuple[ExpertBroker, LinearExperts, ExpertDispatcher]:
    experts = LinearExperts(torch.randn(2, D, D, generator=torch.Generator().manual_seed(0)))
    dispatcher = ExpertDispatcher(torch.zeros(1, 2, dtype=torch.long), InProcessTransport([experts]),
                                  condenser=condenser)
    return ExpertBroker(0, dispatcher).train(), experts, dispatcher


def test_the_condensed_forward_and_its_gradient_match_the_hand_derived_ones():
    broker, experts, dispatcher = _broker(_condenser(0.9))
    x = torch.stack([E0 + E1, E0 + E1, E2, E0 + E1]).requires_grad_()  # tokens 0, 1, 3 alike
    index = torch.tensor([[0], [0], [0], [0]])
    w = torch.tensor([[0.5], [2.0], [1.0], [3.0]], requires_grad=True)
    c = torch.randn(4, D, generator=torch.Generator().manual_seed(1))
    out = broker(x, index, w)
    (out * c).sum().backward()

    W = experts.weight.detach()[0]
    g = w.detach() * c  # d loss / d expert output of each token
    # forward: every token of the group takes the representative's (token 0's) output, out_i = w_i f(x_0)
    # backward: x_0 gets W^T-weighted sum of the group's output grads; tokens 1 and 3 nothing;
    # W gets sum_i x_rep(i)^T g_i; w_i gets <c_i, f(x_rep(i))>
    want_x = torch.zeros(4, D)
    want_x[0] = (g[0] + g[1] + g[3]) @ W.T
    want_x[2] = g[2] @ W.T
    torch.testing.assert_close(x.grad, want_x)
    reps = x.detach()[[0, 0, 2, 0]]
    torch.testing.assert_close(out.detach(), w.detach() * (reps @ W))
    torch.testing.assert_close(experts.weight.grad[0], reps.T @ g)
    torch.testing.assert_close(w.grad[:, 0], (c * (reps @ W)).sum(1))

    # what travelled: 2 rows each way instead of 4; what the condenser says it saved is the rest
    rows_by_direction = torch.tensor(dispatcher.traffic().rows).sum(dim=(0, 1)).tolist()
    assert rows_by_direction == [2, 2, 2, 2]
    assert dispatcher.condenser.bytes_saved == dict.fromkeys(DIRECTIONS, 2 * D * 4)


def test_eval_and_no_grad_forwards_stay_exact():
    condenser = _condenser(0.9)
    broker, experts, dispatcher = _broker(condenser)
    x, index, w = torch.stack([E0, E0 + 1e-3 * E1]), torch.tensor([[0], [0]]), torch.ones(2, 1)
    exact = x @ experts.weight.detach()[0]
    with torch.no_grad():
        torch.testing.assert_close(broker(x, index, w), exact)
    broker.eval()
    torch.testing.assert_close(broker(x, index, w).detach(), exact)
    assert condenser.rows_seen == 0
    rows = torch.tensor(dispatcher.traffic().rows)
    assert rows[:, :, DIRECTIONS.index("dispatch")].sum() == 2 + 2  # both rows, both times


# --- whole jobs in one process ---------------------------------------------------------------------------

STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")


def _run(model_dir: Path, out: Path, **training) -> RunSummary:
    job = job_dict(model_dir, out, steps=STEPS, placement={"solver": "sequential", "profile": "uniform"},
                   training={"eval_batches": 1, "optimizer": {"lr": 5e-3, "warmup_steps": 1}, **training})
    return run_in_process(JobConfig.from_dict(job))


@pytest.fixture(scope="module")
def exact(model_dir, tmp_path_factory) -> RunSummary:
    """The run that does not mention condensation."""
    return _run(model_dir, tmp_path_factory.mktemp("exact") / "out")


@pytest.mark.job
def test_condensation_off_changes_nothing_and_says_so(model_dir, exact, tmp_path):
    off = _run(model_dir, tmp_path / "out", condensation={"enabled": False, "threshold": 0.1})
    assert off.losses == exact.losses and off.eval_loss == exact.eval_loss
    assert off.traffic_bytes_by_tier == exact.traffic_bytes_by_tier
    assert off.condensation.enabled is False and off.condensation.rows_seen == 0
    assert "token condensation: off (exact)" in summary_text(tmp_path / "out")
    assert "token condensation: off (exact)" in (tmp_path / "out" / "report.html").read_text()
    legacy = RunSummary.model_validate({**off.model_dump(), "condensation": None})  # an older summary.json
    assert "token condensation: off (exact)" in summary_text(legacy)


@pytest.mark.job
def test_condensation_on_moves_exactly_the_saved_bytes_less_and_is_lossy(model_dir, exact, tmp_path):
    on = _run(model_dir, tmp_path / "out", condensation={"enabled": True, "threshold": 0.6})
    record = on.condensation
    assert record.enabled and record.threshold_policy == "fixed 0.6" and record.final_threshold == 0.6
    assert 0 < record.rows_condensed < record.rows_seen
    row_bytes = 32 * 4  # debug Mixtral: hidden 32, float32; every direction moves one row per condensed row
    assert record.bytes_saved == dict.fromkeys(DIRECTIONS, record.rows_condensed * row_bytes)
    # same seed, data and row counts (every token has top-k rows whatever it is routed to), so the traffic
    # counters differ by exactly what did not travel: training forward, training backward and, per direction
    exact_total, on_total = sum(exact.traffic_bytes_by_tier.values()), sum(on.traffic_bytes_by_tier.values())
    assert exact_total - on_total == record.bytes_saved_total
    assert sum(exact.sent_bytes_by_worker) - sum(on.sent_bytes_by_worker) == (
        record.bytes_saved["dispatch"] + record.bytes_saved["grad_dispatch"])
    assert on.losses[0] != exact.losses[0]  # lossy from the first forward
    assert all(math.isfinite(loss) for loss in on.losses) and math.isfinite(on.eval_loss)
    line = summary_text(tmp_path / "out")
    assert f"token condensation: on (LOSSY): {record.condensed_fraction:.1%} of rows condensed" in line
    assert "token condensation: on (LOSSY)" in (tmp_path / "out" / "report.html").read_text()


def test_a_grouped_call_keys_history_by_the_models_token_not_by_the_sent_row():
    # Llama 4's `experts(x)`: x [E*T, D], expert e's rows at e*T + token. Layer 0: tokens 0 and 1 alike on
    # expert 0. Layer 1: token 2 on expert 0 and tokens 0, 1 (now orthogonal) on expert 1, so the rows sent
    # are x[2], x[3], x[4]: by position tokens 0 and 1 would be keys 1 and 2, by token they are 0 and 1.
    experts = LinearExperts(torch.randn(2, D, D, generator=torch.Generator().manual_seed(0)))
    dispatcher = ExpertDispatcher(torch.zeros(2, 2, dtype=torch.long), InProcessTransport([experts]),
                                  condenser=_condenser(0.9))
    layout = SimpleNamespace(call="grouped", num_experts=2)
    brokers = [ExpertBroker(layer, dispatcher, layout).train() for layer in range(2)]
    first = torch.zeros(6, D)
    first[0], first[1] = E0, E0
    brokers[0](first)
    second = torch.zeros(6, D)
    second[2], second[3], second[4] = E2, E0, E1
    out = brokers[1](second)
    assert dispatcher.condenser.pairs_from_history == 1  # (token 0, token 1), taken as similar
    torch.testing.assert_close(out[4], out[3])  # token 1 took token 0's output
    torch.testing.assert_close(out[3], E0 @ experts.weight.detach()[1])
