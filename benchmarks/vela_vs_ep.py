"""vela-ray against expert parallelism on an emulated 3-node cluster (the VELA paper's Sec. V, Figs. 5-6).

Reads top to bottom:
  1. bring up the emulated cluster (deploy/emulated_cluster.py): 3 nodes, each a
     network namespace with its own Ray node, cross-node links shaped with tc to
     1/15.6 of the intra-node rate (the paper's 18.3 vs 1.17 GB/s), and probe the
     links (TCP, and Ray objects as the placement service sees them);
  2. inside node 0 (the master's node), for each data set (WikiText-2, GSM8K in
     Alpaca format) fine-tune the tiny pre-trained Mixtral for `--steps` steps with
     expert parallelism (6 ranks, 2 per node, all-to-all over gloo) and with
     vela-ray (master on node 0, 6 ExpertManagers, 2 per node) under the
     sequential, random, `vela` (the paper's LP) and `improved` placements, and with a master on
     every node (`per_node`: `masters.count` = nodes, improved placement with replicas), and with a
     tensor-parallel master (`tp2`: `cluster.master_tp: 2` on node 0, improved placement);
  3. per method: cross-node bytes per node per step (the broker's counters, as
     the paper's Fig. 5; EP adds its backbone all-reduce, estimated as a ring),
     median step time and its ratio to EP (Fig. 6), the step the cost model predicts
     against the measured one, in parts (`vela_vs_ep_report.step_prediction`; EP's from
     its all-to-alls, `ep_step_prediction`), final loss; `--unshaped-methods` are run
     again for `--unshaped-steps` steps on the first data set, right after their shaped
     run, with the rate lifted; the machine's CPU is sampled through every run (`CpuSampler`);
  4. the paper-scale simulation (benchmarks/paper_scale.py): the cost model at
     Mixtral-8x7B scale on the paper's cluster, with our measured profiles;
  5. write results.md (tables), results.json (raw numbers), traffic_over_steps.png
     and step_time.png to benchmarks/results/vela_vs_ep/.

Run (as root, ~15 minutes on 2 cores):  python benchmarks/vela_vs_ep.py

`--paper` (issue 38): the paper's Sec. V conditions as far as one machine allows: BOTH tiers
shaped (each node's loopback at `--intra-mbit`, 1600 by default, and its veth at 1/15.6 of
that, so the measured TCP ratio is the paper's 15.6 rather than loopback-vs-veth), 500 steps
(`--steps`), WikiText-2 and `alpaca` (the 175 Alpaca seed tasks + GSM8K in Alpaca format),
methods EP, sequential, random, the paper's VELA (`paper_placement`: solver vela,
shared_links none, the whole data set profiled) and vela-ray's defaults (`improved`), no
unshaped reruns; also writes paper.md / paper.json / fig5_traffic.png / fig6_step_time.png
(`vela_vs_ep_report.write_paper`: our bars and the paper's ranges side by side) to
benchmarks/results/vela_paper/. Ray's same-node object store is shared memory and not
shaped; the collective plane (gloo, TCP) and EP's all-to-all are.
Without network namespaces: `--no-emulate` runs on an unshaped ray.cluster_utils
cluster (3 Ray nodes on one loopback; cross-node bytes are still counted, but
cross-node links are not slower, which the table says).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/vela_vs_ep.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks import vela_vs_ep_report as report  # noqa: E402
from benchmarks._harness import (  # noqa: E402
    ALPACA_MIX, WIKITEXT, Sampler, alpaca_mix, parser, run, tiny_job, write_results)
from deploy.emulated_cluster import ClusterSpec, EmulatedCluster, set_cross_rate, wire_bytes  # noqa: E402
from vela_ray.paths import data_dir  # noqa: E402

logger = logging.getLogger("vela_vs_ep")
RESULTS = ROOT / "benchmarks" / "results" / "vela_vs_ep"
PAPER_RESULTS = ROOT / "benchmarks" / "results" / "vela_paper"
METHODS = ("ep", "sequential", "random", "vela", "improved", "per_node", "tp2")
PAPER_METHODS = ("ep", "sequential", "random", "vela", "improved")
PAPER_INTRA_MBIT = 1600.0  # --paper's intra-node rate: 200 MB/s, what 2 cores carry with room to spare
DATASETS = {
    "wikitext": {"kind": "text", "path": WIKITEXT},
    "gsm8k_alpaca": {"kind": "instruct", "path": data_dir() / "instruct" / "gsm8k_alpaca.json"},
    # --paper's Alpaca: the 175 Alpaca seed tasks (first instance each) + GSM8K in Alpaca format, shuffled
    "alpaca": {"kind": "instruct", "path": ALPACA_MIX},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, RESULTS, what="output directory")
    p.add_argument("--paper", action="store_true",
                   help="the paper's conditions (Sec. V): both tiers shaped (intra-node --intra-mbit, cross-node "
                        "1/15.6 of it), 500 steps, WikiText-2 and Alpaca (seed tasks + GSM8K), methods EP, "
                        "sequential, random, the paper's VELA (solver vela, shared_links none, the whole data "
                        "set profiled) and vela-ray's defaults; writes Figs. 5-6 and the table beside the "
                        "paper's numbers to benchmarks/results/vela_paper/")
    p.add_argument("--intra-mbit", type=float, default=None,
                   help="shape intra-node links (each node's loopback) to this Mbit/s (--paper: 1600)")
    p.add_argument("--steps", type=int, default=None, help="fine-tuning steps per method and data set "
                                                           "(default 16; --paper: 500)")
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of step-time medians")
    p.add_argument("--unshaped-steps", type=int, default=8,
                   help="steps run again with the links unshaped to measure communication time (0: skip)")
    p.add_argument("--unshaped-methods", nargs="+", default=list(METHODS), choices=METHODS,
                   help="methods run again unshaped (on the first data set only, to stay under 20 minutes)")
    p.add_argument("--datasets", nargs="+", default=None, choices=list(DATASETS),
                   help="data sets (default wikitext gsm8k_alpaca; --paper: wikitext alpaca)")
    p.add_argument("--methods", nargs="+", default=None, choices=METHODS,
                   help="methods to compare (default all; --paper: ep sequential random vela improved)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per step, global (the paper: 8)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="rows per micro-batch of vela-ray's runs (training.micro_batch_size; default: the whole batch)")
    p.add_argument("--in-flight", type=int, default=1,
                   help="micro-batches vela-ray's masters run at once (training.overlap.micro_batches_in_flight; 1: "
                        "the serial step)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per row")
    p.add_argument("--limit", type=int, default=1500, help="rows / examples read from each data set")
    p.add_argument("--lr", type=float, default=3e-5, help="peak learning rate (the paper: 3e-5)")
    p.add_argument("--nodes", type=int, default=3, help="emulated nodes")
    p.add_argument("--workers-per-node", type=int, default=2, help="ExpertManagers (EP ranks) per node")
    p.add_argument("--capacity", type=int, default=8,
                   help="experts per worker (32 experts / 6 workers = 5.3; 8 is 1.5x, as the simulation)")
    p.add_argument("--transport", default="collective", choices=["object_ref", "collective"],
                   help="vela-ray's master-worker transport with one master (a master per node: object_ref)")
    p.add_argument("--calibrate", default="ray", choices=["ray", "loopback"],
                   help="intra-node rate divided by --ratio to set the cross-node rate: what Ray moves "
                        "between two processes of a node (what vela-ray sees), or raw TCP loopback")
    p.add_argument("--ratio", type=float, default=18.3 / 1.17, help="intra:cross bandwidth ratio")
    p.add_argument("--cross-mbit", type=float, default=None, help="fixed cross-node Mbit/s (overrides calibration)")
    p.add_argument("--no-emulate", action="store_true",
                   help="unshaped ray.cluster_utils cluster instead of namespaces (no root needed)")
    p.add_argument("--max-load", type=float, default=3.0,
                   help="start each run once the 1-minute load average is below this (shared machine)")
    p.add_argument("--max-wait-s", type=float, default=20.0, help="longest wait for --max-load before a run")
    p.add_argument("--render", action="store_true",
                   help="run nothing: rebuild --out's tables and plots from the raw runs in its results.json "
                        "(after a change to the report or the cost model)")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # the driver inside node 0
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    p.add_argument("--raw", type=Path, default=None, help=argparse.SUPPRESS)  # where the inner driver writes
    return paper_defaults(p.parse_args(argv), argv)


def paper_defaults(args: argparse.Namespace, argv=None) -> argparse.Namespace:
    """Fill what was left unset: the paper's conditions with --paper, the usual defaults without."""
    given = set(sys.argv[1:] if argv is None else argv)
    if args.paper:
        args.steps = 500 if args.steps is None else args.steps
        args.datasets = args.datasets or ["wikitext", "alpaca"]
        args.methods = args.methods or list(PAPER_METHODS)
        args.intra_mbit = args.intra_mbit or PAPER_INTRA_MBIT
        if "--unshaped-steps" not in given:
            args.unshaped_steps = 0  # the paper measures no unshaped reference
        if "--max-wait-s" not in given:
            args.max_wait_s = 5.0
        if "--out" not in given and args.out == RESULTS:
            args.out = PAPER_RESULTS
    else:
        args.steps = 16 if args.steps is None else args.steps
        args.datasets = args.datasets or ["wikitext", "gsm8k_alpaca"]
        args.methods = args.methods or list(METHODS)
    return args


