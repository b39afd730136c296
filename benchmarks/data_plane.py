"""Benchmark: the broker's data plane, every transport and Ray setting side by side.

One MoE layer's forward + backward round trip from the broker to N real
ExpertManagers (synthetic experts), with the rows a small model sends (hidden D,
T tokens, top-2: ~R/N rows of D floats per worker), through:

    ray_default       RayObjectRefTransport, Ray as shipped: tensors pickled by torch,
                      args/results over 100 KiB go through the object store
    inline            + RAY_max_direct_call_object_size = data_plane.inline_bytes: rows and
                      results ride inside the task RPC
    inline_zero_copy  + RAY_ENABLE_ZERO_COPY_TORCH_TENSORS (the object-ref default,
                      `actors.transports.data_plane_env`)
    collective        the collective data plane: torch.distributed (gloo) point-to-point to
                      each ExpertManager's serving loop (`vela_ray.model.collective`)
    rdt_gloo          Ray Direct Transport: actor methods returning tensors with
                      `@ray.method(tensor_transport="gloo")`, the actors in a group from
                      `ray.experimental.collective.create_collective_group`. The driver cannot
                      join that group, and a gloo RDT object reaches a process only as an
                      argument of a task on it, so the broker runs in a master actor that stages
                      each worker's rows in a task on itself and collects the results in
                      another (`RdtMaster`); the env is the object-ref default's
    collective_bf16   the collective plane with `data_plane.row_format: bfloat16` (LOSSY): rows, results
    collective_fp8    and gradients in bf16, or float8 with a scale per row (`vela_ray.model.wire`)
    raw_p2p           the floor: the same experts in plain processes, the same rows over
                      gloo point-to-point with no headers, no Ray, shapes known in advance
    raw_p2p_header    the floor plus one small header before each payload, which the worker
                      reads before it posts the payload's receive (as the collective plane must:
                      shapes vary per layer). gloo sends a message only once its receive is
                      posted, so this costs each payload a round trip

The compiled-graph transport was measured here too (78 ms against the collective plane's
45 ms, results/data_plane.json of commit 4d4c48f) and removed for it.
Ray Direct Transport costs per tensor a task that makes it, a send task and a receive task
(one `_ray_system` thread per actor runs them in turn), and the master a task to collect the
results: 125-157 ms against the collective plane's 28-30 ms on 2 shared cores (load ~5).

Each setting runs in its own subprocess with its own local Ray (the Ray variables are
read when a Ray process starts); settings alternate over `--rounds` so that a burst
of load on this shared machine hits all of them.

    python benchmarks/data_plane.py                     # D=128, T=1024, N=6
    python benchmarks/data_plane.py --hidden 1024 --tokens 2048
    python benchmarks/data_plane.py --settings collective collective_bf16 collective_fp8 raw_p2p \
        --hidden 1024 --out benchmarks/results/data_plane_low_bit.json

Results: a table of median round-trip ms and ratios, and benchmarks/results/data_plane.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from itertools import count
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python benchmarks/data_plane.py`: the root, for benchmarks._harness
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import command, parser, run, write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "data_plane.json"
SETTINGS = ("ray_default", "inline", "inline_zero_copy", "rdt_gloo", "collective", "collective_bf16",
            "collective_fp8", "raw_p2p", "raw_p2p_header")
ROW_FORMATS = {"collective_bf16": "bfloat16", "collective_fp8": "float8"}  # the rest: exact


def parse_args(argv=None) -> argparse.Namespace:
    p = parser(__doc__, RESULTS)
    p.add_argument("--hidden", type=int, default=128, help="hidden size D (the tiny demo model's)")
    p.add_argument("--intermediate", type=int, default=256, help="expert intermediate size")
    p.add_argument("--experts", type=int, default=8, help="experts per layer")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per layer (batch 8 x 128)")
    p.add_argument("--workers", type=int, default=6, help="ExpertManagers")
    p.add_argument("--iters", type=int, default=40, help="timed round trips per setting and round")
    p.add_argument("--rounds", type=int, default=2, help="times each setting runs, alternating")
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS), help="settings to run")
    p.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def setting_env(setting: str) -> dict[str, str]:
    from actors.transports import data_plane_env
    from vela_ray.config import DataPlaneSection

    inline = DataPlaneSection().inline_bytes
    return {"ray_default": {}, "inline": data_plane_env(inline, False)}.get(setting, data_plane_env(inline, True))


def specs(args) -> tuple:
    """(placement table [1, E], one ExpertManagerSpec per worker): E synthetic Mixtral experts, e mod N."""
    import torch
    from transformers import MixtralConfig

    from vela_ray.training.expert_manager import ExpertManagerSpec

    g = torch.Generator().manual_seed(0)
    D, I, E, N = args.hidden, args.intermediate, args.experts, args.workers
    config = MixtralConfig(hidden_size=D, intermediate_size=I, num_local_experts=E, num_hidden_layers=1)
    return torch.tensor([[e % N for e in range(E)]]), [
        ExpertManagerSpec(worker=n, keys=[(0, e) for e in range(E) if e % N == n], hf_config=config,
                          weights={(0, e): {"gate_up_proj": torch.randn(2 * I, D, generator=g) * 0.05,
                                            "down_proj": torch.randn(D, I, generator=g) * 0.05}
                                   for e in range(E) if e % N == n})
        for n in range(N)]


def transport_for(setting: str, cluster):
    from actors.transports import RayObjectRefTransport, collective_transport

    tiers = cluster.worker_tiers()
    if setting.startswith("collective"):
        return collective_transport(cluster.handles, tiers)
    return RayObjectRefTransport(cluster.handles, tiers, zero_copy=setting == "inline_zero_copy")


def child(args) -> dict:
    """Time one setting in this process (its env was set by the parent); returns per-iteration seconds."""
    import torch

    from vela_ray.model.broker import ExpertDispatcher

    # The master as vela-ray runs it: a MasterActor asks Ray for no CPU, so Ray starts it with
    # OMP_NUM_THREADS=1. A driver left at torch's default keeps an OpenMP worker spinning
    # (gomp_barrier_wait_end) between the broker's ops, and on 2 cores that spin takes the CPU the
    # six workers need: the collective plane took 37 ms a trip with it, 28 ms without (side by side).
    torch.set_num_threads(1)
    table, worker_specs = specs(args)
    g = torch.Generator().manual_seed(1)
    hidden_TD = torch.randn(args.tokens, args.hidden, generator=g)
    top_k = torch.randint(0, args.experts, (args.tokens, 2), generator=g)
    if args.child.startswith("raw_p2p"):
        return raw_p2p(args, table, worker_specs, hidden_TD, top_k, header=args.child == "raw_p2p_header")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    if args.child == "rdt_gloo":
        return rdt_gloo(args, table, worker_specs, hidden_TD, top_k)
    from actors.cluster import spawn_expert_managers

    cluster = spawn_expert_managers(worker_specs, num_cpus_per_worker=0.25, env_vars=setting_env(args.child))
    transport = transport_for(args.child, cluster)
    dispatcher = ExpertDispatcher(table, transport, row_format=ROW_FORMATS.get(args.child, "exact"))
    plan = dispatcher.plan(0, top_k)
    rows_RD = hidden_TD.index_select(0, plan.token_idx_R)
    seconds = []
    for i in range(args.iters + 3):  # 3 warm-up trips
        start = time.perf_counter()
        out_RD = dispatcher.forward(plan, rows_RD, key=i)
        dispatcher.backward(plan, torch.ones_like(out_RD), key=i)
        seconds.append(time.perf_counter() - start)
    transport.close()
    ray.shutdown()
    return {"seconds": seconds[3:], "rows_per_worker": [e - s for _, s, e in plan.worker_rows],
            "bytes_per_trip": dispatcher.traffic().total_bytes() // len(seconds)}


def rdt_gloo(args, table, worker_specs, hidden_TD, top_k) -> dict:
    """Ray Direct Transport over gloo: the broker in `RdtMaster`, the experts in `RdtExpertManager`s."""
    env = {"runtime_env": {"env_vars": setting_env("rdt_gloo")}}
    workers = [RdtExpertManager.options(num_cpus=0.25, **env).remote(spec) for spec in worker_specs]
    master = RdtMaster.options(num_cpus=0.25, **env).remote(table, workers)
    ray.get(master.form_group.remote())
    result = ray.get(master.time_round_trips.remote(hidden_TD, top_k, args.iters + 3))
    ray.shutdown()
    return {"seconds": result["seconds"][3:], "rows_per_worker": result["rows_per_worker"]}


@ray.remote
class RdtExpertManager:
    """An ExpertManager whose results leave over gloo; its rows arrive over gloo as an RDT argument."""

    def __init__(self, spec):
        from vela_ray.training.expert_manager import ExpertManager

        self.manager = ExpertManager(spec)

    @ray.method(tensor_transport="gloo")
    def forward(self, rows_RD, layer: int, expert_ids_R, key):
        return self.manager.forward_rows(layer, expert_ids_R, rows_RD, key)

    @ray.method(tensor_transport="gloo")
    def backward(self, grad_RD, key):
        return self.manager.backward_rows(key, grad_RD)


@ray.remote(max_concurrency=4)  # threads: `stage` and `collect` run while a round trip waits on them
class RdtMaster:
    """The broker (`ExpertDispatcher`) in an actor of the gloo group, with itself as its `Transport`.

    A gloo RDT object moves only when it is an argument of another actor's task, and the caller
    that owns it issues the send and the receive (`__ray_send__`, `__ray_recv__` tasks). So rows go
    out as the result of `stage` (a task on this actor) passed to the worker's method, and the
    results come back as arguments of `collect` (another task on this actor).
    """

    def __init__(self, table, workers: list):
        from vela_ray.model.broker import ExpertDispatcher
        from vela_ray.model.traffic import link_tiers

        self.workers, self.num_workers = workers, len(workers)
        self.tiers = link_tiers("node", ["node"] * len(workers))  # all on this node, in other processes
        self.slots, self.outbox, self.inbox = count(), {}, {}
        self.dispatcher = ExpertDispatcher(table, self)

    def form_group(self) -> None:
        """This actor rank 0, worker n rank n + 1; formed here, as the group lives in its creator's process."""
        from ray.experimental.collective import create_collective_group

        create_collective_group([ray.get_runtime_context().current_actor] + self.workers, backend="gloo")

    @ray.method(tensor_transport="gloo")
    def stage(self, slot: int):
        return self.outbox.pop(slot)

    def collect(self, slot: int, *tensors) -> None:
        self.inbox[slot] = tensors

    def time_round_trips(self, hidden_TD, top_k, iterations: int) -> dict:
        """The same loop as `child`, run here: seconds per forward + backward."""
        plan = self.dispatcher.plan(0, top_k)
        rows_RD = hidden_TD.index_select(0, plan.token_idx_R)
        seconds = []
        for i in range(iterations):
            start = time.perf_counter()
            self.round_trip(plan, rows_RD, key=i)
            seconds.append(time.perf_counter() - start)
        return {"seconds": seconds, "rows_per_worker": [e - s for _, s, e in plan.worker_rows]}

    def round_trip(self, plan, rows_RD, key) -> tuple:
        """`child`'s timed body: (expert outputs [R, D], d rows [R, D] for d outputs of ones)."""
        import torch

        out_RD = self.dispatcher.forward(plan, rows_RD, key=key)
        return out_RD, self.dispatcher.backward(plan, torch.ones_like(out_RD), key=key)

    # -- Transport (`vela_ray.model.transport`) --

    def forward(self, requests: dict) -> dict:
        return self._fan_out({w: (self.workers[w].forward, r.rows, (r.layer, r.expert_ids.clone(), r.key))
                              for w, r in requests.items()})

    def backward(self, key, grads: dict) -> dict:
        return self._fan_out({w: (self.workers[w].backward, grad, (key,)) for w, grad in grads.items()})

    def worker_tiers(self) -> list:
        return self.tiers

    def _fan_out(self, calls: dict) -> dict:
        """{worker: (method, tensor, args)} -> {worker: method(tensor, *args)}, both tensors over gloo."""
        me = ray.get_runtime_context().current_actor
        results = {}
        for worker, (method, tensor, method_args) in calls.items():
            slot = next(self.slots)
            self.outbox[slot] = tensor.contiguous()
            results[worker] = method.remote(me.stage.remote(slot), *method_args)
        slot = next(self.slots)
        ray.get(me.collect.remote(slot, *results.values()))
        return dict(zip(results, self.inbox.pop(slot)))


