"""benchmarks/data_plane.py's Ray Direct Transport row moves the right rows: a round trip of its master
actor (rows out, results back, both over gloo RDT) equals the same dispatcher over in-process
ExpertManagers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import ray
import torch

from tests.ray.helpers import TIMEOUT_S
from vela_ray.model.broker import ExpertDispatcher
from vela_ray.model.transport import InProcessTransport
from vela_ray.training.expert_manager import ExpertManager

ROOT = Path(__file__).resolve().parents[2]


def load_data_plane(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the repository root first; undone after
    spec = importlib.util.spec_from_file_location("data_plane", ROOT / "benchmarks" / "data_plane.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "data_plane", module)
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # actors cannot import benchmarks/ by name
    return module


def test_rdt_round_trip_equals_the_dispatcher_over_in_process_experts(ray_session, monkeypatch):
    data_plane = load_data_plane(monkeypatch)
    args = data_plane.parse_args(["--hidden", "64", "--intermediate", "32", "--experts", "4", "--tokens", "32",
                                  "--workers", "2"])
    table, specs = data_plane.specs(args)
    g = torch.Generator().manual_seed(1)
    hidden_TD = torch.randn(args.tokens, args.hidden, generator=g)
    plan = ExpertDispatcher(table, InProcessTransport([None, None])).plan(0, torch.randint(0, 4, (32, 2), generator=g))
    rows_RD = hidden_TD.index_select(0, plan.token_idx_R)

    workers = [data_plane.RdtExpertManager.options(num_cpus=0.25).remote(spec) for spec in specs]
    master = data_plane.RdtMaster.options(num_cpus=0.25).remote(table, workers)
    try:
        ray.get(master.form_group.remote(), timeout=TIMEOUT_S)
        out_RD, d_rows_RD = ray.get(master.round_trip.remote(plan, rows_RD, 0), timeout=TIMEOUT_S)
    finally:
        for actor in [master, *workers]:
            ray.kill(actor, no_restart=True)

    # the same experts here; float32 sums may differ in the last bits (another thread count)
    local = ExpertDispatcher(table, InProcessTransport([ExpertManager(spec) for spec in specs]))
    want_out_RD = local.forward(plan, rows_RD, key=0)
    torch.testing.assert_close(out_RD, want_out_RD)
    torch.testing.assert_close(d_rows_RD, local.backward(plan, torch.ones_like(want_out_RD), key=0))