# --- 2. one run --------------------------------------------------------------------------------------


def job_dict(args, dataset: str, method: str, steps: int, out_dir: Path) -> dict:
    from vela_ray.training.tiny_model import tiny_model_path

    data = DATASETS[dataset]
    if dataset == "alpaca":
        alpaca_mix(limit=args.limit)
    solver = {"ep": "sequential", "per_node": "improved", "tp2": "improved"}.get(method, method)
    per_node = method == "per_node"  # issue 15: a data-parallel master on every node, hot experts copied
    tp = 2 if method == "tp2" else 1  # issue 37: master 0's backbone over two ranks of node 0
    placement = {"solver": solver, "profile": "measure", "profile_batches": 4, "capacity": args.capacity,
                 "cost_model": "communication+compute" if solver == "improved" else "communication",
                 "replicas": per_node}
    if getattr(args, "paper", False):
        placement = paper_placement(method, args)
    return tiny_job(
        out_dir, tiny_model_path(build=False),
        data={"kind": data["kind"], "path": str(data["path"]), "seq_len": args.seq_len, "limit": args.limit},
        cluster={"num_workers": args.nodes * args.workers_per_node, "workers_per_node": args.workers_per_node,
                 "num_cpus_per_worker": 1.0, "master_tp": tp},
        data_plane={"transport": "object_ref" if per_node or tp > 1 else args.transport},
        masters={"count": args.nodes if per_node else 1},
        # The paper's LP minimises communication only; `improved` is vela-ray's best: it also weighs
        # each worker's measured expert compute (sequential and random ignore the cost model).
        placement=placement,
        training={"steps": steps, "batch_size": args.batch_size, "eval_batches": 1, "optimizer": {"lr": args.lr},
                  # vela-ray's runs only: EP's ranks split the batch among themselves
                  "micro_batch_size": None if method == "ep" else getattr(args, "micro_batch_size", None),
                  "overlap": {"micro_batches_in_flight": getattr(args, "in_flight", 1)}})


