"""The run report: predicted vs measured communication, the HTML page, `vela report`, and the page in Chromium.

The run directory is fabricated from the placement cost model, so every
number the report derives has a known value: 4 MoE layers x 8 experts on 3
workers (worker 0 beside the master, workers 1-2 on another node).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from placement import PlacementProblem, step_time, synthetic_probs, worker_bytes
from vela_ray.cli import main
from vela_ray.observability.report import compare_comm, load_run, summary_text, write_report

CHROMIUM = Path("/usr/bin/chromium")
TIERS = ["same_node", "cross_node", "cross_node"]
STEPS = 12


def _problem() -> PlacementProblem:
    probs = synthetic_probs(4, 8, 2, concentration=0.5)  # skewed top-2 routing: rows sum to 2
    return PlacementProblem(probs=probs, top_k=2, tokens_per_step=256, hidden_size=64, bits_per_element=32,
                            bandwidths=[4e9, 1e9, 1e9], capacities=[16, 16, 16],
                            worker_nodes=["a", "b", "b"], master_node="a")


def _table() -> np.ndarray:
    return np.tile(np.arange(8) % 3, (4, 1))


def make_run_dir(run_dir: Path, profile: bool = True, config: bool = True) -> Path:
    """A finished run as the master writes it; per step each worker moves exactly the cost model's bytes."""
    problem, table = _problem(), _table()
    per_worker = worker_bytes(problem, table)  # bytes per step; measured == predicted here
    step_by_tier = {"same_process": 0, "same_node": int(per_worker[0]), "cross_node": int(per_worker[1:].sum())}
    history = [{"step": s, "loss": 3.0 - 0.1 * s, "step_time_s": 0.5 + 0.01 * s, "bytes_by_tier": step_by_tier,
                **({"eval_loss": 3.05 - 0.1 * s} if s % 4 == 0 else {})} for s in range(1, STEPS + 1)]
    summary = {
        "losses": [h["loss"] for h in history], "eval_loss": history[-1]["eval_loss"], "steps": STEPS,
        "median_step_time_s": 0.56, "traffic_bytes_by_tier": {k: v * STEPS for k, v in step_by_tier.items()},
        "traffic_bytes_by_worker": [int(b) * STEPS for b in per_worker], "worker_tiers": TIERS,
        "history": history,
        "placement": {"solver": "sequential", "expected_step_time_s": step_time(problem, table),
                      "lower_bound_s": None, "expert_to_worker": table.tolist()},
        "links": [{"latency_s": 1e-4, "bandwidth_bytes_per_s": b} for b in problem.bandwidths],
        "worker_nodes": ["a", "b", "b"], "master_node": "a", "timings_s": {"train_s": 7.0}, "adapter_dir": "x",
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    if profile:
        (run_dir / "profile.json").write_text(json.dumps({"probs": problem.probs.tolist(), "top_k": 2}))
    if config:
        (run_dir / "config.json").write_text(json.dumps({"model": {"path": "/models/tiny", "dtype": "float32"},
                                                         "training": {"steps": STEPS, "batch_size": 8}}))
    return run_dir


def test_predicted_bytes_per_worker_equal_the_cost_model_and_measured_the_run(tmp_path):
    run = load_run(make_run_dir(tmp_path / "run"))
    expected = worker_bytes(_problem(), _table())
    comms = compare_comm(run)
    assert [c.tier for c in comms] == TIERS and [c.experts for c in comms] == [12, 12, 8]
    np.testing.assert_allclose([c.predicted_bytes for c in comms], expected, rtol=1e-9)
    np.testing.assert_allclose([c.measured_bytes for c in comms], expected.astype(int), rtol=1e-9)
    assert comms[1].measured_link_s == pytest.approx(int(expected[1]) / 1e9)


def test_without_a_profile_nothing_is_predicted_and_the_page_says_why(tmp_path):
    run_dir = make_run_dir(tmp_path / "run", profile=False, config=False)
    assert all(c.predicted_bytes is None for c in compare_comm(load_run(run_dir)))
    page = write_report(run_dir).read_text()
    assert "No access profile" in page and "No <code>config.json</code>" in page
    assert 'data-chart="heatmap"' not in page and "n/a" in page


def test_report_is_self_contained_with_every_section(tmp_path):
    page = write_report(make_run_dir(tmp_path / "run")).read_text()
    for anchor in ("overview", "placement", "access", "traffic", "comm", "loss", "config"):
        assert f'<section id="{anchor}">' in page
    assert page.count("<svg") == 4  # heatmap, traffic, comm, loss
    assert page.count("<tr><th>layer ") == 4  # one placement-map row per MoE layer
    assert not re.search(r'(src|href)="(https?:)?//', page), "the page must not load anything from the network"
    assert "/models/tiny" in page  # the config section


def test_a_directory_without_summary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no summary.json.*finished `vela train` run"):
        write_report(tmp_path)


def test_summary_text_names_loss_placement_and_each_worker(tmp_path):
    text = summary_text(make_run_dir(tmp_path / "run"))
    assert "12 steps, loss 2.9000 -> 1.8000, eval loss 1.8500" in text
    assert "placement sequential" in text and "cross_node" in text
    assert len([line for line in text.splitlines() if line.startswith("  worker ")]) == 3


def test_vela_report_prints_the_summary_and_writes_the_page(tmp_path, capsys):
    run_dir = make_run_dir(tmp_path / "run")
    assert main(["report", str(run_dir), "--out", str(tmp_path / "r.html")]) == 0
    assert "report:" in capsys.readouterr().out and (tmp_path / "r.html").is_file()
    assert main(["report", str(tmp_path / "missing")]) == 2


# --- the page in a real browser ------------------------------------------------------------------------


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1280,2400"]
    return subprocess.run([str(CHROMIUM), *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not CHROMIUM.is_file(),
                    reason="needs Debian's chromium (/usr/bin/chromium): run scripts/ci_system_deps.sh")
def test_report_renders_in_headless_chromium_without_errors(tmp_path):
    page = write_report(make_run_dir(tmp_path / "run"))
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-rendered="4/4"' in dom.stdout, "every chart must be laid out with a non-zero size"
    assert 'id="js-error"' not in dom.stdout
    shot = tmp_path / "report.png"
    result = _chromium(tmp_path, f"--screenshot={shot}", page.as_uri())
    assert result.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 50_000  # a blank 1280x2400 page compresses to a few KB
