"""`vela place` end to end in a subprocess, and the no-torch guarantee of the placement path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from placement import Placement, PlacementProblem, synthetic_probs

VELA = Path(sys.executable).with_name("vela")
MIXTRAL_FLAGS = [
    "--bandwidths", "18.3,18.3,1.17,1.17,1.17,1.17", "--capacities", "43",
    "--nodes", "n0,n0,n1,n1,n2,n2", "--master-node", "n0", "--tokens", "4096", "--hidden", "4096",
]


def run_vela(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(VELA), *args], capture_output=True, text=True, timeout=120)


def test_place_writes_a_placement_that_loads_for_the_same_problem(tmp_path):
    probs = synthetic_probs(32, 8, 2, concentration=2.0, seed=0)
    (tmp_path / "profile.json").write_text(json.dumps(probs.tolist()))
    out = tmp_path / "placement.json"
    result = run_vela("place", "--profile", str(tmp_path / "profile.json"), *MIXTRAL_FLAGS,
                      "--time-budget", "0.5", "--out", str(out))
    assert result.returncode == 0, result.stderr
    problem = PlacementProblem(probs=probs, top_k=2, tokens_per_step=4096, hidden_size=4096,
                               bandwidths=[18.3e9] * 2 + [1.17e9] * 4, capacities=[43] * 6)
    placement = Placement.from_json(out, problem)
    assert placement.solver == "improved" and placement.lower_bound > 0
    for line in ("expected communication time per step", "LP lower bound", "cross-node bytes per step"):
        assert line in result.stdout
    assert result.stdout.count("GB/s") == 6  # one row per worker


def test_place_reads_a_problem_file_and_runs_any_solver(tmp_path):
    np.save(tmp_path / "profile.npy", synthetic_probs(4, 6, 2, concentration=1.0, seed=1))
    (tmp_path / "problem.yaml").write_text(
        "profile: profile.npy\ntokens_per_step: 1024\nhidden_size: 512\n"
        "bandwidths_gb_s: [10, 1, 1]\ncapacities: 8\n"
    )
    result = run_vela("place", "--problem", str(tmp_path / "problem.yaml"), "--solver", "sequential",
                      "--out", str(tmp_path / "p.json"))
    assert result.returncode == 0, result.stderr
    assert Placement.from_json(tmp_path / "p.json").solver == "sequential"
    assert "LP lower bound" in result.stdout  # computed separately for non-LP solvers


def test_place_rejects_bad_input_naming_the_field(tmp_path):
    np.save(tmp_path / "profile.npy", np.full((2, 4), 0.5))
    bad_bandwidth = run_vela("place", "--profile", str(tmp_path / "profile.npy"), "--bandwidths", "10,0",
                             "--capacities", "4", "--tokens", "8", "--hidden", "8")
    assert bad_bandwidth.returncode != 0
    assert "bandwidths[1] = 0.0" in bad_bandwidth.stderr and "Traceback" not in bad_bandwidth.stderr
    too_small = run_vela("place", "--profile", str(tmp_path / "profile.npy"), "--bandwidths", "10,1",
                         "--capacities", "3", "--tokens", "8", "--hidden", "8", "--solver", "vela")
    assert too_small.returncode != 0 and "need 2 more expert slots" in too_small.stderr
    no_tokens = run_vela("place", "--profile", str(tmp_path / "profile.npy"), "--bandwidths", "10,1",
                         "--capacities", "4", "--hidden", "8")
    assert no_tokens.returncode != 0 and "--tokens is required" in no_tokens.stderr


def test_placement_and_vela_place_do_not_import_torch(tmp_path):
    np.save(tmp_path / "profile.npy", np.full((2, 4), 0.5))
    script = (
        "import sys\n"
        "import placement\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'import placement'\n"
        "from vela_ray.cli import main\n"
        f"code = main(['place', '--profile', {str(tmp_path / 'profile.npy')!r}, '--bandwidths', '10,1',\n"
        "             '--capacities', '4', '--tokens', '8', '--hidden', '8', '--time-budget', '0.2'])\n"
        "assert code == 0\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'vela place'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