def paper_placement(method: str, args) -> dict:
    """--paper's placement section of each method.

    `vela` is the paper's method: its LP (solver vela), independent master-worker links
    (shared_links none), communication only, the profile taken as the paper takes it ("we pass
    the dataset through the model": every training batch of the --limit rows, not 4).
    `improved` is vela-ray as a user gets it: PlacementSection's defaults (improved solver,
    shared_links measure, a 4-batch profile, communication cost model) and the benchmark's capacity.
    `ep`, `sequential`, `random` take no profile-based decision (EP runs its own sequential layout).
    """
    if method == "vela":
        return {"solver": "vela", "profile": "measure", "profile_batches": max(1, args.limit // args.batch_size),
                "shared_links": "none", "cost_model": "communication", "capacity": args.capacity}
    if method == "improved":
        return {"solver": "improved", "profile": "measure", "capacity": args.capacity}  # the rest: defaults
    return {"solver": "sequential" if method == "ep" else method, "profile": "measure", "profile_batches": 4,
            "shared_links": "none", "capacity": args.capacity}


def wait_for_quiet(max_load: float, max_wait_s: float) -> float:
    """Wait (up to `max_wait_s`) until the 1-minute load average is under `max_load`; return it.

    This machine is shared: a burst of someone else's work would land in one method's
    steps only, so each run starts when the machine is quiet (or after the wait).
    """
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


class CpuSampler(Sampler):
    """The machine's busy CPU seconds (every core, every process: /proc/stat through psutil) and master 0's
    (the processes whose title starts with `master_title`: Ray names an actor's process after its class), sampled
    every `interval_s` on a daemon thread while the block runs: `samples` = [[seconds since start, machine busy
    seconds, master CPU seconds]].

    On the emulated cluster every node shares this machine's cores, so this is what a run costs in CPU time,
    how close it came to the cores' limit and how much of it master 0's process took (`busy_fraction`)."""

    def __init__(self, interval_s: float = 0.25, master_title: str = "ray::MasterActor"):
        super().__init__(interval_s)
        self.master_title, self.samples = master_title, []
        self._start, self._base = time.perf_counter(), self.busy_s()

    @staticmethod
    def busy_s() -> float:
        import psutil

        times = psutil.cpu_times()
        return sum(times) - times.idle - getattr(times, "iowait", 0.0)

    def master_s(self) -> float:
        """CPU seconds so far of the processes titled `master_title` (0 while there is none)."""
        import psutil

        total = 0.0
        for process in psutil.process_iter(["cmdline", "cpu_times"]):
            cmdline, times = process.info["cmdline"], process.info["cpu_times"]
            if cmdline and times and cmdline[0].startswith(self.master_title):
                total += times.user + times.system
        return total

    def sample(self) -> None:
        self.samples.append([time.perf_counter() - self._start, self.busy_s() - self._base, self.master_s()])

    def record(self) -> dict:
        return {"cores": os.cpu_count(), "samples": [[round(v, 3) for v in sample] for sample in self.samples]}


def busy_fraction(cpu: dict, start_s: float, end_s: float) -> dict | None:
    """Between two times of a run's `CpuSampler.record`: "machine", its busy share of all its cores, and
    "master", the cores master 0's process kept busy (None: no samples there)."""
    inside = [sample for sample in cpu["samples"] if start_s <= sample[0] <= end_s]
    if len(inside) < 2:
        return None
    (t0, *first), (t1, *last) = inside[0], inside[-1]
    machine = (last[0] - first[0]) / ((t1 - t0) * cpu["cores"])
    return {"machine": machine, "master": (last[1] - first[1]) / (t1 - t0) if len(last) > 1 else None}


def run_one(args, dataset: str, method: str, steps: int, spec: ClusterSpec | None) -> dict:
    """One fine-tuning run: {"summary": its RunSummary as JSON data, "wall_s", "loadavg_1m", "wire_bytes_by_node"}.

    The summary is read back from output.dir (both modes write it), so this does not depend on
    what each runner returns.
    """
    from actors.expert_parallel import run_expert_parallel
    from vela_ray.api import VelaJob
    from vela_ray.config import JobConfig
    from vela_ray.training.summary import RunSummary

    out_dir = Path(tempfile.mkdtemp(prefix=f"vela-vs-ep-{method}-"))
    config = JobConfig.from_dict(job_dict(args, dataset, method, steps, out_dir))
    load_before = wait_for_quiet(args.max_load, args.max_wait_s)
    wire_before = wire_bytes(spec) if spec else None
    start = time.perf_counter()
    try:
        with CpuSampler() as cpu:
            run_expert_parallel(config) if method == "ep" else VelaJob(config).run()
        summary = RunSummary.load(out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    run = {"summary": summary.model_dump(mode="json"), "wall_s": time.perf_counter() - start, "cpu": cpu.record(),
           "loadavg_1m": [load_before, os.getloadavg()[0]],
           "wire_bytes_by_node": [a - b for a, b in zip(wire_bytes(spec), wire_before)] if spec else None}
    logger.info("%s / %s: median step %.3f s, loss %.4f, %.0f s wall, load %.1f -> %.1f", dataset, method,
                summary.median_step_time_s, summary.losses[-1], run["wall_s"], *run["loadavg_1m"])
    return run


def run_job(args, job: dict, label: str, spec: ClusterSpec | None) -> dict:
    """One vela-ray run of `job` (its output.dir a fresh temporary directory, removed after), started once the
    machine is quiet: {"summary": its RunSummary as JSON data, "job", "wall_s", "loadavg_1m", "wire_bytes_by_node"}
    (the benchmarks that bring their own jobs to the cluster: replacement_drift.py, overlap.py)."""
    from vela_ray.api import VelaJob
    from vela_ray.config import JobConfig
    from vela_ray.training.summary import RunSummary

    out_dir = Path(tempfile.mkdtemp(prefix=f"{label.replace(' ', '-')}-"))
    job = {**job, "output": {**job.get("output", {}), "dir": str(out_dir)}}
    config = JobConfig.from_dict(job, source=f"{label} job")
    load_before = wait_for_quiet(args.max_load, args.max_wait_s)
    wire_before = wire_bytes(spec) if spec else None
    start = time.perf_counter()
    try:
        with CpuSampler() as cpu:
            VelaJob(config).run()
        summary = RunSummary.load(out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {"summary": summary.model_dump(mode="json"), "job": job, "wall_s": time.perf_counter() - start,
            "cpu": cpu.record(),
            "loadavg_1m": [load_before, os.getloadavg()[0]],
            "wire_bytes_by_node": [a - b for a, b in zip(wire_bytes(spec), wire_before)] if spec else None}


def serial_compute(args, dataset: str) -> dict:
    """Median step time of single-process vela-ray on one thread: the step's arithmetic with no transport."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vela_ray.config import JobConfig
    from vela_ray.data.datasets import batch_at, build_dataset
    from placement import sequential_table
    from vela_ray.model.experts import LoraSpec
    from vela_ray.training.master import build_local
    from vela_ray.training.step import train_step

    config = JobConfig.from_dict(job_dict(args, dataset, "sequential", args.steps, Path(tempfile.gettempdir())))
    train_set, _ = build_dataset(config.data, AutoTokenizer.from_pretrained(config.model.path)).split(0.05, 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(config.model.path)
        table = sequential_table(4, 8, args.nodes * args.workers_per_node)
        master, workers = build_local(model, table, LoraSpec(), config.training.optimizer)
        times = []
        for step in range(min(args.steps, 16)):  # a reference only: 16 steps are enough for a median
            start = time.perf_counter()
            train_step(master, workers, [batch_at(train_set, step, args.batch_size, 0)], args.lr, 1.0)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return {"median_step_time_s": float(np.median(times[args.warmup_steps:] or times)), "step_times_s": times}


def run_grid(args, spec: ClusterSpec | None, cross_mbit: float | None) -> dict:
    """Every (data set, method) shaped; on the first data set, `--unshaped-methods` again right after
    their shaped run with the cross-node rate lifted (back to back, so machine load drifts less between them)."""
    runs: dict[str, dict[str, dict]] = {}
    unshaped: dict[str, dict[str, dict]] = {}
    serial = {dataset: serial_compute(args, dataset) for dataset in args.datasets}
    for index, dataset in enumerate(args.datasets):
        runs[dataset] = {}
        for method in args.methods:
            runs[dataset][method] = run_one(args, dataset, method, args.steps, spec)
            if index == 0 and spec is not None and args.unshaped_steps and method in args.unshaped_methods:
                set_cross_rate(spec, None)
                try:
                    again = run_one(args, dataset, method, args.unshaped_steps, spec)
                    unshaped.setdefault(dataset, {})[method] = again
                finally:
                    set_cross_rate(spec, cross_mbit)
    return {"runs": runs, "unshaped": unshaped, "serial_compute": serial, "cores": os.cpu_count()}


Work = Callable[[argparse.Namespace, "ClusterSpec | None", "float | None"], dict]
"""What a benchmark runs on the cluster: (args, emulated cluster spec or None, cross-node Mbit/s or None)
-> raw results (JSON data). `run_grid` is this script's; benchmarks/replacement_drift.py brings its own."""


def inner_main(args, work: Work) -> None:
    """The driver inside node 0: connect to the emulated cluster, run `work`, dump its raw results."""
    import ray

    spec = ClusterSpec.model_validate_json(args.spec) if args.spec else None
    ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address=os.environ["VELA_NODE_IP"],
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}, log_to_driver=False)
    try:
        raw = work(args, spec, float(os.environ["VELA_CROSS_MBIT"]))
    finally:
        ray.shutdown()
    write_results(args.raw, raw)


def run_unshaped_cluster(args, work: Work) -> dict:
    """`--no-emulate`: 3 Ray nodes on one loopback (ray.cluster_utils), nothing shaped."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.workers_per_node})
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=args.workers_per_node)
    ray.init(address=cluster.address, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
             log_to_driver=False)
    try:
        return work(args, None, None)
    finally:
        ray.shutdown()
        cluster.shutdown()


# --- 1. + 5. the outer driver ------------------------------------------------------------------------


def emulated(args, script: Path) -> tuple[dict, dict]:
    """Bring the cluster up, run `script --inner` (its `inner_main`) inside node 0, return (raw results,
    link probes). The script's own arguments are passed on."""
    intra = getattr(args, "intra_mbit", None)
    spec = ClusterSpec(num_nodes=args.nodes, cpus_per_node=args.workers_per_node, ratio=args.ratio,
                       cross_mbit=args.cross_mbit or (intra / args.ratio if intra else None),
                       intra_mbit=intra, calibrate=args.calibrate)
    with EmulatedCluster(spec) as cluster:
        links = {"tcp": cluster.probe_links(), "ray": cluster.probe_ray_links(),
                 "cross_mbit": cluster.cross_bytes_per_s * 8 / 1e6, "calibrate": args.calibrate,
                "intra_mbit": intra}
        logger.info("links: %s", json.dumps(links))
        raw = Path(tempfile.mkdtemp(prefix=f"{script.stem}-")) / "raw_runs.json"
        argv = [sys.executable, str(script.resolve()), "--inner", "--spec", spec.model_dump_json(),
                "--raw", str(raw), *sys.argv[1:]]
        result = cluster.run_in_node(0, argv, env={"VELA_CROSS_MBIT": str(links["cross_mbit"])}, cwd=ROOT)
        if result.returncode:
            raise SystemExit(f"the benchmark driver in node 0 failed with exit code {result.returncode}")
    grid = json.loads(raw.read_text())
    shutil.rmtree(raw.parent, ignore_errors=True)
    return grid, links


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.inner:
        inner_main(args, run_grid)
        return
    if args.render:
        render(args.out)
        return
    start = time.perf_counter()
    if args.no_emulate:
        grid, links = run_unshaped_cluster(args, run_grid), {"note": "unshaped ray.cluster_utils cluster, one loopback"}
    else:
        grid, links = emulated(args, Path(__file__))
    results = report.build_results(args, grid, links)
    results["benchmark_wall_s"] = time.perf_counter() - start
    report.write_all(results, args.out)
    print(report.markdown(results))
    if args.paper:
        report.write_paper(results, args.out)


def render(out: Path) -> None:
    """Tables and plots again from a results.json's raw runs, with the settings they ran under."""
    saved = json.loads((out / "results.json").read_text())
    settings = {**saved["settings"], "out": out, "no_emulate": not saved["shaped"]}
    results = report.build_results(argparse.Namespace(**settings), saved["raw"], saved["links"])
    results["benchmark_wall_s"] = saved.get("benchmark_wall_s")
    report.write_all(results, out)
    print(report.markdown(results))
    if settings.get("paper"):
        report.write_paper(results, out)


if __name__ == "__main__":
    run(main)
