"""What every benchmark script shares: its command line, logging, results file, tiny job and worker killer.

A script imports it as `benchmarks._harness`, with the repository root on `sys.path` (run as
`python benchmarks/<script>.py`, Python puts only benchmarks/ there, so each script adds the root
first; the tests import from the root already):

    p = parser(__doc__, RESULTS)                    # --out, plus the script's own options
    args = p.parse_args(argv)
    write_results(args.out, {"command": command(__file__, argv), "settings": vars(args), ...})
    ...
    if __name__ == "__main__":
        run(main)                                   # logging set up once, main's return the exit status

`tiny_job` is the job dict the CPU benchmarks start from (the demo's model and data), `alpaca_mix` the
Alpaca-format data set the paper's benchmarks share; `kill_when`
SIGKILLs an ExpertManager or master of a running job (the checkpoint tests use it too).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, NoReturn, Sequence

import numpy as np

from vela_ray.paths import data_dir

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = data_dir() / "tinyshakespeare" / "input.txt"
WIKITEXT = data_dir() / "wikitext-2" / "valid.txt"
ALPACA_MIX = Path(tempfile.gettempdir()) / "vela-paper-alpaca-seed-gsm8k.json"  # `alpaca_mix`
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
KILL_TIMEOUT_S = 900  # kill_when gives up after this long: a job that never gets ready must not hang a run


def parser(doc: str, out: Path | str | None = None, *, flag: str = "--out",
           what: str = "results JSON", **kwargs) -> argparse.ArgumentParser:
    """The script's argument parser: the first line of its docstring as description, and `flag` for where
    its results go (default `out`; None: written only where given)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0], **kwargs)
    p.add_argument(flag, type=Path, default=out, help=what)
    return p


def command(script: str | Path, argv: Sequence[str] | None = None) -> str:
    """The command line that reruns this run, as results files record it: `python benchmarks/<script>.py`
    and the arguments (`argv`, as a test passes them to `main`, else this process's)."""
    path = Path(script).resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return shlex.join(["python", str(shown), *(sys.argv[1:] if argv is None else argv)])


def write_results(path: Path | str | None, payload: dict, markdown: str | None = None) -> str:
    """Write `payload` as JSON to `path` (and `markdown` beside it as .md, both without this machine's directories);
    returns the JSON text.

    Through a .tmp and a rename, so a crash or kill mid-write leaves the previous complete file (scripts
    that write after every setup rely on it). Paths and other non-JSON values are written as strings, without
    this machine's directories (`without_machine_paths`). `path` None: nothing is written (a script whose results
    file is optional)."""
    text = without_machine_paths(json.dumps(payload, indent=1, default=str))
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, path)
        if markdown is not None:
            path.with_suffix(".md").write_text(without_machine_paths(markdown) + "\n")
    return text


def without_machine_paths(text: str) -> str:
    """`text` with this machine's directories named as the project names them: the data sets' as $VELA_DATA_DIR,
    the cache's as $VELA_CACHE_DIR, the repository's relative to it, temporary ones as $TMPDIR (a results file
    committed from one machine reads the same on any other)."""
    from vela_ray.paths import cache_dir

    named = {str(data_dir()): "$VELA_DATA_DIR", str(cache_dir()): "$VELA_CACHE_DIR", str(ROOT) + "/": "",
             str(ROOT): ".", tempfile.gettempdir().rstrip("/"): "$TMPDIR"}
    for directory, name in sorted(named.items(), key=lambda item: -len(item[0])):  # the longest first
        text = text.replace(directory, name)
    return text


def run(main: Callable[[], int | None], level: int = logging.INFO, quiet: Sequence[str] = ()) -> NoReturn:
    """Run a script's `main` as the program: logging set up here once (`quiet` loggers at WARNING, e.g.
    "vela_ray" for one line per run instead of one per step), `main`'s return value the exit status."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
    sys.exit(main())


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB, e.g. VmRSS (resident set) or VmHWM (its high-water mark)."""
    import re

    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def reset_peak() -> None:
    """Reset VmHWM (the resident-set high-water mark) to the current resident set (Linux >= 4.0). Run the
    measured process with MALLOC_MMAP_THRESHOLD_=65536 (`MEASURED_ENV`) so freed tensors go back to the OS
    and do not mask the next peak."""
    Path("/proc/self/clear_refs").write_text("5")


