"""A `ray start --head` of a test's own, beside the session's Ray: free ports, a short temp dir, teardown.

Tests never call `ray stop` (it would kill every Ray on the machine); they kill the head's process group.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

BIN_DIR = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ray start exited with {proc.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port} after {timeout_s} s")


def auth_env(**extra: str) -> dict[str, str]:
    """The environment for the head and its clients: this venv first on PATH, token auth on."""
    return {**os.environ, "PATH": f"{BIN_DIR}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(16), **extra}


@contextmanager
def ray_head(env: dict[str, str], *args: str, wait_port: int):
    """Run `ray start --head --block ARGS` until the block ends; waits for `wait_port` to listen."""
    temp_dir = tempfile.mkdtemp(prefix="vr", dir="/tmp")  # short: Ray's unix socket paths must fit 107 bytes
    # Ports with fixed defaults get free ones: another Ray on this machine (the session's) holds the defaults,
    # and a head whose dashboard agent cannot bind answers job submissions with "No available agent".
    own_ports = [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                 f"--ray-client-server-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]
    head = subprocess.Popen([str(BIN_DIR / "ray"), "start", "--head", "--block", "--disable-usage-stats",
                             f"--temp-dir={temp_dir}", *own_ports, *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_port(wait_port, head)
        yield head
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # the head's whole process group: GCS, raylet, agents, workers
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)
