"""`vela place` end to end in a subprocess, and the no-torch guarantee of the placement path."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from placement import Placement, PlacementProblem, synthetic_probs
from vela_ray.cli import main

VELA = Path(sys.executable).with_name("vela")
README = Path(__file__).resolve().parents[2] / "README.md"
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
    assert "note:" not in result.stdout  # sizes given: nothing assumed
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


def test_readme_example_runs_without_tokens_and_hidden_and_says_what_it_assumed(tmp_path, capsys):
    line = next(line for line in README.read_text().splitlines() if line.startswith("vela place "))
    args = shlex.split(line)[1:]
    args[args.index("P.npy")] = str(tmp_path / "P.npy")
    args[args.index("placement.json")] = str(tmp_path / "placement.json")
    np.save(tmp_path / "P.npy", synthetic_probs(32, 8, 2, concentration=2.0, seed=0))  # Mixtral: 32 x 8, top-2
    assert main([*args, "--time-budget", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("note: times and bytes below assume --tokens 4096 and --hidden 4096 (not given)")
    problem = PlacementProblem(probs=np.load(tmp_path / "P.npy"), top_k=2, tokens_per_step=4096, hidden_size=4096,
                               bandwidths=[18.3e9] * 2 + [1.17e9] * 4, capacities=[43] * 6)
    Placement.from_json(tmp_path / "placement.json", problem)


def _write(path: Path, content: object) -> None:
    if isinstance(content, np.ndarray):
        np.save(path, content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))


GOOD = np.full((2, 4), 0.5)
BAD_INPUTS = {
    # case: (profile file name, its content (None: no file), --out relative to tmp_path or None)
    "nan profile without --top-k": ("nan.npy", np.array([[0.5, np.nan], [0.5, 0.5]]), None),
    "1-D profile": ("flat.npy", np.full(4, 0.5), None),
    "ragged json": ("ragged.json", [[0.5, 0.5], [1.0]], None),
    "malformed json": ("broken.json", '[[0.5, 0.5],\n [0.5 0.5]]', None),
    "garbage npy": ("garbage.npy", b"\x00\x01 not numpy at all", None),
    "missing profile": ("never-written.npy", None, None),
    "out in a missing directory": ("p.npy", GOOD, "no/such/dir/placement.json"),
    "out under a file": ("p.npy", GOOD, "p.npy/placement.json"),
    "out is a directory": ("p.npy", GOOD, "outdir"),
    "out not writable": ("p.npy", GOOD, "readonly/placement.json"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_place_reports_bad_files_in_one_line_naming_the_file_and_writes_nothing(tmp_path, capsys, case):
    name, content, out = BAD_INPUTS[case]
    if content is not None:
        _write(tmp_path / name, content)
    (tmp_path / "outdir").mkdir()
    (tmp_path / "readonly").mkdir(mode=0o555)
    if case == "out not writable" and os.access(tmp_path / "readonly", os.W_OK):
        pytest.skip("running as root: permissions do not stop writes")
    before = sorted(tmp_path.rglob("*"))
    named = str(tmp_path / (out or name))
    args = ["place", "--profile", str(tmp_path / name), "--bandwidths", "10,1", "--capacities", "4",
            "--time-budget", "0.2", *(["--out", named] if out else [])]
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("vela place: error: "), captured.err
    assert named in lines[0], lines[0]
    assert captured.out == ""  # failed before solving: no solution printed
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_that_not_even_root_can_write_fails_before_solving(tmp_path, capsys):
    """os.access says yes to root everywhere; a probe file finds out (here: /proc takes no new files)."""
    _write(tmp_path / "p.npy", GOOD)
    args = ["place", "--profile", str(tmp_path / "p.npy"), "--bandwidths", "10,1", "--capacities", "4",
            "--out", "/proc/vela-placement.json"]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--out '/proc/vela-placement.json' cannot be written" in captured.err


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


def test_place_with_a_shared_nic_puts_more_rows_behind_the_masters_node(tmp_path, capsys):
    """`--nic`: cross-node rows share the master node's NIC, so the placement keeps more mass at home."""
    probs = synthetic_probs(8, 8, 2, concentration=2.0, seed=3)
    np.save(tmp_path / "profile.npy", probs)
    flags = ["place", "--profile", str(tmp_path / "profile.npy"), *MIXTRAL_FLAGS, "--capacities", "16",
             "--time-budget", "0.5"]
    assert main([*flags, "--out", str(tmp_path / "blind.json")]) == 0
    assert main([*flags, "--nic", "1.17", "--out", str(tmp_path / "aware.json")]) == 0
    assert "nic:n0" in capsys.readouterr().out  # the summary prints each shared link

    def home_mass(path: Path) -> float:
        table = Placement.from_json(path).as_array()
        return float(probs[np.isin(table, [0, 1])].sum())

    assert home_mass(tmp_path / "aware.json") > home_mass(tmp_path / "blind.json")
    assert main(["place", "--profile", str(tmp_path / "profile.npy"), "--bandwidths", "1,1", "--capacities", "40",
                 "--nic", "1"]) != 0  # --nic without nodes: one line naming what is missing
    assert "--nic needs --nodes and --master-node" in capsys.readouterr().err