MEASURED_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


class Sampler:
    """`sample()` every `interval_s` on a daemon thread while the `with` block runs (and once more as it ends):
    the scaffold of the benchmarks' background measurements (peak memory, CPU time)."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=type(self).__name__)

    def sample(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def benchmark_device(name: str, script: str):
    """The torch device a GPU benchmark runs on (`--device cuda|cpu`); None, after one line on stderr saying
    why and what to do, where CUDA is asked for and absent (the script then exits 2: it measured nothing)."""
    import torch

    if name != "cuda":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    print(f"{script}: no CUDA device (torch {torch.__version__} sees none); run it on a machine with a working "
          f"CUDA GPU, or pass `--device cpu` (`python benchmarks/{script}.py --device cpu --tiny`: a smoke run)",
          file=sys.stderr)
    return None


def alpaca_mix(path: Path = ALPACA_MIX, limit: int = 1500, seed: int = 0) -> Path:
    """Write the Alpaca-format mix (idempotent): every Alpaca seed task (its first instance as input/output)
    and GSM8K's Alpaca records up to `limit` in all, shuffled with `seed`. Here because two scripts read it:
    `vela_vs_ep.py --paper` fine-tunes on it and `paper_scale.py --routing real32` profiles it."""
    instruct = data_dir() / "instruct"
    seeds = []
    for line in (instruct / "alpaca_seed_tasks.jsonl").read_text().splitlines():
        if line.strip():
            task = json.loads(line)
            first = task["instances"][0]
            seeds.append({"instruction": task["instruction"], "input": first.get("input", ""),
                          "output": first["output"]})
    gsm8k = json.loads((instruct / "gsm8k_alpaca.json").read_text())
    records = seeds + gsm8k[:max(0, limit - len(seeds))]
    np.random.default_rng(seed).shuffle(records)
    text = json.dumps(records)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


def tiny_job(out_dir: Path | str, model_dir: Path | str | None = None, **sections: dict | None) -> dict:
    """A job dict on the cached tiny pre-trained Mixtral (`vela build-tiny-model`; or the model at
    `model_dir`) and Tiny Shakespeare, as vela_ray.demo's job, over 3 ExpertManagers with a fixed placement
    (sequential table, uniform profile: runs compared side by side do the same work per step, whatever a
    noisy probe measured).

    Each keyword is a section merged over these (`data={"seq_len": 32}`); None drops the section, so the
    job takes vela-ray's default (`placement=None`: solved on a measured profile)."""
    if model_dir is None:
        # here, not at the top: scripts that only drive others (an emulated cluster's outer driver) start
        # without torch and transformers
        from vela_ray.training.tiny_model import tiny_model_path

        model_dir = tiny_model_path()
    job = {
        "model": {"path": str(model_dir)},
        "data": {"kind": "text", "path": str(SHAKESPEARE)},
        "cluster": {"num_workers": 3},
        "placement": {"solver": "sequential", "profile": "uniform"},
        "output": {"dir": str(out_dir)},
    }
    for name, values in sections.items():
        if values is None:
            job.pop(name, None)
        else:
            job[name] = {**job.get(name, {}), **values}
    return job


def kill_when(out_dir: Path, ready: Callable[[], bool], delay_s: float = 0.0,
              victim: str = "pids") -> tuple[threading.Thread, dict]:
    """A thread that SIGKILLs worker 1 of a running job once `ready()`, after `delay_s`: ExpertManager 1,
    or with `victim="master_pids"` master 1, its pid read from `out_dir/workers.json` (the runner writes
    it). The dict it returns gets the pid and the kill's time, `time.monotonic()` at "at" and `time.time()`
    at "wall" (to compare with times a job reports)."""
    killed: dict = {}
    workers = Path(out_dir) / "workers.json"

    def kill() -> None:
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while time.monotonic() < deadline:
            if workers.is_file() and ready():
                time.sleep(delay_s)
                pid = json.loads(workers.read_text())[victim][1]
                os.kill(pid, signal.SIGKILL)
                killed["pid"], killed["at"], killed["wall"] = pid, time.monotonic(), time.time()
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer, killed
