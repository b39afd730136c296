"""Test-wide settings: one torch thread (CI has 2 cores) and quiet libraries."""

import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the `datasets` Arrow cache of the records files tests write: per run, not in the user's ~/.cache
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="vela-tests-datasets-"))
# One intra-op thread: every model here is debug-size, too small to split, and a second OpenMP thread only
# spin-waits at barriers on a shared 2-core machine (peft's 4 reference steps: 0.34 s on 1 thread, 7-8 s on 2
# with the machine busy). The Ray actors run on one too (Ray's OMP_NUM_THREADS=1); a test that wants more sets
# them itself.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for a module of tiny models (`pytestmark = pytest.mark.usefixtures(...)`): a
    second OpenMP thread only spin-waits at barriers on a shared 2-core machine, many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests need a CUDA device: skipped, saying so, where there is none (`make test-gpu` runs them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TESTS = Path(__file__).parent


class Background:
    """Commands run one after another at the lowest CPU priority on a thread of the test session, each's
    `CompletedProcess` a future: one-time work CI's Ray tests leave idle cores for (`pytest_collection_finish`)."""

    def __init__(self):
        self._runner = ThreadPoolExecutor(1, thread_name_prefix="vela-tests-background")
        self._running: subprocess.Popen | None = None
        self._stopped = False

    def submit(self, command: list[str], **popen) -> Future:
        return self._runner.submit(self._run, command, popen)

    def _run(self, command: list[str], popen: dict) -> subprocess.CompletedProcess:
        if self._stopped:
            raise RuntimeError("the test session ended first")
        self._running = subprocess.Popen(command, preexec_fn=lambda: os.nice(19), text=True, **popen)
        stdout, stderr = self._running.communicate()
        return subprocess.CompletedProcess(command, self._running.returncode, stdout, stderr)

    def stop(self) -> None:
        """Kill what runs (a tiny model build's staging dir goes at the next build), start nothing more."""
        self._stopped = True
        if self._running is not None and self._running.poll() is None:
            self._running.kill()
        self._runner.shutdown(wait=True, cancel_futures=True)


def pytest_collection_finish(session):
    """A run of Ray's tests and the unit tests (CI's) does two one-time jobs in the background, one thread at the
    lowest CPU priority, while the Ray tests (collected first) leave cores idle: it builds the tiny pre-trained model,
    whose first user among the unit tests waits for it if need be (`tiny_model_path` never builds what a live
    process is building), then runs the GPU battery's CPU form, whose test takes its result
    (`test_training_core_alone`). Otherwise each would run on the critical path, ~2.5 min and ~45 s of CI on 2
    cores."""
    from vela_ray.training.tiny_model import tiny_model_path

    parts = {item.path.relative_to(TESTS).parts[0] for item in session.items if TESTS in item.path.parents}
    if not {"ray", "unit"} <= parts:
        return
    background = session.config.background = Background()
    try:
        tiny_model_path(build=False)
    except ValueError:  # not built yet
        background.submit([str(Path(sys.executable).parent / "vela"), "build-tiny-model", "--threads", "1"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if any(item.name == BATTERY_TEST for item in session.items):
        from tests.unit.test_training_core_alone import battery_run

        command, popen, out = battery_run(Path(tempfile.mkdtemp(prefix="vela-tests-battery-")))
        session.config.battery_cpu_form = (background.submit(command, **popen), out)


BATTERY_TEST = "test_the_battery_s_cpu_form_runs_without_the_cluster_packages"


def pytest_sessionfinish(session):
    background = getattr(session.config, "background", None)
    if background is not None:
        background.stop()


# A skip of a `gpu` test that VELA_REQUIRE_GPU=1 still allows: the machine has a GPU, only fewer than the test needs.
TOO_FEW_GPUS = re.compile(r"needs \d+ GPUs")


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped report gives (`longrepr` is (path, line, "Skipped: reason") for a skip)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """With VELA_REQUIRE_GPU=1 (`make test-gpu`), a skipped `gpu` test is a failure: on a machine where CUDA
    is broken every GPU test would skip and the run would pass having tested nothing. Only a skip for too
    few GPUs (a multi-GPU test on a one-GPU machine) stays a skip."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and os.environ.get("VELA_REQUIRE_GPU") == "1" and "gpu" in item.keywords):
        return
    reason = skip_reason(report)
    if TOO_FEW_GPUS.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"VELA_REQUIRE_GPU=1: the gpu test {item.nodeid} was skipped: {reason} "
                       f"(torch {torch.__version__}, CUDA available: {torch.cuda.is_available()})")
