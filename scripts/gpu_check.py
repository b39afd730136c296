"""The GPU checks in one command and one JSON: `make gpu-battery` on a bare GPU node, `make gpu-check` on one
with the project installed.

The parts, in order, each a subprocess with its own timeout, under one wall-clock budget:

    env         torch, CUDA, the driver, the device's name, capability and memory, NCCL's version, the versions
                of the packages found (and which of Ray, cvxpy, datasets, matplotlib are absent), and a bf16
                `torch._grouped_mm` forward + backward with an empty group against per-group matmuls (what
                the experts run); a check that cannot run here is recorded as skipped, with why
    exactness   `scripts/gpu_exactness.py`: debug Mixtral and Qwen3-MoE as whole in-process jobs with the
                master and every expert on the GPU against peft on the GPU (fp32, losses rel 1e-4), and
                bf16 expert-factor updates within peft-bf16's own spread
    speed       `benchmarks/gpu_step.py --setups peft vela_gpu vela_gpu_overlap --micro-batches 2` at OLMoE-1B-7B
                width, 4 of its 16 layers (vela-ray's step serial and with both micro-batches in flight)
    tiers       `benchmarks/big_on_one_gpu.py --layers 2 --setups vela_tiers vela_zo` under a 4 GiB budget
                with 8 of the 16 experts cached, so the tiers upload and compute on both sides (2 x 256 tokens,
                2 timed steps: the CPU's share of a Mixtral-8x7B expert is seconds)
    nccl        `scripts/gpu_nccl.py`: rows over the collective plane's NCCL group between two GPUs; skipped,
                saying why, on one GPU (NCCL refuses two ranks on one GPU)
    tests       `pytest tests -m gpu` with VELA_REQUIRE_GPU=1 (a skipped gpu test fails, tests/conftest.py);
                needs the whole project installed (Ray, pytest): not part of the battery

The battery (`--battery`, `make gpu-battery`) is every part but `tests`: torch, transformers, peft,
safetensors, numpy, pydantic and pyyaml are all it imports (`make gpu-wheels` carries what a node lacks), and
its parts' timeouts add up to its 360 s budget. Each part's outcome (ok / skipped / failed, a one-line reason,
seconds) goes into the JSON (`benchmarks/results/gpu/battery.json`, or `--out`; the parts' own JSONs beside
it), rewritten after every part; a benchmark part fails on a non-zero exit or on any setup its JSON records
as an error. The exit status is 1 if any part failed, 2 without CUDA (unless `--allow-cpu`: then each part
runs its CPU form, toy sizes, and the GPU-only `tests` part fails): a check that passes on a machine that
tested nothing would hide a broken GPU. The env probe runs first in any case (in a subprocess, so a hanging
driver times out instead of hanging the check) and decides whether there is CUDA.

    python scripts/gpu_check.py --battery                          # the battery (a bare CUDA node)
    python scripts/gpu_check.py                                    # every part (the project installed)
    python scripts/gpu_check.py --only env exactness               # some parts
    python scripts/gpu_check.py --battery --allow-cpu --out /tmp/battery.json   # its CPU form, anywhere
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
OUT = RESULTS / "gpu" / "gpu_check.json"
BATTERY_OUT = RESULTS / "gpu" / "battery.json"
BATTERY_BUDGET_S = 360  # the battery's wall clock, imports included: a GPU node's time is short
# what the env part reports the versions of; the last four are the cluster's, absent from a bare node
PACKAGES = ("torch", "transformers", "peft", "safetensors", "tokenizers", "huggingface_hub", "accelerate", "numpy",
            "pydantic", "PyYAML", "vela-ray", "ray", "cvxpy", "datasets", "matplotlib")


@dataclass(frozen=True)
class Part:
    """A part of the check: its command (run from the repository root, `{out}` its results folder), the
    arguments its CPU form adds (None: it has none, and fails without CUDA), how long it may take, and the
    results file it writes there (searched for setups that failed)."""

    name: str
    command: list[str]
    timeout_s: int
    results_json: str | None = None
    cpu_args: list[str] | None = None

    def argv(self, out: Path, cpu: bool) -> list[str]:
        """The command, run from ROOT: an `out` inside it is named relative to it, so the parts' JSONs (which
        record their command) name no machine path."""
        where = str(out.relative_to(ROOT) if out.is_absolute() and out.is_relative_to(ROOT) else out)
        return [arg.replace("{out}", where) for arg in [*self.command, *((self.cpu_args or []) if cpu else [])]]


PARTS = [
    Part("env", [sys.executable, "scripts/gpu_check.py", "--env-probe"], 45, cpu_args=[]),
    Part("exactness", [sys.executable, "scripts/gpu_exactness.py", "--out", "{out}/exactness.json"], 120,
         "exactness.json", cpu_args=["--device", "cpu"]),
    Part("speed", [sys.executable, "benchmarks/gpu_step.py", "--models", "olmoe", "--layers", "4", "--setups", "peft",
                   "vela_gpu", "vela_gpu_overlap", "--micro-batches", "2", "--steps", "5",
                   "--out", "{out}/gpu_step.json"], 90, "gpu_step.json",
         cpu_args=["--device", "cpu", "--tiny"]),
    Part("tiers", [sys.executable, "benchmarks/big_on_one_gpu.py", "--layers", "2", "--setups", "vela_tiers", "vela_zo",
                   "--gpu-memory", "4", "--cache-experts", "8", "--batch", "2", "--seq", "256", "--steps", "2",
                   "--out", "{out}/big_on_one_gpu.json"], 80,
         "big_on_one_gpu.json", cpu_args=["--device", "cpu", "--tiny", "--cache-experts", "4"]),
    Part("nccl", [sys.executable, "scripts/gpu_nccl.py"], 25, cpu_args=[]),
    Part("tests", [sys.executable, "-m", "pytest", "tests", "-m", "gpu", "-p", "no:cacheprovider", "-q",
                   "-o", "addopts=-ra"], 600),
]
NAMES = [part.name for part in PARTS]
PROBES = ("env", "nccl")  # parts that print one JSON line of facts (with their own status, for nccl)
BATTERY = [name for name in NAMES if name != "tests"]
assert sum(p.timeout_s for p in PARTS if p.name in BATTERY) <= BATTERY_BUDGET_S


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


def package_versions() -> dict[str, str | None]:
    """The installed version of each of `PACKAGES` (None: absent), read, not assumed: a node's image may
    differ from the pins (constraints.txt), and the JSON must say what ran."""
    from importlib.metadata import PackageNotFoundError, version

    def found(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    return {name: found(name) for name in PACKAGES}


def driver_version() -> str:
    """The NVIDIA driver's version, as nvidia-smi reports it."""
    done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=20, check=True)
    return done.stdout.strip().splitlines()[0]


