"""One command that says whether a GPU machine trains (`make gpu-check`), and one JSON that shows it.

The parts, in order, each a subprocess with its own timeout (they add up to 24 minutes):

    env             torch and CUDA versions, the device's name and capability, NCCL's version, and a bf16
                    `torch._grouped_mm` forward + backward with an empty group against per-group matmuls
                    (what the experts run); a check that cannot run here is recorded as skipped, with why
    tests           `pytest tests -m gpu` with VELA_REQUIRE_GPU=1: a skipped gpu test fails (tests/conftest.py)
    gpu_step        `benchmarks/gpu_step.py --setups peft vela_gpu`
    big_on_one_gpu  `benchmarks/big_on_one_gpu.py --layers 2 --setups vela_tiers vela_zo` under a 4 GiB budget
                    with 8 of the 16 experts cached, so the tiers upload and compute on both sides

Each part's outcome (ok / failed, a one-line reason, seconds) goes into benchmarks/results/gpu_check.json,
rewritten after every part; a benchmark part fails on a non-zero exit or on any setup its JSON records as
an error. The exit status is 1 if any part failed, 2 without CUDA (unless `--allow-cpu`): a check that
passes on a machine that tested nothing would hide a broken GPU. The env probe runs first in any case (in a
subprocess, so a hanging driver times out instead of hanging the check) and decides whether there is CUDA.

    python scripts/gpu_check.py                          # everything (a CUDA machine)
    python scripts/gpu_check.py --only env tests         # some parts
    python scripts/gpu_check.py --only env --allow-cpu   # this machine's environment, CUDA or not
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = RESULTS / "gpu_check.json"


@dataclass(frozen=True)
class Part:
    """A part of the check: its command (run from the repository root) and how long it may take."""

    name: str
    command: list[str]
    timeout_s: int
    results_json: Path | None = None  # the benchmark's results, searched for setups that failed


PARTS = [
    Part("env", [sys.executable, str(Path(__file__).resolve()), "--env-probe"], 120),
    Part("tests", [sys.executable, "-m", "pytest", "tests", "-m", "gpu", "-p", "no:cacheprovider", "-q",
                   "-o", "addopts=-ra"], 600),
    Part("gpu_step", [sys.executable, "benchmarks/gpu_step.py", "--setups", "peft", "vela_gpu",
                      "--out", str(RESULTS / "gpu_step.json")], 420, RESULTS / "gpu_step.json"),
    Part("big_on_one_gpu", [sys.executable, "benchmarks/big_on_one_gpu.py", "--layers", "2", "--setups",
                            "vela_tiers", "vela_zo", "--gpu-memory", "4", "--cache-experts", "8",
                            "--out", str(RESULTS / "big_on_one_gpu.json")], 300, RESULTS / "big_on_one_gpu.json"),
]
NAMES = [part.name for part in PARTS]


# -- the env probe (runs in its own process) -----------------------------------------------------------

def check(name: str, facts: dict, fn) -> None:
    """facts[name] = fn()'s value, or {"status": "failed", "reason": ...}: one broken item never hides the rest."""
    try:
        facts[name] = fn()
    except Exception as exc:  # noqa: BLE001  recorded, and the probe goes on
        facts[name] = {"status": "failed", "reason": one_line(f"{type(exc).__name__}: {exc}")}


