"""scripts/setup.sh's choice of torch (issue 33): on a GPU node the CUDA build its driver runs, a venv's torch
that cannot use the GPU replaced, and torch.cuda.is_available() checked after installing; on a CPU machine
exactly what it did before. Nothing is installed: a fake `nvidia-smi` prints a driver's header, and a fake
venv python answers the script's torch probes from a state file and logs its pip commands (a pip install
from a PyTorch CUDA index "installs" the build the test names).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"
INDEX = "https://download.pytorch.org/whl"

HEADER = """Tue Nov 25 15:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.86.15              Driver Version: 570.86.15      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
"""

FAKE_PYTHON = """#!/usr/bin/env bash
# a venv's python: torch's state is "VERSION CUDA AVAILABLE" in $FAKE_STATE (absent: no torch)
echo "python $*" >> "$FAKE_LOG"
if [ "$1" = -c ]; then
  [ -f "$FAKE_STATE" ] || exit 1
  read -r version cuda available < "$FAKE_STATE"
  case "$2" in
    *is_available*) [ "$available" = True ]; exit ;;
    *print*) echo "$version CUDA $cuda" ;;
  esac
  exit 0
fi
if [ "$1 $2 $3" = "-m pip install" ] && [[ "$*" == *torch* ]]; then
  case "$*" in
    *download.pytorch.org/whl/cu*) echo "$FAKE_INSTALLS" > "$FAKE_STATE" ;;
    *) echo "2.13.0+cpu none False" > "$FAKE_STATE" ;;
  esac
fi
"""


def fake_bin(tmp_path: Path, cuda: str | None) -> Path:
    """A folder with an `nvidia-smi` whose header says `cuda` (None: one that fails, as on a machine without
    a GPU or a working driver) and a node python without torch."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    smi = folder / "nvidia-smi"
    if cuda is None:
        smi.write_text("#!/usr/bin/env bash\nexit 9\n")
    else:
        (tmp_path / "header.txt").write_text(HEADER.format(cuda=cuda))
        smi.write_text(f'#!/usr/bin/env bash\nif [ "${{1:-}}" = -L ]; then echo "GPU 0: NVIDIA H100 80GB HBM3"; '
                       f'else cat "{tmp_path / "header.txt"}"; fi\n')
    node_python = folder / "node-python"
    node_python.write_text("#!/usr/bin/env bash\nexit 1\n")  # the node's python has no torch
    for path in (smi, node_python):
        path.chmod(0o755)
    return folder


