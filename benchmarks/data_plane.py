"""Benchmark: Ray data-plane settings for the broker's fan-out, side by side.

One MoE layer's forward + backward round trip through `RayObjectRefTransport` to
N real ExpertManagers (synthetic experts), with the rows a small model sends
(hidden D, T tokens, top-2: ~R/N rows of D floats per worker), under:

    ray_default       Ray as shipped: tensors pickled by torch, args/results over
                      100 KiB go through the object store
    inline            RAY_max_direct_call_object_size = cluster.inline_bytes: rows and
                      results ride inside the task RPC
    inline_zero_copy  + RAY_ENABLE_ZERO_COPY_TORCH_TENSORS (vela-ray's default,
                      `actors.transports.data_plane_env`)

Both variables are read when a Ray process starts, so each setting runs in its own
subprocess with its own local Ray; settings alternate over `--rounds` so that a
burst of load on this shared machine hits all of them.

    python benchmarks/data_plane.py                     # D=128, T=1024, N=6
    python benchmarks/data_plane.py --hidden 1024 --tokens 2048

Results: a table of median round-trip ms and ratios to ray_default, and
benchmarks/results/data_plane.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # the repository root first, as in every benchmark here

RESULTS = ROOT / "benchmarks" / "results" / "data_plane.json"
SETTINGS = ("ray_default", "inline", "inline_zero_copy")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128, help="hidden size D (the tiny demo model's)")
    p.add_argument("--intermediate", type=int, default=256, help="expert intermediate size")
    p.add_argument("--experts", type=int, default=8, help="experts per layer")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per layer (batch 8 x 128)")
    p.add_argument("--workers", type=int, default=6, help="ExpertManagers")
    p.add_argument("--iters", type=int, default=40, help="timed round trips per setting and round")
    p.add_argument("--rounds", type=int, default=2, help="times each setting runs, alternating")
    p.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def setting_env(setting: str) -> dict[str, str]:
    from actors.transports import data_plane_env
    from vela_ray.config import ClusterSection

    inline = ClusterSection().inline_bytes
    return {"ray_default": {}, "inline": data_plane_env(inline, False),
            "inline_zero_copy": data_plane_env(inline, True)}[setting]


def child(args) -> dict:
    """Time one setting in this process (its env was set by the parent); returns per-iteration seconds."""
    import ray
    import torch

    from actors.cluster import spawn_expert_managers
    from vela_ray.training.expert_manager import ExpertManagerSpec
    from actors.transports import RayObjectRefTransport
    from transformers import MixtralConfig

    from vela_ray.model.broker import ExpertDispatcher

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    g = torch.Generator().manual_seed(0)
    D, I, E, N = args.hidden, args.intermediate, args.experts, args.workers
    table = torch.tensor([[e % N for e in range(E)]])
    config = MixtralConfig(hidden_size=D, intermediate_size=I, num_local_experts=E, num_hidden_layers=1)
    specs = [ExpertManagerSpec(worker=n, keys=[(0, e) for e in range(E) if e % N == n], hf_config=config,
                               weights={(0, e): {"gate_up_proj": torch.randn(2 * I, D, generator=g) * 0.05,
                                                 "down_proj": torch.randn(D, I, generator=g) * 0.05}
                                        for e in range(E) if e % N == n})
             for n in range(N)]
    cluster = spawn_expert_managers(specs, num_cpus_per_worker=0.25, env_vars=setting_env(args.child))
    transport = RayObjectRefTransport(cluster.handles, cluster.worker_tiers(),
                                      zero_copy=args.child == "inline_zero_copy")
    dispatcher = ExpertDispatcher(table, transport)
    hidden_TD = torch.randn(args.tokens, D, generator=g)
    plan = dispatcher.plan(0, torch.randint(0, E, (args.tokens, 2), generator=g))
    rows_RD = hidden_TD.index_select(0, plan.token_idx_R)
    seconds = []
    for i in range(args.iters + 3):  # 3 warm-up trips
        start = time.perf_counter()
        out_RD = dispatcher.forward(plan, rows_RD, key=i)
        dispatcher.backward(plan, torch.ones_like(out_RD), key=i)
        seconds.append(time.perf_counter() - start)
    ray.shutdown()
    return {"seconds": seconds[3:], "rows_per_worker": [e - s for _, s, e in plan.worker_rows]}


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    times: dict[str, list[float]] = {s: [] for s in SETTINGS}
    rows = None
    for round_ in range(args.rounds):
        for setting in SETTINGS:
            env = {**os.environ, **setting_env(setting)}
            argv = [sys.executable, __file__, "--child", setting] + [
                f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("child", "rounds")]
            out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            times[setting] += result["seconds"]
            rows = result["rows_per_worker"]
            print(f"round {round_ + 1} {setting}: median {1e3 * statistics.median(result['seconds']):.2f} ms",
                  flush=True)
    medians = {s: statistics.median(t) for s, t in times.items()}
    kb = [r * args.hidden * 4 / 1024 for r in rows]
    print(f"\nforward+backward fan-out to {args.workers} workers, {min(kb):.0f}-{max(kb):.0f} KiB of rows each "
          f"(load {os.getloadavg()[0]:.1f}):")
    print(f"{'setting':<18}{'median ms':>10}{'/ ray_default':>15}")
    for s in SETTINGS:
        print(f"{s:<18}{1e3 * medians[s]:>10.2f}{medians[s] / medians['ray_default']:>15.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "median_s": medians, "rows_per_worker": rows,
                                   "seconds": times}, indent=1))


if __name__ == "__main__":
    main()