def grouped_mm_check(torch, device: str) -> dict:
    """bf16 `torch._grouped_mm` forward and backward over 3 groups, the middle one empty (an expert no token
    chose), against per-group fp32 matmuls of the same bf16 values."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(48, 64, generator=generator).bfloat16().to(device).requires_grad_()
    w = torch.randn(3, 64, 32, generator=generator).bfloat16().to(device).requires_grad_()
    grad = torch.randn(48, 32, generator=generator).bfloat16().to(device)
    offs = torch.tensor([16, 16, 48], dtype=torch.int32, device=device)
    y = torch._grouped_mm(x, w, offs=offs)
    y.backward(grad)  # a dense gradient: the kernel's backward rejects an expanded one
    xf, wf, gf = x.detach().float(), w.detach().float(), grad.float()
    groups = [(0, 0, 16), (2, 16, 48)]  # (expert, first row, end row); expert 1 has none
    want_y = torch.cat([xf[a:b] @ wf[e] for e, a, b in groups])
    want_dx = torch.cat([gf[a:b] @ wf[e].T for e, a, b in groups])
    want_dw = torch.stack([xf[0:16].T @ gf[0:16], torch.zeros(64, 32, device=device), xf[16:].T @ gf[16:]])
    errors = {"forward": (y.float() - want_y).abs().max().item(),
              "grad_input": (x.grad.float() - want_dx).abs().max().item(),
              "grad_weight": (w.grad.float() - want_dw).abs().max().item()}
    empty_grad_zero = bool((w.grad[1] == 0).all())
    tolerance = 0.5  # bf16 rounding of sums of 16-64 products of unit normals
    ok = empty_grad_zero and all(e < tolerance for e in errors.values())
    return {"status": "ok" if ok else "failed", "device": device, "max_abs_error": errors,
            "empty_group_grad_zero": empty_grad_zero,
            **({} if ok else {"reason": f"off by more than {tolerance} or a non-zero empty group's gradient"})}


def nccl_version(torch) -> str:
    """NCCL's version as "2.21.5": torch returns a tuple, older releases an int (2215)."""
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def env_probe() -> dict:
    """The environment's facts; CUDA's only where it is available, else skipped with why."""
    import torch

    facts: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": sys.version.split()[0]}
    check("cuda_available", facts, torch.cuda.is_available)
    cuda = facts["cuda_available"] is True
    skipped = {"status": "skipped", "reason": "no CUDA device"}
    if cuda:
        check("device_count", facts, torch.cuda.device_count)
        check("device_name", facts, lambda: torch.cuda.get_device_name(0))
        check("capability", facts, lambda: list(torch.cuda.get_device_capability(0)))
        check("nccl", facts, lambda: nccl_version(torch))
    else:
        facts.update(device_count=0, device_name=skipped, capability=skipped, nccl=skipped)
    # on a CPU its CPU kernel: the check's own code runs everywhere, the GPU's answer only on a GPU
    check("grouped_mm_bf16", facts, lambda: grouped_mm_check(torch, "cuda" if cuda else "cpu"))
    return facts


# -- running the parts -------------------------------------------------------------------------------------

def one_line(text: str, limit: int = 300) -> str:
    """The first non-empty line of `text`, cut to `limit` characters."""
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line[:limit]


def last_line(text: str, limit: int = 300) -> str:
    """The last non-empty line of `text` (a pytest summary, an exception), cut to `limit` characters."""
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    return lines[-1][:limit] if lines else ""


def pump(stream, sink, lines: list[str]) -> None:
    """Copy a child's stream to ours line by line (a 10-minute part should not be silent), keeping the lines."""
    for line in stream:
        lines.append(line)
        if sink is not None:
            sink.write(line)
            sink.flush()