def raw_p2p(args, table, worker_specs, hidden_TD, top_k, header: bool = False) -> dict:
    """The floor: ExpertManagers in plain processes, rows and results over gloo send/recv, nothing else
    (`header`: a 6-int64 header before each payload, read by the worker before it posts the payload's receive)."""
    import torch
    import torch.multiprocessing as mp

    from vela_ray.model.broker import ExpertDispatcher
    from vela_ray.model.collective import make_group, make_store
    from vela_ray.model.transport import InProcessTransport

    plan = ExpertDispatcher(table, InProcessTransport([None] * args.workers)).plan(0, top_k)
    rows_RD = hidden_TD.index_select(0, plan.token_idx_R)
    store = make_store("127.0.0.1", 0, args.workers + 1, is_master=True, timeout_s=120)
    requests = {w: (plan.expert_ids_R[s:e], rows_RD[s:e]) for w, s, e in plan.worker_rows}
    procs = [mp.get_context("spawn").Process(target=_raw_worker, args=(
        store.port, args.workers + 1, spec, requests.get(spec.worker), args.iters + 3, header)) for spec in worker_specs]
    for proc in procs:
        proc.start()
    group = make_group(store, 0, args.workers + 1, 120)
    seconds = []
    for _ in range(args.iters + 3):
        start = time.perf_counter()
        outs = _raw_round(group, {w: rows for w, (_, rows) in requests.items()}, header)
        _raw_round(group, {w: torch.ones_like(out) for w, out in outs.items()}, header)
        seconds.append(time.perf_counter() - start)
    for proc in procs:
        proc.join(30)
    return {"seconds": seconds[3:], "rows_per_worker": [e - s for _, s, e in plan.worker_rows]}