def env_probe() -> dict:
    """The environment's facts; CUDA's only where it is available, else skipped with why."""
    import torch

    facts: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": sys.version.split()[0],
                   "cpus": os.cpu_count(), "packages": package_versions()}
    check("cuda_available", facts, torch.cuda.is_available)
    cuda = facts["cuda_available"] is True
    skipped = {"status": "skipped", "reason": "no CUDA device"}
    if cuda:
        check("device_count", facts, torch.cuda.device_count)
        check("device_name", facts, lambda: torch.cuda.get_device_name(0))
        check("capability", facts, lambda: list(torch.cuda.get_device_capability(0)))
        check("memory_gib", facts, lambda: round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
        check("driver", facts, driver_version)
        check("nccl", facts, lambda: nccl_version(torch))
    else:
        facts.update(device_count=0, device_name=skipped, capability=skipped, memory_gib=skipped, driver=skipped,
                     nccl=skipped)
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


def run_command(part: Part, argv: list[str], timeout_s: float, cpu: bool = False) -> tuple[int | None, str, str]:
    """(exit code or None on timeout, stdout, stderr) of the part's command `argv`, passed through to ours but
    for the probes' JSON. A timeout kills the part's whole process group (pytest's and Ray's children too).

    A CPU form (`cpu`) runs on one intra-op thread unless OMP_NUM_THREADS says otherwise: its toy sizes are too
    small to split, and a second thread only waits at every barrier (the battery's CPU form on a 2-core machine:
    86 s on 2 threads, 34 s on 1; its exactness part 56 s -> 16 s)."""
    env = {**os.environ, "VELA_REQUIRE_GPU": "1"}
    if cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env=env)
    out: list[str] = []
    err: list[str] = []
    pumps = [threading.Thread(target=pump, args=(process.stdout, None if part.name in PROBES else sys.stdout, out)),
             threading.Thread(target=pump, args=(process.stderr, sys.stderr, err))]
    for thread in pumps:
        thread.start()
    try:
        code: int | None = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        code = None
    for thread in pumps:
        thread.join()
    return code, "".join(out), "".join(err)


def setup_errors(results: dict, prefix: str = "") -> list[str]:
    """`setup: error` for every setup a benchmark's results record as failed; gpu_step and gpu_exactness nest
    theirs under their model (`model/setup: error`), big_on_one_gpu does not."""
    errors = []
    for name, value in results.items():
        if not isinstance(value, dict):
            continue
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


