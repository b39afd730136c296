"""The local Ray instance a run starts for itself, and its end with the driver, even a SIGKILLed one.

    started = start_local_ray(runtime_env)    # ray.init(address="local", ...) and a reaper that outlives us
    ...
    stop_local_ray(started)                   # ray.shutdown(); the reaper then ends what is left

Ray's GCS and raylet are the driver's children and die with it, but the raylet's dashboard and runtime-env
agents, seeing their parent gone, first try to report it to the dead GCS and exit only when their client
gives up: a SIGKILLed `vela train` left `ray::DashboardAgent` and `ray::RuntimeEnvAgent` running for one to
two minutes. So the driver starts a reaper, a small process of its own session that holds the read end of a
pipe only the driver writes to: when the driver ends, however it ends, the pipe closes and the reaper kills
the processes Ray started for it (each checked by its start time, so a reused pid is never hit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import psutil
import ray
import torch

# Runs in the reaper: argv[1] is [[pid, create_time], ...]; waits for stdin's end, then kills those still there.
REAPER = """
import json, sys, psutil
owned = json.loads(sys.argv[1])
sys.stdin.buffer.read()
for pid, started in owned:
    try:
        process = psutil.Process(pid)
        if abs(process.create_time() - started) < 1e-3:
            process.kill()
    except psutil.Error:
        pass
"""


def local_resources() -> dict[str, float]:
    """What a local Ray of this machine will have: its cores (as `start_local_ray` gives them) and the GPUs this
    process sees. Known before Ray starts (15-20 s on a small machine), so a job that cannot fit is refused first."""
    return {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}


@dataclass
class LocalRay:
    """A local Ray instance this process started, and the reaper that ends it with this process."""

    reaper: subprocess.Popen


def start_local_ray(runtime_env: dict) -> LocalRay:
    """A fresh local Ray on this machine's cores (`address="local"`: never the cluster a `ray start` left
    running here), with a reaper for the processes it started."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, runtime_env=runtime_env,
             log_to_driver=True)
    owned = [[p.pid, p.create_time()] for p in psutil.Process().children(recursive=True) if p.pid not in before]
    reaper = subprocess.Popen([sys.executable, "-c", REAPER, json.dumps(owned)], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return LocalRay(reaper)


def stop_local_ray(local: LocalRay) -> None:
    """Ray shut down, then the reaper let go (it ends whatever Ray left behind)."""
    try:
        ray.shutdown()
    finally:
        local.reaper.stdin.close()
        local.reaper.wait(timeout=60)