def _raw_round(group, tensors: dict, header: bool = False) -> dict:
    import torch

    outs = {w: torch.empty_like(t) for w, t in tensors.items()}
    works = [group.send([torch.tensor([*t.shape, 0, 0, 0, 0])], w + 1, 2) for w, t in tensors.items()] if header else []
    works += [group.send([t.contiguous()], w + 1, 0) for w, t in tensors.items()]
    works += [group.recv([outs[w]], w + 1, 1) for w in tensors]
    for work in works:
        work.wait()
    return outs


def _raw_worker(port: int, world_size: int, spec, request, iterations: int, header: bool = False) -> None:
    import torch

    from vela_ray.model.collective import make_group, make_store
    from vela_ray.training.expert_manager import ExpertManager

    torch.set_num_threads(1)
    manager = ExpertManager(spec)
    group = make_group(make_store("127.0.0.1", port, world_size, False, 120), spec.worker + 1, world_size, 120)
    if request is None:
        return
    ids, like = request

    def receive() -> torch.Tensor:
        if header:  # the payload's receive is posted only once the header says its shape
            shape = torch.empty(6, dtype=torch.int64)
            group.recv([shape], 0, 2).wait()
        payload = torch.empty_like(like)
        group.recv([payload], 0, 0).wait()
        return payload

    for i in range(iterations):
        group.send([manager.forward_rows(0, ids, receive(), key=i).contiguous()], 0, 1).wait()
        group.send([manager.backward_rows(i, receive()).contiguous()], 0, 1).wait()


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    settings = [s for s in SETTINGS if s in args.settings]
    times: dict[str, list[float]] = {s: [] for s in settings}
    trip_bytes: dict[str, int] = {}
    rows = None
    for round_ in range(args.rounds):
        for setting in settings:
            env = {**os.environ, **setting_env(setting)}
            argv = [sys.executable, __file__, "--child", setting] + [
                f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                if k not in ("child", "rounds", "settings", "out")]
            out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            times[setting] += result["seconds"]
            rows = result["rows_per_worker"]
            if "bytes_per_trip" in result:
                trip_bytes[setting] = result["bytes_per_trip"]
            print(f"round {round_ + 1} {setting}: median {1e3 * statistics.median(result['seconds']):.2f} ms",
                  flush=True)
    medians = {s: statistics.median(t) for s, t in times.items()}
    kb = [r * args.hidden * 4 / 1024 for r in rows]
    print(f"\nforward+backward fan-out to {args.workers} workers, {min(kb):.0f}-{max(kb):.0f} KiB of fp32 rows "
          f"each (load {os.getloadavg()[0]:.1f}):")
    references = [r for r in ("raw_p2p", "inline_zero_copy", "collective") if r in medians]
    print(f"{'setting':<18}{'median ms':>10}{'MiB/trip':>10}" + "".join(f"{'/ ' + r:>19}" for r in references))
    for s in settings:
        mib = f"{trip_bytes[s] / 2**20:.2f}" if s in trip_bytes else "-"
        print(f"{s:<18}{1e3 * medians[s]:>10.2f}{mib:>10}"
              + "".join(f"{medians[s] / medians[r]:>19.2f}" for r in references))
    write_results(args.out, {"command": command(__file__), "args": vars(args),
                             "load_average_1min": os.getloadavg()[0], "cpus": os.cpu_count(),
                             "median_s": medians, "bytes_per_trip": trip_bytes, "rows_per_worker": rows,
                             "seconds": times})


if __name__ == "__main__":
    run(main)
