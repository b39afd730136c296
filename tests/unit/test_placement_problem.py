"""The placement problem, its inputs and the cost model (placement/problem.py, io.py, cost.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from placement import PlacementProblem, cost_report, cross_node_bytes, layer_worker_times, step_time, worker_bytes
from placement.io import infer_top_k, load_profile, parse_capacities, probs_from_counts
from placement.problem import build_problem, synthetic_probs


def two_worker_problem(**overrides) -> PlacementProblem:
    fields = dict(
        probs=[[0.5, 0.5]], top_k=1, tokens_per_step=1000, hidden_size=1000, bits_per_element=16,
        bandwidths=[1e9, 2e9], capacities=[1, 1], worker_nodes=["a", "b"], master_node="a",
    )
    return PlacementProblem(**{**fields, **overrides})


# --- cost model -------------------------------------------------------------------


def test_cost_model_matches_the_paper_formula_worked_by_hand():
    # Each row is b*H/8 = 16*1000/8 = 2000 bytes each way; forward + backward = 4 crossings
    # = 8000 bytes per row. Worker 0 serves P*K = 0.5*1000 = 500 rows -> 4e6 bytes at 1 GB/s
    # = 4 ms; worker 1 the same bytes at 2 GB/s = 2 ms. Step time = max = 4 ms.
    # Paper eq. 6 (forward only): b*H/(4*B) * P*K = 16*1000/(4e9) * 500 = 2 ms on worker 0.
    problem = two_worker_problem()
    placement = np.array([[0, 1]])
    np.testing.assert_allclose(layer_worker_times(problem, placement), [[4e-3], [2e-3]])
    assert step_time(problem, placement) == pytest.approx(4e-3)
    np.testing.assert_allclose(worker_bytes(problem, placement), [4e6, 4e6])
    # + compute: 500 rows at 2 us (worker 0) and 10 us (worker 1) of expert arithmetic per row.
    with_compute = two_worker_problem(compute_seconds_per_row=[2e-6, 10e-6])
    np.testing.assert_allclose(layer_worker_times(with_compute, placement), [[5e-3], [7e-3]])
    assert step_time(with_compute, placement) == pytest.approx(7e-3)
    forward_only = two_worker_problem(include_backward=False)
    assert step_time(forward_only, placement) == pytest.approx(2e-3)
    np.testing.assert_allclose(worker_bytes(forward_only, placement), [2e6, 2e6])


def test_cross_node_bytes_count_workers_off_the_master_node():
    problem = two_worker_problem()
    total, per_node = cross_node_bytes(problem, np.array([[0, 1]]))
    assert total == pytest.approx(4e6) and per_node == {"b": pytest.approx(4e6)}
    roomy = two_worker_problem(capacities=[2, 2])
    assert cross_node_bytes(roomy, np.array([[0, 0]])) == (0.0, {"b": 0.0})
    assert cross_node_bytes(roomy, np.array([[1, 1]]))[0] == pytest.approx(8e6)


def test_cross_node_bytes_need_master_node_only_when_asked_for():
    problem = two_worker_problem(master_node=None)  # valid on its own
    with pytest.raises(ValueError, match="master_node is not set"):
        cross_node_bytes(problem, np.array([[0, 1]]))
    assert cost_report(problem, np.array([[0, 1]])).cross_node_bytes is None


def test_cost_report_summarises_busy_share_and_bottlenecks():
    report = cost_report(two_worker_problem(), np.array([[0, 1]]))
    assert report.step_time == pytest.approx(4e-3)
    assert report.worker_experts == [1, 1]
    assert report.worker_busy_share == pytest.approx([1.0, 0.5])
    assert report.bottleneck_layers == [1, 0]
    assert report.cross_node_bytes_per_node == {"b": pytest.approx(4e6)}


def test_cost_model_rejects_placements_that_do_not_fit():
    problem = two_worker_problem()
    with pytest.raises(ValueError, match=r"shape \(1, 3\).*\[1, 2\]"):
        cost_report(problem, np.array([[0, 1, 1]]))
    with pytest.raises(ValueError, match="workers 0..1"):
        cost_report(problem, np.array([[0, 2]]))
    with pytest.raises(ValueError, match=r"puts 2 experts on worker 0, over its capacity 1 \(capacities\[0\]\)"):
        cost_report(problem, np.array([[0, 0]]))
    with pytest.raises(ValueError, match="integer worker ids"):
        cost_report(problem, np.array([[0.0, 1.0]]))


# --- validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"probs": [0.5, 0.5]}, r"probs must be a non-empty 2-D .* got shape \(2,\)"),
        ({"probs": [[0.5, float("nan")]]}, r"probs\[0, 1\] = nan"),
        ({"probs": [[0.5, float("inf")]]}, r"probs\[0, 1\] = inf"),
        ({"probs": [[1.5, -0.5]]}, r"probs\[0, 0\] = 1.5"),
        ({"probs": [[0.5, 0.5], [0.6, 0.6]]}, r"probs row 1 sums to 1.2, expected top_k=1"),
        ({"top_k": 3, "probs": [[1.0, 1.0]]}, r"top_k \(3\) exceeds num_experts \(2\)"),
        ({"bandwidths": [1e9, 0.0]}, r"bandwidths\[1\] = 0.0: worker 1 needs a positive"),
        ({"bandwidths": [-1.0, 1e9]}, r"bandwidths\[0\] = -1.0: worker 0"),
        ({"bandwidths": [1e9, float("nan")]}, r"bandwidths\[1\] = nan: worker 1"),
        ({"capacities": [-1, 3]}, r"capacities\[0\] = -1"),
        ({"capacities": [1, 1, 1]}, r"capacities has 3 entries but bandwidths has 2"),
        ({"worker_names": ["x"]}, r"worker_names has 1 entries but bandwidths has 2"),
        ({"worker_nodes": ["a", "b", "c"]}, r"worker_nodes has 3 entries but bandwidths has 2"),
        ({"capacities": [1, 0]}, r"capacities sum to 1 but 2 experts .* need 1 more expert slots"),
        ({"tokens_per_step": 0}, r"tokens_per_step must be a positive integer, got 0"),
        ({"hidden_size": -4}, r"hidden_size must be a positive integer, got -4"),
        ({"bits_per_element": 0}, r"bits_per_element must be a positive integer"),
        ({"top_k": 0}, r"top_k must be a positive integer"),
        ({"compute_seconds_per_row": [1e-6, -1e-6]}, r"compute_seconds_per_row\[1\] = -1e-06: give a finite time"),
        ({"compute_seconds_per_row": [1e-6]}, r"compute_seconds_per_row has 1 entries but bandwidths has 2"),
    ],
)
def test_invalid_problems_name_the_field_and_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        two_worker_problem(**overrides)


def test_a_misspelt_field_is_refused_by_name():
    """Checked on the error pydantic reports (field, value, error type), not on its wording."""
    with pytest.raises(ValidationError) as caught:
        two_worker_problem(bandwdiths=[1.0])
    [error] = caught.value.errors()
    assert (error["loc"], error["input"], error["type"]) == (("bandwdiths",), [1.0], "extra_forbidden")


def test_row_sums_within_relative_tolerance_are_accepted():
    problem = two_worker_problem(probs=[[0.5, 0.5 + 1e-8]])
    assert problem.num_layers == 1 and problem.num_experts == 2 and problem.num_workers == 2


def test_master_node_may_sit_on_a_node_without_workers():
    problem = two_worker_problem(master_node="head")
    total, per_node = cross_node_bytes(problem, np.array([[0, 1]]))
    assert total == pytest.approx(8e6) and set(per_node) == {"a", "b"}


def test_problem_is_frozen_and_probs_read_only():
    problem = two_worker_problem()
    with pytest.raises(ValueError):
        problem.top_k = 2
    with pytest.raises(ValueError):
        problem.probs[0, 0] = 0.9


def test_uniform_problem_has_tightest_capacity_by_default():
    problem = PlacementProblem.uniform(3, 4, 2, 5)
    assert problem.capacities == [3] * 5  # ceil(12 / 5)
    np.testing.assert_allclose(problem.probs, 0.5)


def test_build_problem_reports_one_plain_line_per_field():
    fields = dict(probs=[[1.0]], top_k=1, tokens_per_step=1, hidden_size=1, capacities=[1])
    with pytest.raises(ValueError, match=r"^invalid placement problem: bandwidths: bandwidths\[0\] = 0.0[^\n]*$"):
        build_problem(**fields, bandwidths=[0.0])
    with pytest.raises(ValueError, match=r"(?s)invalid placement problem:\n  top_k: .*\n  bandwidths: "):
        build_problem(**{**fields, "top_k": 0}, bandwidths=[0.0])


# --- synthetic profiles and io -------------------------------------------------------


def test_synthetic_probs_sum_to_top_k_and_cap_at_one():
    probs = synthetic_probs(20, 8, 3, concentration=0.05, seed=1)
    np.testing.assert_allclose(probs.sum(axis=1), 3)
    assert probs.max() <= 1.0 and probs.min() >= 0.0
    assert (probs == 1.0).any()  # steep enough that some expert is used by every token


def test_load_profile_reads_npy_list_probs_counts_and_access_profiles(tmp_path):
    probs = synthetic_probs(2, 4, 2, concentration=1.0, seed=0)
    np.save(tmp_path / "p.npy", probs)
    (tmp_path / "list.json").write_text(json.dumps(probs.tolist()))
    (tmp_path / "obj.json").write_text(json.dumps({"probs": probs.tolist(), "top_k": 2}))
    # counts: layer 0 routes 30 (token, expert) rows, so P = counts * 2 / 30
    (tmp_path / "counts.json").write_text(json.dumps({"counts": [[15, 10, 5, 0], [5, 5, 10, 10]], "top_k": 2}))
    # what AccessProfile.save writes (vela profile, a run's profile.json): 15 tokens, top-2
    access = {"counts": [[15, 10, 5, 0], [5, 5, 10, 10]], "top_k": 2, "tokens": 15, "source": "x",
              "scoring": "softmax", "probs": [[1.0, 2 / 3, 1 / 3, 0.0], [1 / 3, 1 / 3, 2 / 3, 2 / 3]]}
    (tmp_path / "access.json").write_text(json.dumps(access, indent=1))
    np.testing.assert_allclose(load_profile(tmp_path / "p.npy")[0], probs)
    np.testing.assert_allclose(load_profile(tmp_path / "list.json")[0], probs)
    assert load_profile(tmp_path / "obj.json")[1] == 2
    from_counts, top_k = load_profile(tmp_path / "counts.json")
    np.testing.assert_allclose(from_counts, [[1.0, 2 / 3, 1 / 3, 0.0], [1 / 3, 1 / 3, 2 / 3, 2 / 3]])
    assert top_k == 2
    from_access, top_k = load_profile(tmp_path / "access.json")
    np.testing.assert_allclose(from_access, from_counts)
    assert top_k == 2


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("p.csv", "1,2", r"must be a .npy or .json file, got '.csv'"),
        ("keys.json", {"weights": []}, r"got keys \['weights'\]"),
        ("number.json", 3, r"got a JSON int"),
        ("flat.json", [0.5, 0.5], r"probs must be a non-empty 2-D .* got shape \(2,\)"),
        ("ragged.json", [[0.5, 0.5], [1.0]], r"probs rows have different lengths \(2, 1\)"),
        ("words.json", [["a", "b"]], r"holds non-numbers"),
        ("nan.json", [[0.5, None]], r"probs\[0, 1\] = nan: every probability must be a finite number"),
        ("counts-as-probs.json", [[15, 5]], r"probs\[0, 0\] = 15.0: .*counts go in a JSON profile"),
        ("zero-layer.json", {"counts": [[1, 1], [0, 0]], "top_k": 1}, r"counts of layer 1 are all zero"),
        ("bad-k.json", {"counts": [[1, 1]], "top_k": "2"}, r'"top_k" must be a positive integer'),
        ("broken.json", '{"probs": [[0.5, 0.5]\n  "top_k": 1}', r"not valid JSON: Expecting ',' delimiter at line 2"),
        ("garbage.npy", b"\x93NUMPY garbage", r"not a readable .npy array: write .* numpy.save"),
        ("empty.npy", b"", r"not a readable .npy array"),
    ],
)
def test_load_profile_errors_are_one_line_naming_the_file_and_the_fix(tmp_path, name, content, message):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=message) as caught:
        load_profile(path)
    assert str(caught.value).startswith(f"profile {path}: ") and "\n" not in str(caught.value)


def test_load_profile_names_a_missing_file_and_a_one_dimensional_npy(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_profile(tmp_path / "missing.npy")
    np.save(tmp_path / "flat.npy", np.full(4, 0.5))
    with pytest.raises(ValueError, match=r"flat.npy: probs must be a non-empty 2-D .* got shape \(4,\)"):
        load_profile(tmp_path / "flat.npy")


def test_probs_from_counts_normalises_each_layer_and_rejects_bad_counts():
    np.testing.assert_allclose(probs_from_counts([[3, 1], [1, 1]], 1), [[0.75, 0.25], [0.5, 0.5]])
    with pytest.raises(ValueError, match=r"counts must be a non-empty 2-D .* got shape \(2,\)"):
        probs_from_counts([1, 1], 1)
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        probs_from_counts([[1, -1]], 1)


def test_infer_top_k_needs_whole_equal_row_sums():
    assert infer_top_k(np.array([[0.5, 0.5, 1.0], [1.0, 1.0, 0.0]])) == 2
    with pytest.raises(ValueError, match=r"cannot infer top_k: rows sum to 1..1.5"):
        infer_top_k(np.array([[0.5, 0.5], [1.0, 0.5]]))
    with pytest.raises(ValueError, match=r"^profile p.npy: cannot infer top_k"):
        infer_top_k(np.zeros((2, 2)), source="p.npy")


def test_parse_capacities_accepts_one_integer_or_a_list():
    assert parse_capacities("4", 3) == [4, 4, 4]
    assert parse_capacities("4,5,6", 3) == [4, 5, 6]
    with pytest.raises(ValueError, match="whole numbers"):
        parse_capacities("4.5", 2)


def test_problem_file_accepts_profile_path_gb_per_s_and_one_capacity(tmp_path):
    np.save(tmp_path / "profile.npy", np.full((2, 4), 0.5))
    (tmp_path / "problem.yaml").write_text(
        "profile: profile.npy\n"
        "tokens_per_step: 4096\nhidden_size: 4096\n"
        "bandwidths_gb_s: [18.3, 1.17]\ncapacities: 4\n"
        "worker_nodes: [a, b]\nmaster_node: a\n"
    )
    problem = PlacementProblem.from_file(tmp_path / "problem.yaml")
    assert problem.top_k == 2  # inferred from the row sums
    assert problem.bandwidths == [18.3e9, 1.17e9] and problem.capacities == [4, 4]
    (tmp_path / "typo.yaml").write_text("profile: profile.npy\ntokens: 1\n")
    typo = r"(?ms)typo.yaml: invalid placement problem:\n.*^  tokens: "  # the misspelt field, on its own line
    with pytest.raises(ValueError, match=typo):
        PlacementProblem.from_file(tmp_path / "typo.yaml")
    (tmp_path / "broken.yaml").write_text("profile: profile.npy\ncapacities: [4, 4\n")
    with pytest.raises(ValueError, match=r"broken.yaml is not valid YAML: .* at line 3"):
        PlacementProblem.from_file(tmp_path / "broken.yaml")