def run_command(part: Part) -> tuple[int | None, str, str]:
    """(exit code or None on timeout, stdout, stderr) of the part's command, passed through to ours but for
    the env probe's JSON. A timeout kills the part's whole process group (pytest's and Ray's children too)."""
    process = subprocess.Popen(part.command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env={**os.environ, "VELA_REQUIRE_GPU": "1"})
    out: list[str] = []
    err: list[str] = []
    pumps = [threading.Thread(target=pump, args=(process.stdout, None if part.name == "env" else sys.stdout, out)),
             threading.Thread(target=pump, args=(process.stderr, sys.stderr, err))]
    for thread in pumps:
        thread.start()
    try:
        code: int | None = process.wait(timeout=part.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        code = None
    for thread in pumps:
        thread.join()
    return code, "".join(out), "".join(err)


def setup_errors(results: dict, prefix: str = "") -> list[str]:
    """`setup: error` for every setup a benchmark's results record as failed; gpu_step nests its setups
    under their model (`model/setup: error`), big_on_one_gpu does not."""
    errors = []
    for name, value in results.items():
        if "error" in value:
            errors.append(f"{prefix}{name}: {value['error']}")
        elif "tokens_per_s" not in value:
            errors += setup_errors(value, f"{prefix}{name}/")
    return errors


def env_outcome(facts: dict) -> tuple[str, str]:
    """(status, one-line reason) of the env probe: failed if a check it could run failed."""
    failed = [name for name, value in facts.items() if isinstance(value, dict) and value.get("status") == "failed"]
    if failed:
        return "failed", "; ".join(f"{name}: {facts[name].get('reason', 'failed')}" for name in failed)
    device = (f"{facts['device_name']} (sm {'.'.join(map(str, facts['capability']))}), NCCL {facts['nccl']}"
              if facts.get("cuda_available") is True else "no CUDA device")
    return "ok", (f"torch {facts['torch']}, {device}, bf16 grouped_mm with an empty group ok "
                  f"on {facts['grouped_mm_bf16']['device']}")


def run_part(part: Part) -> dict:
    """The part's outcome: status ok / failed, a one-line reason, seconds (and the env probe's facts)."""
    start = time.perf_counter()
    if part.results_json is not None and part.results_json.exists():
        part.results_json.unlink()  # a stale file from an earlier run must not pass for this one's
    code, out, err = run_command(part)
    outcome: dict = {"command": " ".join(part.command), "timeout_s": part.timeout_s}
    if code is None:
        status, reason = "failed", f"timed out after {part.timeout_s} s"
    elif code != 0:
        status, reason = "failed", f"exit {code}: {last_line(err) or last_line(out)}"
    else:
        status, reason = "ok", last_line(out)
    if part.name == "env" and code == 0:
        outcome["facts"] = json.loads(last_line(out, limit=1_000_000))
        status, reason = env_outcome(outcome["facts"])
    if part.results_json is not None and status == "ok":
        errors = (setup_errors(json.loads(part.results_json.read_text())["results"])
                  if part.results_json.exists() else ["no results JSON written"])
        if errors:
            status, reason = "failed", one_line("; ".join(errors))
        outcome["results_json"] = str(part.results_json)
    outcome.update(status=status, reason=reason, seconds=round(time.perf_counter() - start, 1))
    return outcome


def write_json(out: Path, payload: dict) -> None:
    """Through a .tmp and a rename: a killed check leaves the previous complete file, never half of one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(tmp, out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=NAMES, default=NAMES, help="the parts to run (in their order)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="go on without CUDA (the env part reports the machine; the GPU parts fail)")
    p.add_argument("--out", type=Path, default=OUT, help="the check's JSON")
    p.add_argument("--env-probe", action="store_true", help=argparse.SUPPRESS)  # the env part's own process
    return p.parse_args(argv)


def no_cuda(env: dict) -> str | None:
    """The one line to exit with where the env probe found no usable CUDA device (None: it found one)."""
    facts = env.get("facts", {})
    if env["status"] == "ok" and facts.get("cuda_available") is True:
        return None
    why = env["reason"] if env["status"] != "ok" else f"torch {facts.get('torch')} sees no CUDA device"
    return (f"gpu_check: no CUDA ({why}); run `make gpu-check` on a machine with a working CUDA GPU "
            f"(`python scripts/gpu_check.py --only env --allow-cpu` reports this machine's environment)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.env_probe:
        print(json.dumps(env_probe()))
        return 0
    started = time.time()
    parts = {"env": run_part(PARTS[0])}  # first in any case: it says whether there is CUDA
    problem = no_cuda(parts["env"])
    if problem and not args.allow_cpu:
        print(problem, file=sys.stderr)
        return 2
    report = {"command": "python scripts/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
              "cuda_available": problem is None, "parts": {}}
    for part in PARTS:
        if part.name not in args.only:
            continue
        print(f"gpu_check: {part.name} ...", flush=True)
        report["parts"][part.name] = parts.get(part.name) or run_part(part)
        report["ok"] = all(p["status"] == "ok" for p in report["parts"].values())
        write_json(args.out, report)  # after every part: a killed check keeps what ran
    for name, outcome in report["parts"].items():
        print(f"gpu_check: {name:<15}{outcome['status']:<8}{outcome['seconds']:>8.1f} s  {outcome['reason']}")
    failed = [name for name, outcome in report["parts"].items() if outcome["status"] != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
