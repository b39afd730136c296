"""benchmarks/overlap.py's numbers, from its stored raw runs: no training, no Ray."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import overlap  # noqa: E402

STORED = ROOT / "benchmarks" / "results" / "overlap" / "results.json"


def test_stored_runs_give_the_stored_numbers_with_the_machines_cpu():
    saved = json.loads(STORED.read_text())
    warmup = saved["settings"]["warmup_steps"]
    for model, by in saved["raw"].items():
        views = {setting: [overlap.run_view(run, warmup) for run in runs] for setting, runs in by.items()}
        again, stored = overlap.compare(views["serial"], views["overlapped"]), saved["comparison"][model]
        assert again.pop("bytes_per_step_by_tier") == stored.pop("bytes_per_step_by_tier")
        assert again == pytest.approx(stored)
        for view in views["serial"] + views["overlapped"]:
            assert 0 < view["machine_cpu_busy_fraction"] <= 1.05 and 0 < view["master_process_cores"] <= 1.05
            assert view["cpu_floor_step_s"] < view["median_step_time_s"]  # the cores were never saturated
    text = overlap.markdown(saved)
    assert "| model | cores busy serial / overlapped |" in text


def test_a_run_without_cpu_samples_reports_none():
    assert overlap.machine_cpu({"cpu": None}, {"startup_s": 1.0, "train_s": 2.0}, 0.1) == {
        "machine_cpu_busy_fraction": None, "cpu_seconds_per_step": None, "cpu_floor_step_s": None,
        "master_process_cores": None}
