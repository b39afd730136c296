"""An emulated multi-node Ray cluster on one machine, with cross-node links really slower.

Each emulated node is a Linux network namespace (`<prefix>-n<i>`) joined to a
bridge (`<prefix>-br`) in the root namespace by a veth pair (`<prefix>-h<i>` in
the root namespace, `<prefix>-c<i>` inside the node), with a private address
`<subnet>.<i+1>/24` (default 10.200.0.0/24; the bridge has no address, so the
root namespace gets no route into the subnet). Every node
runs its own `ray start` bound to its address (`--node-ip-address`), the head in
node 0. Traffic between two processes of one node stays on that namespace's
loopback (unshaped by default; `intra_mbit` shapes it with tbf too, so both tiers are
set and their ratio is the paper's rather than loopback-vs-veth); traffic between nodes crosses the node's veth, where a
token-bucket filter (`tc ... tbf`, with a peak rate so that bursts are paced too)
on both ends caps it at the cross-node rate (each node's veth acts like its NIC:
egress and ingress each at that rate).

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
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger("emulated_cluster")

PAPER_INTRA_GBPS, PAPER_CROSS_GBPS = 18.3, 1.17  # GB/s measured in the paper's cluster (Sec. V-A)
PROBE_PORT = 45_600
LO_MTU = 65_536  # a namespace's loopback MTU
HOST_NETNS_ENV = "VELA_HOST_NETNS"  # the namespace holding the bridge, for drivers inside a node


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
    intra_mbit: float | None = Field(
        None, gt=0, description="intra-node rate, Mbit/s: tbf on each node's loopback (TCP between two processes "
        "of a node: gloo, Ray's gRPC; not Ray's shared-memory object store); None: unshaped (the default)")
    ratio: float = Field(PAPER_INTRA_GBPS / PAPER_CROSS_GBPS, gt=1, description="intra:cross bandwidth ratio")
    calibrate: Literal["loopback", "ray"] = Field(
        "loopback", description="intra rate the ratio divides: raw TCP loopback, or what Ray moves inside a node")
    burst_bytes: int = Field(128 << 10, ge=64 << 10, description="tbf bucket (>= a 64 KiB GSO packet)")
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
    missing = [tool for tool in ("ip", "tc", "nsenter") if shutil.which(tool) is None]
    if missing:
        raise ShapingUnavailable(f"{', '.join(missing)} not found: apt-get install -y iproute2")
    probe = f"{prefix}-probe"
    result = _sh("ip", "netns", "add", probe, check=False)
    if result.returncode:
        raise ShapingUnavailable(f"cannot create a network namespace ({result.stderr.strip()}); this sandbox "
                                 "forbids netns, so cross-node links cannot be emulated here")
    try:
        tbf = _sh("tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit", "burst", "128kb",
                  "latency", "10ms", "peakrate", "1100mbit", "mtu", "65536", netns=probe, check=False)
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


def measure_loopback(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Median of `repeats` single-stream TCP throughputs over 127.0.0.1 (bytes/s)."""
    return statistics.median(tcp_throughput("127.0.0.1", nbytes) for _ in range(repeats))


# --- the cluster ------------------------------------------------------------------------------------


