"""The run report: predicted vs measured communication, the HTML page, `vela report`, and the page in Chromium.

The run is a fabricated `RunSummary` whose placement carries its `PlacementProblem`, so
every number the report derives has a known value: 4 MoE layers x 8 experts on 3
workers (worker 0 beside the master, workers 1-2 on another node). Variants: a
placement that leaves worker 2 without experts, the `communication+compute` cost
model, a resumed run with only a profile file, and the expert-parallel baseline.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from placement import PlacementProblem, step_time, synthetic_probs, worker_bytes
from placement.cost import routing_mass
from vela_ray.cli import main
from vela_ray.observability.report import compare_comm, human_bytes, load_run, summary_text, tiers_text, write_report
from vela_ray.training.summary import LinkRecord, PlacementRecord, ResumeRecord, RunSummary, StepRecord
from vela_ray.training.tiers import TierCounters, TierSpeeds

CHROMIUM = Path("/usr/bin/chromium")
TIERS = ["same_node", "cross_node", "cross_node"]
STEPS = 12
SPREAD = np.tile(np.arange(8) % 3, (4, 1))  # [L, E] experts 0, 3, 6 on worker 0, ...
NOTHING_ON_2 = np.tile(np.arange(8) % 2, (4, 1))  # worker 2 holds no expert


def _problem(compute: bool = False) -> PlacementProblem:
    probs = synthetic_probs(4, 8, 2, concentration=0.5)  # skewed top-2 routing: rows sum to 2
    return PlacementProblem(probs=probs, top_k=2, tokens_per_step=256, hidden_size=64, bits_per_element=32,
                            bandwidths=[4e9, 1e9, 1e9], capacities=[16, 16, 16],
                            worker_nodes=["a", "b", "b"], master_node="a",
                            compute_seconds_per_row=[1e-5, 1e-5, 1e-5] if compute else None)


def _placement(table: np.ndarray, problem: PlacementProblem | None, cost_model: str) -> PlacementRecord:
    if problem is None:
        return PlacementRecord(solver="sequential", expert_to_worker=table.tolist(), cost_model=cost_model)
    return PlacementRecord(solver="sequential", expert_to_worker=table.tolist(), cost_model=cost_model,
                           expected_step_time_s=step_time(problem, table),
                           expected_comm_time_s=step_time(problem.communication_only(), table), problem=problem)


def make_summary(table: np.ndarray = SPREAD, solved: bool = True, compute: bool = False,
                 mode: str = "vela") -> RunSummary:
    """A finished run; per step each worker moves exactly the cost model's bytes."""
    problem = _problem(compute)
    per_worker = worker_bytes(problem, table)  # bytes per step; measured == predicted here
    step_by_tier = {"same_process": 0, "same_node": int(per_worker[0]), "cross_node": int(per_worker[1:].sum())}
    history = [StepRecord(step=s, loss=3.0 - 0.1 * s, step_time_s=0.5 + 0.01 * s, bytes_by_tier=step_by_tier,
                          eval_loss=3.05 - 0.1 * s if s % 4 == 0 else None) for s in range(1, STEPS + 1)]
    cost_model = "communication+compute" if compute else ("communication" if mode == "vela" else "none")
    return RunSummary(
        mode=mode, steps=STEPS, losses=[h.loss for h in history], eval_loss=history[-1].eval_loss,
        median_step_time_s=0.56, history=history,
        traffic_bytes_by_tier={k: v * STEPS for k, v in step_by_tier.items()},
        traffic_bytes_by_worker=[int(b) * STEPS for b in per_worker], worker_tiers=TIERS,
        worker_nodes=["a", "b", "b"], master_node="a",
        placement=_placement(table, problem if solved else None, cost_model),
        links=[LinkRecord(latency_s=1e-4, bandwidth_bytes_per_s=b) for b in problem.bandwidths] if solved else [],
        timings_s={"train_s": 7.0}, adapter_dir="/runs/x/adapter")