def run_part(part: Part, out_dir: Path, cpu: bool, left_s: float) -> dict:
    """The part's outcome: status ok / skipped / failed, a one-line reason, seconds (and the probes' facts).
    It may run for its own timeout or `left_s`, what is left of the check's budget, whichever is less."""
    start = time.perf_counter()
    results_json = out_dir / part.results_json if part.results_json else None
    if results_json is not None and results_json.exists():
        results_json.unlink()  # a stale file from an earlier run must not pass for this one's
    timeout_s = min(part.timeout_s, left_s)
    argv = part.argv(out_dir, cpu)
    outcome: dict = {"command": " ".join(["python", *argv[1:]]), "timeout_s": round(timeout_s)}
    if cpu and part.cpu_args is None:
        status, reason = "failed", "needs a CUDA device (this part has no CPU form)"
    elif timeout_s < 5:
        status, reason = "failed", "not run: the check's time budget was spent"
    else:
        status, reason = part_status(part, *run_command(part, argv, timeout_s, cpu), timeout_s, outcome)
    if results_json is not None and status == "ok":
        errors = (setup_errors(json.loads(results_json.read_text())["results"])
                  if results_json.exists() else ["no results JSON written"])
        if errors:
            status, reason = "failed", one_line("; ".join(errors))
        outcome["results_json"] = str(results_json.relative_to(ROOT) if results_json.is_relative_to(ROOT)
                                      else results_json)
    outcome.update(status=status, reason=reason, seconds=round(time.perf_counter() - start, 1))
    return outcome


def part_status(part: Part, code: int | None, out: str, err: str, timeout_s: float, outcome: dict) -> tuple[str, str]:
    """(status, reason) of a part that ran; the probes' facts go into `outcome`."""
    if code is None:
        return "failed", f"timed out after {timeout_s:.0f} s"
    if part.name in PROBES and out.strip():
        facts = json.loads(last_line(out, limit=1_000_000))
        if part.name == "env":
            outcome["facts"] = facts
            return env_outcome(facts)
        outcome["facts"] = {k: v for k, v in facts.items() if k not in ("status", "reason")}
        return facts["status"], facts["reason"]
    if code != 0:
        return "failed", f"exit {code}: {last_line(err) or last_line(out)}"
    return "ok", last_line(out)


def write_json(out: Path, payload: dict) -> None:
    """Through a .tmp and a rename: a killed check leaves the previous complete file, never half of one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(tmp, out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--battery", action="store_true", help=f"the Ray-free parts ({' '.join(BATTERY)}) in "
                                                          f"{BATTERY_BUDGET_S} s, into {BATTERY_OUT.relative_to(ROOT)}")
    p.add_argument("--only", nargs="+", choices=NAMES, default=None, help="the parts to run (in their order)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="go on without CUDA: each part runs its CPU form (toy sizes); `tests` fails")
    p.add_argument("--out", type=Path, default=None, help=f"the check's JSON (default {OUT.relative_to(ROOT)}, "
                                                          f"with --battery {BATTERY_OUT.relative_to(ROOT)})")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"wall-clock seconds for all parts (default: {BATTERY_BUDGET_S} with --battery, else none)")
    p.add_argument("--env-probe", action="store_true", help=argparse.SUPPRESS)  # the env part's own process
    args = p.parse_args(argv)
    args.only = args.only or (BATTERY if args.battery else NAMES)
    args.out = args.out or (BATTERY_OUT if args.battery else OUT)
    args.budget_s = args.budget_s or (BATTERY_BUDGET_S if args.battery else float("inf"))
    return args


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
    out_dir = args.out.resolve().parent
    parts = {"env": run_part(PARTS[0], out_dir, False, args.budget_s)}  # first in any case: is there CUDA?
    problem = no_cuda(parts["env"])
    if problem and not args.allow_cpu:
        print(problem, file=sys.stderr)
        return 2
    report = {"command": "python scripts/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
              "cuda_available": problem is None, "budget_s": args.budget_s, "parts": {}}
    for part in PARTS:
        if part.name not in args.only:
            continue
        print(f"gpu_check: {part.name} ...", flush=True)
        left_s = args.budget_s - (time.time() - started)
        report["parts"][part.name] = parts.get(part.name) or run_part(part, out_dir, problem is not None, left_s)
        report["ok"] = all(p["status"] != "failed" for p in report["parts"].values())
        report["seconds"] = round(time.time() - started, 1)
        write_json(args.out, report)  # after every part: a killed check keeps what ran
    for name, outcome in report["parts"].items():
        print(f"gpu_check: {name:<11}{outcome['status']:<8}{outcome['seconds']:>7.1f} s  {outcome['reason']}")
    print(f"gpu_check: {report['seconds']:.0f} s in all; {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