class EmulatedCluster:
    """Namespaces, shaped veths and one Ray node per namespace; a context manager that cleans up."""

    def __init__(self, spec: ClusterSpec | None = None):
        self.spec = spec or ClusterSpec()
        self.cross_bytes_per_s: float | None = None
        self.loopback_bytes_per_s: float | None = None
        self.intra_bytes_per_s: float | None = None  # shaped intra-node rate, if any
        self.ray_links: dict | None = None
        self._up = False
        self._ray_env = ray_env()

    @property
    def ray_address(self) -> str:
        return f"{self.spec.node_ip(0)}:{self.spec.ray_port}"

    def __enter__(self) -> "EmulatedCluster":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self, start_ray: bool = True) -> None:
        """Create the network, shape it, start Ray on every node (unless not `start_ray`); undo all on failure."""
        spec = self.spec
        check_can_shape(spec.prefix)
        self._clear_leftovers()
        atexit.register(self.down)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so finally/atexit cleanup runs
        self._up = True
        try:
            self.loopback_bytes_per_s = measure_loopback()
            base = spec.intra_mbit or self.loopback_bytes_per_s * 8 / 1e6
            mbit = spec.cross_mbit or base / spec.ratio
            self.cross_bytes_per_s = mbit * 1e6 / 8
            self._create_network()
            self._shape(mbit)
            self._shape_intra(spec.intra_mbit)
            if start_ray:
                self._start_ray()
            if start_ray and spec.calibrate == "ray" and not spec.intra_mbit:
                self.ray_links = self.probe_ray_links()
                mbit = spec.cross_mbit or self.ray_links["same_node_bytes_per_s"] * 8 / 1e6 / spec.ratio
                self.set_cross_rate(mbit)
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
        _sh("ip", "link", "add", spec.bridge, "type", "bridge")  # layer 2 only: no address, no route here
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

    def _shape(self, mbit: float | None) -> None:
        """tbf at `mbit` on both ends of every node's veth (all and only cross-node traffic crosses them).

        `peakrate` just above the rate, with a bucket of one 64 KiB GSO packet, makes a
        burst leave at the link rate too: without it, a transfer smaller than the bucket
        after an idle gap passes at memory speed, and MoE layers send exactly such
        bursts. None removes the shaping (an unshaped reference run).
        """
        spec = self.spec
        host_netns = os.environ.get(HOST_NETNS_ENV, "/proc/self/ns/net")  # set for drivers inside a node
        rate = max(1, int(mbit)) if mbit else 0
        tbf = ["root", "tbf", "rate", f"{rate}mbit", "burst", str(spec.burst_bytes), "latency", "50ms",
               "peakrate", f"{int(rate * 1.05) + 1}mbit", "mtu", "65536"]
        for node in range(spec.num_nodes):
            host = ["nsenter", f"--net={host_netns}", "tc", "qdisc"]
            inner = ["ip", "netns", "exec", spec.netns(node), "tc", "qdisc"]
            for prefix, dev in ((host, f"{spec.prefix}-h{node}"), (inner, f"{spec.prefix}-c{node}")):
                if mbit:
                    _sh(*prefix, "replace", "dev", dev, *tbf)
                else:
                    _sh(*prefix, "del", "dev", dev, "root", check=False)
        self.cross_bytes_per_s = mbit * 1e6 / 8 if mbit else None

    def _shape_intra(self, mbit: float | None) -> None:
        """tbf at `mbit` on every node's loopback, so both tiers are shaped (`ClusterSpec.intra_mbit`).

        Traffic between two processes of one node, to the node's own address, goes over its
        namespace's `lo`; cross-node traffic never does. Same peak rate as the veths; the peak
        bucket (tbf's `mtu`) is twice lo's MTU, since a loopback packet is lo's MTU plus its
        link header and tbf drops any packet larger than that bucket. None removes it.
        """
        spec = self.spec
        rate = max(1, int(mbit)) if mbit else 0
        for node in range(spec.num_nodes):
            if mbit:
                _sh("tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{rate}mbit", "burst",
                    str(max(spec.burst_bytes, 2 * LO_MTU)), "latency", "50ms", "peakrate",
                    f"{int(rate * 1.05) + 1}mbit", "mtu", str(2 * LO_MTU), netns=spec.netns(node))
            else:
                _sh("tc", "qdisc", "del", "dev", "lo", "root", netns=spec.netns(node), check=False)
        self.intra_bytes_per_s = mbit * 1e6 / 8 if mbit else None

    def set_cross_rate(self, mbit: float | None) -> None:
        """Change the cross-node rate of the running cluster; None lifts the shaping."""
        self._shape(mbit)
        logger.info("cross-node rate now %s", f"{mbit:.0f} Mbit/s" if mbit else "unshaped")

    def _start_ray(self) -> None:
        spec = self.spec
        ray_cli = str(Path(sys.executable).parent / "ray")
        common = ["--num-cpus", str(spec.cpus_per_node), "--object-store-memory", str(spec.object_store_bytes),
                  "--disable-usage-stats", f"--temp-dir={spec.temp_dir}",
                  "--include-log-monitor=false"]  # drivers here do not stream worker logs; saves CPU
        for node in range(spec.num_nodes):
            role = (["--head", "--port", str(spec.ray_port), "--include-dashboard=false"] if node == 0
                    else ["--address", self.ray_address])
            argv = [ray_cli, "start", "--node-ip-address", spec.node_ip(node), *role, *common]
            result = subprocess.run(["ip", "netns", "exec", spec.netns(node), *argv], capture_output=True,
                                    text=True, env=self._ray_env, timeout=180)
            if result.returncode:
                raise RuntimeError(f"ray start on node {node} failed: {result.stderr[-2000:]}")

    def run_in_node(self, node: int, argv: Sequence[str], env: dict[str, str] | None = None,
                    **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` inside node `node`'s namespace (RAY_ADDRESS and the node address set)."""
        full_env = {**self._ray_env, "RAY_ADDRESS": self.ray_address, "VELA_NODE_IP": self.spec.node_ip(node),
                    HOST_NETNS_ENV: f"/proc/{os.getpid()}/ns/net", **(env or {})}
        return subprocess.run(["ip", "netns", "exec", self.spec.netns(node), *argv], env=full_env, **kwargs)

    def probe_links(self, seconds: float = 3.0) -> dict:
        """TCP throughput inside node 0 (intra) and from node 0 to node 1 (cross), bytes/s, and their ratio.

        Each stream carries about `seconds` worth of data at the configured rates.
        """
        spec = self.spec
        intra_bytes = int(seconds * (self.intra_bytes_per_s or self.loopback_bytes_per_s or 2e9))
        cross_bytes = int(seconds * (self.cross_bytes_per_s or 1e8))
        intra = statistics.median(tcp_throughput(spec.node_ip(0), intra_bytes, spec.netns(0), spec.netns(0))
                                  for _ in range(3))
        cross = tcp_throughput(spec.node_ip(1), cross_bytes, spec.netns(1), spec.netns(0))
        return {"intra_bytes_per_s": intra, "cross_bytes_per_s": cross, "ratio": intra / cross,
                "configured_cross_bytes_per_s": self.cross_bytes_per_s,
                "configured_intra_bytes_per_s": self.intra_bytes_per_s,
                "loopback_bytes_per_s": self.loopback_bytes_per_s}

    def probe_ray_links(self) -> dict:
        """Bandwidth Ray objects reach from a driver in node 0 to an actor in node 0 and in node 1.

        The same echo probe the PlacementService runs (`actors.placement_service`), so
        it is what vela-ray's placement sees.
        """
        me = [sys.executable, str(Path(__file__).resolve()), "_ray_probe"]
        out = self.run_in_node(0, me, capture_output=True, text=True, timeout=300)
        if out.returncode:
            raise RuntimeError(f"Ray link probe failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def wire_bytes(self) -> list[int]:
        return wire_bytes(self.spec)


def wire_bytes(spec: ClusterSpec) -> list[int]:
    """Bytes each node has sent across its veth (cross-node traffic as the wire sees it, all protocols)."""
    return [int(_sh("cat", f"/sys/class/net/{spec.prefix}-c{n}/statistics/tx_bytes", netns=spec.netns(n)).stdout)
            for n in range(spec.num_nodes)]


def set_cross_rate(spec: ClusterSpec, mbit: float | None) -> None:
    """`EmulatedCluster.set_cross_rate` for a process that did not start the cluster (needs root)."""
    cluster = EmulatedCluster(spec)
    cluster.set_cross_rate(mbit)


def _ray_probe() -> None:
    """Subcommand `_ray_probe`, run as a driver inside node 0: echo bandwidth to node 0 and node 1 actors.

    Median of three PlacementService probes (this machine is shared and noisy).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from actors.placement_service import PlacementService, ray_ping

    class Echo:
        def ping(self, payload) -> int:  # what `ray_ping` calls
            return payload.numel()

    ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address=os.environ["VELA_NODE_IP"], log_to_driver=False)
    by_ip = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    nodes = [by_ip[os.environ["VELA_NODE_IP"]], by_ip[_neighbour_ip(os.environ["VELA_NODE_IP"])]]
    handles = [ray.remote(Echo).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
               .remote() for n in nodes]
    probes = [PlacementService(ray_ping(handles)).probe(range(len(handles)), repeats=3) for _ in range(3)]
    same, cross = (statistics.median(p[i].bandwidth_bytes_per_s for p in probes) for i in (0, 1))
    print(json.dumps({"same_node_bytes_per_s": same, "cross_node_bytes_per_s": cross, "ratio": same / cross,
                      "same_node_latency_s": statistics.median(p[0].latency_s for p in probes),
                      "cross_node_latency_s": statistics.median(p[1].latency_s for p in probes)}))
    ray.shutdown()


def _neighbour_ip(ip: str) -> str:
    """Node 1's address from node 0's (`<subnet>.1` -> `<subnet>.2`)."""
    head, last = ip.rsplit(".", 1)
    return f"{head}.{int(last) + 1}"


def ray_env() -> dict[str, str]:
    """Environment for one cluster's Ray processes: token auth on, no usage stats. The token is the caller's
    (RAY_AUTH_TOKEN), else the machine's (~/.ray/auth_token), else one made for this cluster: a fresh machine has
    none, and `ray start` with token auth refuses to run without one."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    if "RAY_AUTH_TOKEN" not in env and not (Path.home() / ".ray" / "auth_token").is_file():
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    return env


# --- command line -----------------------------------------------------------------------------------


def _spec_from(args: argparse.Namespace) -> ClusterSpec:
    return ClusterSpec(num_nodes=args.nodes, cpus_per_node=args.cpus_per_node, cross_mbit=args.cross_mbit,
                       intra_mbit=args.intra_mbit, prefix=args.prefix)


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
                         help="cross-node Mbit/s (default: intra rate / 15.6, the paper's ratio)")
        cmd.add_argument("--intra-mbit", type=float, default=None,
                         help="shape each node's loopback (intra-node) to this Mbit/s too (default: unshaped)")
        if name == "run":
            cmd.add_argument("cmd", nargs=argparse.REMAINDER, help="command to run in node 0 (after --)")
    sub.add_parser("_ray_probe")
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
    if args.command == "_ray_probe":
        _ray_probe()
        return 0
    if args.command == "down":
        down(args.prefix)
        return 0
    cluster = EmulatedCluster(_spec_from(args))
    if args.command == "probe":
        cluster._up = False  # probe a running cluster; never tear it down from here
        cluster.cross_bytes_per_s = cluster.loopback_bytes_per_s = None
        print(json.dumps({"tcp": cluster.probe_links(), "ray": cluster.probe_ray_links()}, indent=1))
        return 0
    cluster.up()
    print(json.dumps({"ray_address": cluster.ray_address, "tcp": cluster.probe_links(),
                      "ray": cluster.ray_links or cluster.probe_ray_links()}, indent=1))
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