def run_setup(tmp_path: Path, cuda: str | None, *args: str, state: str | None = None, installs: str = "",
              stamp: bool = False, **env: str) -> subprocess.CompletedProcess:
    """scripts/setup.sh with the fakes; a venv in tmp_path whose torch is `state` ("VERSION CUDA AVAILABLE")."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    if state is not None:
        (tmp_path / "state").write_text(state + "\n")
    if stamp:
        (venv / ".vela-installed").touch()
    folder = fake_bin(tmp_path, cuda)
    environment = {"PATH": f"{folder}:{os.environ['PATH']}", "HOME": str(tmp_path), "VELA_VENV": str(venv),
                   "PYTHON": str(folder / "node-python"), "FAKE_STATE": str(tmp_path / "state"),
                   "FAKE_LOG": str(tmp_path / "log"), "FAKE_INSTALLS": installs, **env}
    return subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True, env=environment, timeout=60)


def pip_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "log"
    return [line for line in log.read_text().splitlines() if " pip " in line] if log.exists() else []


@pytest.mark.parametrize("cuda, build", [
    ("13.2", "cu130"), ("13.0", "cu130"), ("12.9", "cu128"), ("12.8", "cu128"), ("12.7", "cu126"),
    ("12.6", "cu126"), ("12.5", "cu124"), ("12.4", "cu124"), ("12.2", "cu118"), ("11.8", "cu118"),
])
def test_the_drivers_cuda_version_picks_the_newest_torch_build_it_runs(tmp_path, cuda, build):
    result = run_setup(tmp_path, cuda, "--torch-plan")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"cuda {cuda} {INDEX}/{build}\n"
    assert not (tmp_path / "log").exists()  # a plan only: nothing ran in the venv


def test_without_a_working_nvidia_smi_the_pinned_cpu_torch_is_chosen(tmp_path):
    pinned = next(line.split("==")[1] for line in (ROOT / "constraints.txt").read_text().splitlines()
                  if line.startswith("torch=="))
    assert run_setup(tmp_path, None, "--torch-plan").stdout == f"cpu torch=={pinned}\n"
    assert run_setup(tmp_path, "12.8", "--torch-plan", VELA_DEVICE="cpu").stdout == f"cpu torch=={pinned}\n"


def test_a_driver_older_than_every_build_fails_in_one_line(tmp_path):
    result = run_setup(tmp_path, "11.4", "--torch-plan")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "CUDA 11.4" in result.stderr and "update the driver" in result.stderr


def test_a_cpu_torch_in_an_existing_venv_on_a_gpu_node_is_replaced_even_when_installed_before(tmp_path):
    result = run_setup(tmp_path, "12.8", state="2.13.0+cpu none False", installs="2.9.1+cu128 12.8 True",
                       stamp=True)
    assert result.returncode == 0, result.stderr
    assert "cannot use this node's GPU" in result.stdout
    calls = pip_calls(tmp_path)
    assert calls[0] == f"python -m pip install -q --force-reinstall --index-url {INDEX}/cu128 torch>=2.6"
    assert "-e .[dev]" in calls[1] and len(calls) == 2  # then vela-ray, its pins less torch's
    pins = (tmp_path / "venv" / "constraints.txt").read_text()
    assert "torch==" not in pins and "transformers==" in pins


def test_a_gpu_node_without_torch_installs_the_drivers_build(tmp_path):
    result = run_setup(tmp_path, "13.0", installs="2.12.0+cu130 13.0 True")
    assert result.returncode == 0, result.stderr
    assert f"installing torch>=2.6 from {INDEX}/cu130" in result.stdout
    assert pip_calls(tmp_path)[0] == f"python -m pip install -q --index-url {INDEX}/cu130 torch>=2.6"


def test_a_torch_that_still_sees_no_gpu_after_installing_fails_in_one_line(tmp_path):
    result = run_setup(tmp_path, "12.8", state="2.13.0+cpu none False", installs="2.9.1+cu128 12.8 False")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "torch.cuda.is_available() == False" in result.stderr
    assert "driver CUDA 12.8" in result.stderr and "VELA_TORCH_INDEX" in result.stderr
    assert not (tmp_path / "venv" / ".vela-installed").exists()


def test_a_cuda_torch_that_sees_the_gpu_is_kept(tmp_path):
    result = run_setup(tmp_path, "12.8", state="2.9.1+cu126 12.6 True")
    assert result.returncode == 0, result.stderr
    assert [call for call in pip_calls(tmp_path) if "torch" in call.split()[-1]] == []  # only -e .[dev]
    assert run_setup(tmp_path, "12.8", state="2.9.1+cu126 12.6 True", stamp=True).stdout == ""  # up to date


def test_a_cpu_machine_behaves_as_before(tmp_path):
    """No GPU: the pinned CPU torch from the default index, all of constraints.txt, no CUDA check; an
    up-to-date venv is left alone."""
    result = run_setup(tmp_path, None)
    assert result.returncode == 0, result.stderr
    calls = pip_calls(tmp_path)
    assert calls[0] == "python -m pip install -q torch==2.13.0"
    assert "-e .[dev]" in calls[1] and "torch==" in (tmp_path / "venv" / "constraints.txt").read_text()
    assert not any("is_available" in line for line in (tmp_path / "log").read_text().splitlines())
    (tmp_path / "log").unlink()
    assert run_setup(tmp_path, None, stamp=True).returncode == 0 and not (tmp_path / "log").exists()
