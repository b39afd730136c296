"""An emulated multi-node Ray cluster on one machine, with cross-node links really slower.

Each emulated node is a Linux network namespace (`<prefix>-n<i>`) joined to a
bridge (`<prefix>-br`) in the root namespace by a veth pair (`<prefix>-h<i>` in
the root namespace, `<prefix>-c<i>` inside the node), with a private address
`<subnet>.<i+1>/24` (default 10.200.0.0/24; the bridge holds `.254`). Every node
runs its own `ray start` bound to its address (`--node-ip-address`), the head in
node 0. Traffic between two processes of one node stays on that namespace's
loopback (unshaped); traffic between nodes crosses the node's veth, where a
token-bucket filter (`tc ... tbf`) on both ends caps it at the cross-node rate
(each node's veth acts like its NIC: egress and ingress each at that rate).

By default the cross-node rate is the paper's ratio applied to this machine:
`measured loopback TCP throughput / 15.6` (18.3 GB/s intra vs 1.17 GB/s cross).
No latency is added: this kernel has no `netem` qdisc (checked when shaping).

Nothing here is silent: without root, `ip`/`tc`, network namespaces or the
`tbf` qdisc, `EmulatedCluster.up()` raises `ShapingUnavailable` saying which.
Everything it creates carries the prefix and is removed on exit (context
manager, `atexit`, SIGTERM) or by `down`: processes in our namespaces (killed
by pid), namespaces, veths, the bridge and the Ray temp dir. No other
interface is touched; no traffic leaves the machine (the namespaces have no
route out and the bridge forwards nothing outside).

    with EmulatedCluster(ClusterSpec(num_nodes=3)) as cluster:
        print(cluster.probe_links())              # intra/cross TCP throughput and their ratio
        cluster.run_in_node(0, ["python", "train.py"], env={"RAY_ADDRESS": cluster.ray_address})

Command line (as root):

    python deploy/emulated_cluster.py up [--nodes 3 --cross-mbit 1500]   # stays up; prints address and probe
    python deploy/emulated_cluster.py probe
    python deploy/emulated_cluster.py run -- python my_driver.py          # up, run in node 0, down
    python deploy/emulated_cluster.py down                                 # remove everything with the prefix
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger("emulated_cluster")

PAPER_INTRA_GBPS, PAPER_CROSS_GBPS = 18.3, 1.17  # GB/s measured in the paper's cluster (Sec. V-A)
PROBE_PORT = 45_600


class ShapingUnavailable(RuntimeError):
    """The cluster cannot be emulated with shaped links here; the message says why and what to do."""


class ClusterSpec(BaseModel):
    """Layout, addresses and link rates of the emulated cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_nodes: int = Field(3, ge=2, description="emulated nodes (network namespaces), node 0 runs the Ray head")
    cpus_per_node: int = Field(2, ge=1, description="logical CPUs each Ray node advertises")
    object_store_bytes: int = Field(512 << 20, ge=78 << 20, description="Ray object store per node")
    prefix: str = Field("velaemu", pattern=r"^[a-z][a-z0-9]{1,9}$", description="name prefix of all we create")
    subnet: str = Field("10.200.0", pattern=r"^\d+\.\d+\.\d+$", description="private /24 inside our namespaces")
    cross_mbit: float | None = Field(None, gt=0, description="cross-node rate, Mbit/s; None: loopback / ratio")
    ratio: float = Field(PAPER_INTRA_GBPS / PAPER_CROSS_GBPS, gt=1, description="intra:cross bandwidth ratio")
    burst_bytes: int = Field(512 << 10, ge=128 << 10, description="tbf bucket (>= a 64 KiB GSO packet)")
    ray_port: int = 6379

    def node_ip(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def netns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    @property
    def temp_dir(self) -> Path:
        return Path("/tmp") / self.prefix


# --- shell helpers -----------------------------------------------------------------------------------


def _sh(*argv: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + list(argv)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if check and result.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def check_can_shape(prefix: str = "velaemu") -> None:
    """Raise ShapingUnavailable unless we are root with `ip`, `tc`, network namespaces and tbf."""
    if os.geteuid() != 0:
        raise ShapingUnavailable("emulated links need root (network namespaces and tc); run as root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ShapingUnavailable(f"{', '.join(missing)} not found: apt-get install -y iproute2")
    probe = f"{prefix}-probe"
    result = _sh("ip", "netns", "add", probe, check=False)
    if result.returncode:
        raise ShapingUnavailable(f"cannot create a network namespace ({result.stderr.strip()}); this sandbox "
                                 "forbids netns, so cross-node links cannot be emulated here")
    try:
        tbf = _sh("tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit", "burst", "256kb",
                  "latency", "10ms", netns=probe, check=False)
        if tbf.returncode:
            raise ShapingUnavailable(f"the kernel lacks the tbf qdisc ({tbf.stderr.strip()}); cannot shape links")
    finally:
        _sh("ip", "netns", "del", probe, check=False)


def our_namespaces(prefix: str) -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout.split("\n")
    return sorted(line.split()[0] for line in out if line.startswith(f"{prefix}-"))


def _our_links(prefix: str) -> list[str]:
    out = _sh("ip", "-o", "link", "show", check=False).stdout.split("\n")
    names = [line.split(":")[1].strip().split("@")[0] for line in out if line.count(":") >= 2]
    return [name for name in names if name.startswith(f"{prefix}-")]


def _pids_in(netns: str) -> list[int]:
    return [int(p) for p in _sh("ip", "netns", "pids", netns, check=False).stdout.split()]


def _kill_namespace_processes(namespaces: Sequence[str], grace_s: float = 10.0) -> None:
    """SIGTERM every process in our namespaces (by pid), then SIGKILL what is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = [pid for ns in namespaces for pid in _pids_in(ns)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = [pid for ns in namespaces for pid in _pids_in(ns)]
        if not pids:
            return


def down(prefix: str = "velaemu") -> list[str]:
    """Remove everything named `<prefix>-*`: processes in our namespaces, namespaces, links, temp dir."""
    namespaces = our_namespaces(prefix)
    _kill_namespace_processes(namespaces)
    for ns in namespaces:
        _sh("ip", "netns", "del", ns, check=False)
    links = _our_links(prefix)
    for link in links:
        _sh("ip", "link", "del", link, check=False)
    shutil.rmtree(Path("/tmp") / prefix, ignore_errors=True)
    removed = namespaces + links
    if removed:
        logger.info("removed %s", ", ".join(removed))
    return removed


# --- throughput probes ------------------------------------------------------------------------------


def _serve(host: str, port: int) -> None:
    """Accept one connection, read it to the end, reply one byte (subcommand `_serve`)."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, port))
        server.listen(1)
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            while conn.recv(1 << 20):
                pass
            conn.sendall(b"k")


def _send(host: str, port: int, nbytes: int) -> float:
    """Stream `nbytes` to a `_serve` and return bytes/s (subcommand `_send`)."""
    chunk = b"\0" * (1 << 20)
    with socket.create_connection((host, port)) as conn:
        start, sent = time.perf_counter(), 0
        while sent < nbytes:
            conn.sendall(chunk)
            sent += len(chunk)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
        return sent / (time.perf_counter() - start)


def tcp_throughput(host: str, nbytes: int, server_ns: str | None = None, client_ns: str | None = None,
                   port: int = PROBE_PORT) -> float:
    """Bytes/s of one TCP stream from `client_ns` to `host` served in `server_ns` (None: this namespace)."""
    me = [sys.executable, str(Path(__file__).resolve())]
    prefix = lambda ns: ["ip", "netns", "exec", ns] if ns else []  # noqa: E731
    server = subprocess.Popen(prefix(server_ns) + me + ["_serve", host, str(port)], stdout=subprocess.PIPE,
                              text=True)
    try:
        server.stdout.readline()  # "ready"
        out = subprocess.run(prefix(client_ns) + me + ["_send", host, str(port), str(nbytes)], capture_output=True,
                             text=True, check=True, timeout=120)
        return float(out.stdout.strip())
    finally:
        server.wait(timeout=30)


def measure_loopback(nbytes: int = 2 << 30, repeats: int = 2) -> float:
    """Best of `repeats` single-stream TCP throughputs over 127.0.0.1 (bytes/s)."""
    return max(tcp_throughput("127.0.0.1", nbytes) for _ in range(repeats))


# --- the cluster ------------------------------------------------------------------------------------


class EmulatedCluster:
    """Namespaces, shaped veths and one Ray node per namespace; a context manager that cleans up."""

    def __init__(self, spec: ClusterSpec | None = None):
        self.spec = spec or ClusterSpec()
        self.cross_bytes_per_s: float | None = None
        self.loopback_bytes_per_s: float | None = None
        self._up = False

    @property
    def ray_address(self) -> str:
        return f"{self.spec.node_ip(0)}:{self.spec.ray_port}"

    def __enter__(self) -> "EmulatedCluster":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Create the network, shape it, start Ray on every node; undo all of it if any part fails."""
        spec = self.spec
        check_can_shape(spec.prefix)
        self._clear_leftovers()
        atexit.register(self.down)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so finally/atexit cleanup runs
        self._up = True
        try:
            self.loopback_bytes_per_s = measure_loopback()
            mbit = spec.cross_mbit or self.loopback_bytes_per_s * 8 / 1e6 / spec.ratio
            self.cross_bytes_per_s = mbit * 1e6 / 8
            self._create_network()
            self._shape(mbit)
            self._start_ray()
        except BaseException:
            self.down()
            raise
        logger.info("emulated cluster up: %d nodes, head %s, cross-node %.0f Mbit/s (loopback %.2f GB/s)",
                    spec.num_nodes, self.ray_address, mbit, self.loopback_bytes_per_s / 1e9)

    def down(self) -> None:
        if self._up:
            self._up = False
            down(self.spec.prefix)

    def _clear_leftovers(self) -> None:
        namespaces = our_namespaces(self.spec.prefix)
        busy = [ns for ns in namespaces if _pids_in(ns)]
        if busy:
            raise ShapingUnavailable(f"namespaces {busy} of a running emulated cluster exist; stop it with "
                                     f"`python deploy/emulated_cluster.py down --prefix {self.spec.prefix}`")
        if namespaces or _our_links(self.spec.prefix):
            down(self.spec.prefix)

    def _create_network(self) -> None:
        spec = self.spec
        _sh("ip", "link", "add", spec.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{spec.subnet}.254/24", "dev", spec.bridge)
        _sh("ip", "link", "set", spec.bridge, "up")
        for node in range(spec.num_nodes):
            ns, host, inner = spec.netns(node), f"{spec.prefix}-h{node}", f"{spec.prefix}-c{node}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", host, "type", "veth", "peer", "name", inner)
            _sh("ip", "link", "set", inner, "netns", ns)
            _sh("ip", "link", "set", host, "master", spec.bridge)
            _sh("ip", "link", "set", host, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{spec.node_ip(node)}/24", "dev", inner)
            _sh("ip", "-n", ns, "link", "set", inner, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _shape(self, mbit: float) -> None:
        """tbf at `mbit` on both ends of every node's veth: all and only cross-node traffic crosses them."""
        spec = self.spec
        tbf = ["root", "tbf", "rate", f"{int(mbit)}mbit", "burst", str(spec.burst_bytes), "latency", "50ms"]
        for node in range(spec.num_nodes):
            _sh("tc", "qdisc", "add", "dev", f"{spec.prefix}-h{node}", *tbf)
            _sh("tc", "qdisc", "add", "dev", f"{spec.prefix}-c{node}", *tbf, netns=spec.netns(node))

    def _start_ray(self) -> None:
        spec = self.spec
        ray_cli = str(Path(sys.executable).parent / "ray")
        common = ["--num-cpus", str(spec.cpus_per_node), "--object-store-memory", str(spec.object_store_bytes),
                  "--disable-usage-stats", f"--temp-dir={spec.temp_dir}"]
        for node in range(spec.num_nodes):
            role = (["--head", "--port", str(spec.ray_port), "--include-dashboard=false"] if node == 0
                    else ["--address", self.ray_address])
            argv = [ray_cli, "start", "--node-ip-address", spec.node_ip(node), *role, *common]
            result = subprocess.run(["ip", "netns", "exec", spec.netns(node), *argv], capture_output=True,
                                    text=True, env=ray_env(), timeout=180)
            if result.returncode:
                raise RuntimeError(f"ray start on node {node} failed: {result.stderr[-2000:]}")

    def run_in_node(self, node: int, argv: Sequence[str], env: dict[str, str] | None = None,
                    **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` inside node `node`'s namespace (RAY_ADDRESS and the node address set)."""
        full_env = {**ray_env(), "RAY_ADDRESS": self.ray_address, "VELA_NODE_IP": self.spec.node_ip(node),
                    **(env or {})}
        return subprocess.run(["ip", "netns", "exec", self.spec.netns(node), *argv], env=full_env, **kwargs)

    def probe_links(self, nbytes: int = 512 << 20) -> dict:
        """TCP throughput inside node 0 (intra) and from node 0 to node 1 (cross), bytes/s, and their ratio."""
        spec = self.spec
        intra = max(tcp_throughput(spec.node_ip(0), 4 * nbytes, spec.netns(0), spec.netns(0)) for _ in range(2))
        cross = tcp_throughput(spec.node_ip(1), nbytes, spec.netns(1), spec.netns(0))
        return {"intra_bytes_per_s": intra, "cross_bytes_per_s": cross, "ratio": intra / cross,
                "configured_cross_bytes_per_s": self.cross_bytes_per_s,
                "loopback_bytes_per_s": self.loopback_bytes_per_s}

    def wire_bytes(self) -> list[int]:
        """Bytes each node sent across its veth so far (cross-node traffic as the wire sees it)."""
        spec = self.spec
        return [int(_sh("cat", f"/sys/class/net/{spec.prefix}-c{n}/statistics/tx_bytes", netns=spec.netns(n))
                    .stdout) for n in range(spec.num_nodes)]


def ray_env() -> dict[str, str]:
    """Environment for our Ray processes: token auth on (the machine's ~/.ray token), no usage stats."""
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
            "TOKENIZERS_PARALLELISM": "false"}


# --- command line -----------------------------------------------------------------------------------


def _spec_from(args: argparse.Namespace) -> ClusterSpec:
    return ClusterSpec(num_nodes=args.nodes, cpus_per_node=args.cpus_per_node, cross_mbit=args.cross_mbit,
                       prefix=args.prefix)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("up", "start the cluster and leave it running"), ("probe", "measure a running cluster"),
                       ("run", "start, run a command in node 0, stop"), ("down", "remove everything we created")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--prefix", default="velaemu", help="name prefix of namespaces, links, temp dir")
        cmd.add_argument("--nodes", type=int, default=3, help="number of emulated nodes")
        cmd.add_argument("--cpus-per-node", type=int, default=2, help="logical CPUs per Ray node")
        cmd.add_argument("--cross-mbit", type=float, default=None,
                         help="cross-node Mbit/s (default: loopback throughput / 15.6, the paper's ratio)")
        if name == "run":
            cmd.add_argument("cmd", nargs=argparse.REMAINDER, help="command to run in node 0 (after --)")
    for name in ("_serve", "_send"):
        hidden = sub.add_parser(name)
        hidden.add_argument("host")
        hidden.add_argument("port", type=int)
        if name == "_send":
            hidden.add_argument("nbytes", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.command == "_serve":
        _serve(args.host, args.port)
        return 0
    if args.command == "_send":
        print(_send(args.host, args.port, args.nbytes))
        return 0
    if args.command == "down":
        down(args.prefix)
        return 0
    cluster = EmulatedCluster(_spec_from(args))
    if args.command == "probe":
        cluster._up = False  # probe a running cluster; never tear it down from here
        cluster.cross_bytes_per_s = cluster.loopback_bytes_per_s = None
        print(json.dumps(cluster.probe_links(), indent=1))
        return 0
    cluster.up()
    print(json.dumps({"ray_address": cluster.ray_address, **cluster.probe_links()}, indent=1))
    if args.command == "up":
        atexit.unregister(cluster.down)  # stays up until `down`
        return 0
    try:
        command = [c for c in args.cmd if c != "--"]
        return cluster.run_in_node(0, command).returncode
    finally:
        cluster.down()


if __name__ == "__main__":
    sys.exit(main())
