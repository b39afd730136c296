"""benchmarks/aptmoe_schedule.py (issue 50): the schedule simulator against hand-computed timelines on a tiny
model, the properties the paper's argument rests on, and the paper's ordering on its own configurations."""

from __future__ import annotations

import pytest

from benchmarks import aptmoe_schedule as sched
from benchmarks.aptmoe_schedule import DoesNotFit, Hardware, MoEModel, Task, Workload, iteration

# Tiny model with round numbers: d=8, h=16, E=2 experts, 2 layers, top-2, G=0.5 (uniform: 8 rows per expert).
# Weights per layer: attention 4*64 + gate 8*2 = 272 params, experts 2 * (2*8*16) = 512 params -> 784 * 4 B = 3136 B.
# Activations per layer and micro-batch of 8 tokens: 8 * 4 B * 8 * (2 + 1) = 768 B.
# Forward FLOPs per layer and micro-batch: attention 8 * (8*64 + 4*4*8 + 2*8*2) = 5376, experts 2 * 4*8*16*8 = 8192.
TINY = MoEModel("tiny", dim=8, hidden=16, experts=2, table_params_b=0, table_memory_gb=0, layers=2)
SLOW = dict(gpu_tflops=1e-9, gpu_call_s=0.0, pcie_gbps=1e-6)  # 1000 FLOP/s and 1000 B/s: times in seconds below
F, B = 13.568, 27.136  # one layer (= one stage) forward and backward, seconds
W, A = 3.136, 0.768  # one layer's weights (and its gradients), its activations, seconds over PCIe


def test_gpipe_is_the_pipeline_formula():
    # 2 GPUs, 2 micro-batches, one layer per stage: (m + stages - 1) * (f + b), nothing over PCIe
    work = Workload(batch=4, seq=4, micro_batches=2, popularity_g=0.5)
    assert iteration("GPipe", TINY, Hardware(gpus=2, **SLOW), work)["seconds"] == pytest.approx(3 * (F + B))


def test_offload_on_one_gpu_is_the_hand_timeline():
    work, hw = Workload(batch=2, seq=4, micro_batches=1, popularity_g=0.5), Hardware(gpus=1, **SLOW)
    # GPipeOffload, one stage resident: load W0, F0, load W1 (activations of 0 go out meanwhile), F1, B1 (still
    # resident), load W0 + its activations (gradients of 1 go out meanwhile), B0, gradients of 0 out.
    assert iteration("GPipeOffload", TINY, hw, work)["seconds"] == pytest.approx(W + F + W + F + B + (W + A) + B + W)
    # Mobius, two stages resident: W1 loads while F0 runs and both stay for backward; nothing else comes back.
    assert iteration("Mobius", TINY, hw, work)["seconds"] == pytest.approx(W + F + F + B + B + W)


def test_simulator_respects_dependencies_and_picks_the_lowest_key():
    tasks = [Task("link", 2.0, (), (1,)), Task("link", 1.0, (), (0,)), Task("gpu", 5.0, (0, 1), ())]
    # the key-0 copy goes first (ends at 1), then the key-1 copy (ends at 3), then compute waits for both
    assert sched.simulate(tasks) == [3.0, 1.0, 8.0]


@pytest.mark.parametrize("name,g", [("MoE-S-8", 0.2), ("MoE-M-16", 0.3), ("MoE-L-8", 0.8)])
def test_overlap_never_makes_mobius_slower_than_naive_offload(name, g):
    model, work = next(m for m in sched.TABLE_I if m.name == name), Workload(popularity_g=g)
    assert iteration("Mobius", model, Hardware(), work)["seconds"] < iteration("GPipeOffload", model, Hardware(),
                                                                                 work)["seconds"]


def test_aptmoe_without_cpu_share_loads_what_mobius_loads_and_is_no_slower():
    model, work, hw = sched.TABLE_I[1], Workload(popularity_g=0.4), Hardware(cpu_tflops=1e-6)  # CPU useless
    apt, mobius = iteration("APTMoE", model, hw, work), iteration("Mobius", model, hw, work)
    assert apt["cpu_experts_fwd_bwd"] == [0, 0]
    assert apt["h2d_gb_per_gpu"] == pytest.approx(mobius["h2d_gb_per_gpu"])
    assert apt["seconds"] <= mobius["seconds"]  # only the per-layer, demand-ordered uploads differ


def test_fit_check_refuses_configs_over_memory():
    s8, s16 = sched.TABLE_I[0], sched.TABLE_I[1]
    assert iteration("GPipe", s8, Hardware(), Workload())["tokens_per_s"] > 0  # 112 GB over 4 x 36 GB
    with pytest.raises(DoesNotFit, match="MoE-S-16: 215 GB"):
        iteration("GPipe", s16, Hardware(), Workload())
    with pytest.raises(DoesNotFit, match="not even one layer"):
        iteration("Mobius", s16, Hardware(gpu_memory_gb=0.5), Workload())


def test_memory_model_matches_table_i():
    for model in sched.TABLE_I:
        if model.name != "MoE-L-8":  # its stated 61.2B params are not what its dims give (64.4B)
            assert sched.memory_bytes(model, Workload()) / 1e9 == pytest.approx(model.table_memory_gb, rel=0.03)


def test_popularity_has_the_requested_g():
    assert sched.popularity(8, 0.125) == pytest.approx([0.125] * 8, abs=1e-6)
    p = sched.popularity(16, 0.3)
    assert sum(x * x for x in p) == pytest.approx(0.3) and p == sorted(p, reverse=True)
    with pytest.raises(ValueError, match="must lie in"):
        sched.popularity(8, 0.1)


@pytest.mark.parametrize("name,g", [("MoE-S-8", 0.8), ("MoE-S-16", 0.4), ("MoE-M-8", 0.6), ("MoE-M-16", 0.4)])
def test_paper_ordering_on_paper_configs(name, g):
    model, work = next(m for m in sched.TABLE_I if m.name == name), Workload(popularity_g=g)
    tps = {m: iteration(m, model, Hardware(), work)["tokens_per_s"] for m in ("GPipeOffload", "Mobius", "APTMoE")}
    assert tps["APTMoE"] > 1.05 * tps["Mobius"] > 1.05 * tps["GPipeOffload"]