def make_run_dir(run_dir: Path, summary: RunSummary | None = None, profile: bool = False,
                 config: bool = True) -> Path:
    """A run directory as a run writes it (profile.json only when asked: a solved run carries P)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (summary or make_summary()).write(run_dir)
    if profile:
        (run_dir / "profile.json").write_text(json.dumps({"probs": _problem().probs.tolist(), "top_k": 2}))
    if config:
        (run_dir / "config.json").write_text(json.dumps({"model": {"path": "/models/tiny", "dtype": "float32"},
                                                         "training": {"steps": STEPS, "batch_size": 8}}))
    return run_dir


def _worker_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("  worker ")]


def test_predicted_bytes_per_worker_equal_the_cost_model_and_measured_the_run(tmp_path):
    run = load_run(make_run_dir(tmp_path / "run"))
    expected = worker_bytes(_problem(), SPREAD)
    comms = compare_comm(run)
    assert [c.tier for c in comms] == TIERS and [c.experts for c in comms] == [12, 12, 8]
    np.testing.assert_allclose([c.predicted_bytes for c in comms], expected, rtol=1e-9)
    np.testing.assert_allclose([c.measured_bytes for c in comms], expected.astype(int), rtol=1e-9)
    assert comms[1].measured_link_s == pytest.approx(int(expected[1]) / 1e9)
    assert run.profile_source == "the placement problem in summary.json"


def test_a_worker_without_experts_is_reported_with_zero_predicted_bytes(tmp_path):
    summary = make_summary(NOTHING_ON_2)
    assert routing_mass(summary.placement.problem.probs, NOTHING_ON_2, 3)[2].sum() == 0
    comms = compare_comm(load_run(summary))
    assert [c.experts for c in comms] == [16, 16, 0]
    assert comms[2].predicted_bytes == 0 and comms[2].measured_bytes == 0
    np.testing.assert_allclose([c.predicted_bytes for c in comms], worker_bytes(_problem(), NOTHING_ON_2))
    text = summary_text(summary)
    assert "  worker 2 (cross_node, 0 experts): 0.00 MiB/step predicted, 0.00 measured" in _worker_lines(text)
    page = write_report(make_run_dir(tmp_path / "run", summary)).read_text()
    assert page.count('title="layer 0, worker 2: 0% of the layer\'s routed rows">&ndash;</td>') == 1
    assert page.count("<svg") == 4


def test_a_compute_aware_placement_shows_communication_and_step_time_apart(tmp_path):
    summary = make_summary(compute=True)
    plan = summary.placement
    assert plan.expected_step_time_s > plan.expected_comm_time_s  # compute is part of the objective
    text = summary_text(summary)
    assert f"expected comm {plan.expected_comm_time_s * 1e3:.3f} ms/step" in text
    assert f"expected step (comm + compute) {plan.expected_step_time_s * 1e3:.3f} ms/step" in text
    page = write_report(make_run_dir(tmp_path / "run", summary)).read_text()
    assert f'<div class="k">expected comm</div><div class="v">{plan.expected_comm_time_s * 1e3:.3f} ms' in page
    assert '<div class="k">expected step (comm + compute)</div>' in page


def test_under_the_communication_model_only_communication_is_expected():
    text = summary_text(make_summary())
    assert "expected comm" in text and "compute" not in text


def test_a_run_without_a_solved_problem_reads_its_profile_file_and_predicts_nothing(tmp_path):
    run = load_run(make_run_dir(tmp_path / "run", make_summary(solved=False), profile=True))
    np.testing.assert_allclose(run.probs_LE, _problem().probs)
    assert run.profile_source == "profile.json"
    assert all(c.predicted_bytes is None for c in compare_comm(run))
    page = write_report(run.dir).read_text()
    assert 'data-chart="heatmap"' in page and "this run solved no placement problem" in page


def test_without_a_profile_nothing_is_predicted_and_the_page_says_why(tmp_path):
    run_dir = make_run_dir(tmp_path / "run", make_summary(solved=False), config=False)
    assert all(c.predicted_bytes is None for c in compare_comm(load_run(run_dir)))
    page = write_report(run_dir).read_text()
    assert "No access profile" in page and "No <code>config.json</code>" in page
    assert 'data-chart="heatmap"' not in page and "n/a" in page


def test_an_expert_parallel_summary_reports_without_placement_problem_links_or_profile(tmp_path):
    summary = make_summary(solved=False, mode="expert_parallel")
    summary = summary.model_copy(update={"eval_loss": None, "allreduce_bytes_per_step": 4096, "adapter_dir": None})
    text = summary_text(summary)
    assert text.startswith("expert-parallel baseline, 12 steps, loss 2.9000 -> 1.8000\n")
    assert "expected" not in text and "adapter:" not in text
    assert all("n/a MiB/step predicted" in line for line in _worker_lines(text)) and len(_worker_lines(text)) == 3
    page = write_report(make_run_dir(tmp_path / "run", summary, config=False)).read_text()
    assert "expert-parallel baseline" in page and "No access profile" in page
    assert page.count("<svg") == 3  # traffic, comm, loss


def test_report_is_self_contained_with_every_section(tmp_path):
    page = write_report(make_run_dir(tmp_path / "run")).read_text()
    for anchor in ("overview", "placement", "access", "traffic", "comm", "loss", "config"):
        assert f'<section id="{anchor}">' in page
    assert page.count("<svg") == 4  # heatmap, traffic, comm, loss
    assert page.count("<tr><th>layer ") == 4  # one placement-map row per MoE layer
    assert not re.search(r'(src|href)="(https?:)?//', page), "the page must not load anything from the network"
    assert "/models/tiny" in page  # the config section


def test_a_runner_reports_on_its_summary_before_writing_summary_json(tmp_path):
    run_dir = make_run_dir(tmp_path / "run")
    (run_dir / "summary.json").unlink()
    page = write_report(run_dir, summary=make_summary()).read_text()
    assert "/models/tiny" in page and page.count("<svg") == 4  # config.json read from run_dir


def test_a_directory_without_summary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no summary.json.*finished `vela train` run"):
        write_report(tmp_path)


def test_summary_text_names_loss_placement_each_worker_and_the_outputs(tmp_path):
    run_dir = make_run_dir(tmp_path / "run")
    text = summary_text(run_dir)
    assert text.startswith(f"run {run_dir}: 12 steps, loss 2.9000 -> 1.8000, eval loss 1.8500\n")
    assert "placement sequential" in text and "cross_node" in text
    assert len(_worker_lines(text)) == 3 and text.endswith("\nadapter: /runs/x/adapter")
    assert summary_text(RunSummary.load(run_dir)) == text.replace(f"run {run_dir}: ", "", 1)


def test_vela_report_prints_the_summary_and_writes_the_page(tmp_path, capsys):
    run_dir = make_run_dir(tmp_path / "run")
    assert main(["report", str(run_dir), "--out", str(tmp_path / "r.html")]) == 0
    assert "report:" in capsys.readouterr().out and (tmp_path / "r.html").is_file()
    assert main(["report", str(tmp_path / "missing")]) == 2



def test_a_moved_run_names_its_own_files_and_a_summary_written_before_loads_as_it_was(tmp_path, capsys):
    old, elsewhere = tmp_path / "run", str(tmp_path / "elsewhere" / "step-000004")
    summary = make_summary().model_copy(update={
        "adapter_dir": str(old / "adapter"), "report": str(old / "report.html"),
        "checkpoint": str(old / "checkpoints" / "step-000012"),
        "resumes": [ResumeRecord(step=4, checkpoint=elsewhere, resumed_at=0.0),
                    ResumeRecord(step=8, checkpoint="s3://bucket/run/checkpoints/step-000008", resumed_at=1.0)]})
    make_run_dir(old, summary)
    assert json.loads((old / "summary.json").read_text())["adapter_dir"] == "adapter"
    moved = old.rename(tmp_path / "run.old-1").resolve()  # as `--overwrite` moves a run aside
    loaded = RunSummary.load(moved)
    assert (loaded.adapter_dir, loaded.report, loaded.checkpoint) == (
        str(moved / "adapter"), str(moved / "report.html"), str(moved / "checkpoints" / "step-000012"))
    # a checkpoint outside the run dir, or on object storage, is named as it was
    assert [r.checkpoint for r in loaded.resumes] == [elsewhere, "s3://bucket/run/checkpoints/step-000008"]
    assert loaded.model_dump_json() == summary.model_copy(update={  # JSON: the problem holds numpy arrays
        "adapter_dir": loaded.adapter_dir, "report": loaded.report, "checkpoint": loaded.checkpoint}).model_dump_json()
    assert main(["report", str(moved)]) == 0
    text = capsys.readouterr().out
    assert text.endswith(f"\nadapter: {moved / 'adapter'}\nreport: {moved / 'report.html'}\ncheckpoint: "
                         f"{moved / 'checkpoints' / 'step-000012'}\nreport: {moved / 'report.html'}\n")
    assert f"{old}/" not in text

    before = tmp_path / "before"  # a summary.json as vela-ray wrote it before: absolute paths, kept as they are
    before.mkdir()
    (before / "summary.json").write_text(summary.model_dump_json(exclude={"paths_relative"}))
    assert RunSummary.load(before).model_dump_json() == summary.model_dump_json()

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


# --- APTMoE's expert tiers and the training method --------------------------------------------------------

MiB_100 = 100 * 2**20  # bytes of one expert upload in these runs


def _tiers() -> list[TierCounters]:
    """Worker 0 with a device (600 of its 800 rows there, 10 uploads, predictor 18/20); worker 2 without one."""
    gpu = TierSpeeds(cpu_s_per_row=2e-5, device_s_per_row=1e-7, upload_bytes_per_s=2.5e10, bytes_per_expert=MiB_100)
    cpu = TierSpeeds(cpu_s_per_row=4e-5, bytes_per_expert=MiB_100)
    return [TierCounters(worker=0, experts_cpu=30, experts_device=10, rows_cpu=200, rows_device=600, uploads=10,
                         upload_bytes=10 * MiB_100, cache_hits=5, predictions=20, predicted_overlap_sum=18.0,
                         speeds=gpu),
            TierCounters(worker=2, experts_cpu=12, rows_cpu=200, uploads=4, upload_bytes=4 * MiB_100, speeds=cpu)]


def test_a_zo_run_with_expert_tiers_shows_both_in_the_terminal_and_the_page(tmp_path, capsys):
    summary = make_summary().model_copy(update={"method": "zo", "expert_tiers": _tiers()})
    text = summary_text(summary)
    assert text.startswith("12 zeroth-order (ZO-SGD) steps, loss 2.9000 -> 1.8000")
    # 600 of 1000 rows on a device; 1400 MiB uploaded; 18 / 20 predicted demand
    tiers_line = "expert tiers: 60% of expert rows on device, 14 uploads (1.4 GiB), predictor accuracy 0.90"
    assert tiers_line in text.splitlines() and tiers_text(summary) == tiers_line

    run_dir = make_run_dir(tmp_path / "run", summary)
    page = write_report(run_dir).read_text()
    assert '<section id="tiers"><h2>Expert tiers (APTMoE)</h2>' in page
    assert ('<div class="k">method</div><div class="v">zeroth-order (ZO-SGD)<br><small>two forwards per step, '
            "no backward traffic</small></div>") in page
    assert f'<p class="tiers">{tiers_line}</p>' in page
    table = page[page.index('<table class="tiers">'):]
    table = table[:table.index("</table>")]
    rows = re.findall(r"<tr>(<td>.*?)</tr>", table)
    cells = [re.findall(r"<td>(.*?)</td>", row) for row in rows]
    # worker, link tier, computations CPU/device, rows CPU/device, device share, uploads, bytes, hits,
    # predictor, us/row CPU/device, upload GB/s
    assert cells == [
        ["w0", "same_node", "30", "10", "200", "600", "75.0%", "10", "1000.0 MiB", "5", "0.900", "20", "0.1", "25.00"],
        ["w2", "cross_node", "12", "0", "200", "0", "0.0%", "4", "400.0 MiB", "0", "n/a", "40", "n/a", "n/a"],
        ["all", "", "42", "10", "400", "600", "60.0%", "14", "1.4 GiB", "5", "0.900", "n/a", "n/a", "n/a"],
    ]

    assert main(["report", str(run_dir), "--out", str(tmp_path / "r.html")]) == 0  # `vela report` prints it
    assert tiers_line in capsys.readouterr().out.splitlines()


def test_without_tiers_the_section_and_line_are_absent_and_first_order_is_named(tmp_path):
    summary = make_summary()
    assert tiers_text(summary) == "" and "expert tiers" not in summary_text(summary)
    assert "zeroth-order" not in summary_text(summary)
    page = write_report(make_run_dir(tmp_path / "run", summary)).read_text()
    assert '<section id="tiers">' not in page and "APTMoE" not in page and 'class="tiers"' not in page
    assert '<div class="k">method</div><div class="v">first-order<br><small>backward + AdamW</small></div>' in page


def test_the_tier_note_names_the_cache_size_and_a_lossy_upload_format(tmp_path):
    summary = make_summary().model_copy(update={"expert_tiers": _tiers()[:1]})
    run_dir = make_run_dir(tmp_path / "run", summary)
    (run_dir / "config.json").write_text(json.dumps(
        {"expert_tiers": {"enabled": True, "cache_experts": 6, "upload_format": "float8"}}))
    page = write_report(run_dir).read_text()
    assert "a device cache of at most 6 experts" in page and "float8 (LOSSY" in page
    assert "<td>all</td>" not in page  # one tiered worker: no total row


def test_human_bytes_uses_binary_units():
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536 * 2**20, 3 * 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 GiB", "3.0 TiB"]
