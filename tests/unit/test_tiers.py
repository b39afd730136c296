"""APTMoE's CPU/device expert tiers (`vela_ray.training.tiers`, `expert_cache`, `popularity`, `tiered`).

The policies are checked on hand-worked and brute-forced instances; a tiered ExpertManager is checked
against an untiered one on the tiny pre-trained model's experts (forward outputs, input gradients,
LoRA gradients, fp32 to 1e-6) with every decision forced each way: on the CPU the "device" is the CPU,
so the cache, its uploads, evictions and the dropped-weights hooks all run. The popularity predictor is
fitted on that model's real routing. The CUDA path (pinned memory, the upload stream) is `gpu`-marked.
"""

from __future__ import annotations

import itertools
import random
import threading

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.fixtures import LiveBytes, job_dict, make_checkpoint, peft_job, run_equal_to_peft
from vela_ray.config import JobConfig
from vela_ray.data.datasets import pack_text, sequential_batches
from vela_ray.paths import data_dir
from vela_ray.runtime.pool import capacity_from_memory
from vela_ray.training import tiered as tiered_module
from vela_ray.training.tiered import PROFILE_ROWS
from vela_ray.training.expert_cache import DeviceExpertCache
from vela_ray.training.expert_manager import ExpertManager, ExpertManagerSpec
from vela_ray.model.experts import LoraSpec
from vela_ray.model.families import debug_model
from vela_ray.model.modeling import expert_weights, find_moe_blocks
from vela_ray.training.popularity import PopularityPredictor, demand_overlap, routing_pairs, top_k_overlap
from vela_ray.training.tiny_model import tiny_model_path
from vela_ray.training.tiers import (
    ExpertTiersConfig, TierSpeeds, affinity_split, critical_path_s, historical_order, request_seconds_per_row,
    upload_order,
)

# load of one expert: 1e6 B / 1e10 B/s = 1e-4 s; CPU: 1e-5 s per row
SPEEDS = TierSpeeds(cpu_s_per_row=1e-5, device_s_per_row=1e-7, upload_bytes_per_s=1e10, bytes_per_expert=10**6)
CPU_ONLY = TierSpeeds(cpu_s_per_row=1e-5, bytes_per_expert=10**6)
ALL_TO_DEVICE = TierSpeeds(cpu_s_per_row=1.0, device_s_per_row=1e-9, upload_bytes_per_s=1e18, bytes_per_expert=1)
LORA = LoraSpec(r=4, alpha=8)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- the affinity rule (Eq. 1) ------------------------------------------------------------------------------


def test_a_one_row_expert_computes_on_the_cpu_and_a_thousand_row_expert_on_the_device():
    # no load: CPU 1001e-5 = 1.0e-2 s; load the 1000-row one: max(1e-5, 1e-4) = 1e-4 s; both: 2e-4 s
    assert affinity_split([1, 1000], [False, False], SPEEDS, max_device=8) == [False, True]
    # alone, the 1-row expert is cheaper on the CPU (1e-5 s) than its load (1e-4 s)
    assert affinity_split([1], [False], SPEEDS, max_device=8) == [False]
    # once cached it costs no load: the device takes it
    assert affinity_split([1], [True], SPEEDS, max_device=8) == [True]


def test_without_a_device_rows_or_room_every_expert_stays_on_the_cpu():
    assert affinity_split([5, 1000], [True, False], CPU_ONLY, max_device=8) == [False, False]
    assert affinity_split([5, 1000], [False, False], SPEEDS, max_device=0) == [False, False]
    assert affinity_split([0, 0], [True, False], SPEEDS, max_device=8) == [False, False]
    assert affinity_split([], [], SPEEDS, max_device=8) == []


def test_the_cap_on_device_experts_prefers_a_busy_upload_to_an_idle_cached_expert():
    # cap 1: keep the cached 1-row expert (CPU 1e-2 s for the other) or load the 1000-row one (1e-4 s)
    assert affinity_split([1, 1000], [True, False], SPEEDS, max_device=1) == [False, True]


def test_affinity_split_minimises_its_critical_path_over_every_subset():
    rng = random.Random(0)
    for _ in range(300):
        num = rng.randint(1, 6)
        rows = [rng.choice([0, 1, 2, 5, 30, 200, 1000]) for _ in range(num)]
        resident = [rng.random() < 0.3 for _ in range(num)]
        cap = rng.randint(0, num)
        slope = rng.uniform(1e-6, 1e-4)
        # half the draws with a profiler table in which a few rows cost more per row than many
        table = tuple((r, slope * r * (1 + 4 / r ** 0.5)) for r in (1, 16, 256)) if rng.random() < 0.5 else ()
        speeds = TierSpeeds(cpu_s_per_row=slope, device_s_per_row=1e-7, cpu_table=table,
                            upload_bytes_per_s=rng.uniform(1e8, 1e11), bytes_per_expert=10**6)
        fixed = rng.choice([0.0, 1e-3])
        chosen = affinity_split(rows, resident, speeds, cap, fixed)
        assert sum(chosen) <= cap
        best = min(critical_path_s(rows, resident, subset, speeds, fixed)
                   for subset in itertools.product([False, True], repeat=num) if sum(subset) <= cap)
        assert critical_path_s(rows, resident, chosen, speeds, fixed) == pytest.approx(best, rel=1e-12)


def test_the_profilers_table_is_interpolated_and_its_dear_few_row_calls_move_small_experts_to_the_device():
    table = ((1, 1e-3), (16, 1.6e-3), (256, 2.56e-2))  # one row: 1 ms; 16 rows: 0.1 ms a row
    profiled = TierSpeeds(cpu_s_per_row=1e-4, cpu_table=table, device_s_per_row=1e-7, upload_bytes_per_s=1e9,
                          bytes_per_expert=5 * 10**5)
    assert profiled.cpu_seconds(0) == 0.0 and profiled.cpu_seconds(1) == 1e-3
    assert profiled.cpu_seconds(8.5) == pytest.approx(1e-3 + 0.6e-3 / 2)  # halfway between its points
    assert profiled.cpu_seconds(512) == pytest.approx(5.12e-2)  # past the table: its last seconds per row
    assert profiled.device_seconds(256) == pytest.approx(256e-7)
    # two 2-row experts and 0.5 ms per upload: by the slope the CPU's 0.4 ms beats any upload; by the table each
    # costs the CPU ~1 ms, so both are uploaded (1 ms of loads, the CPU left idle)
    slope = profiled.model_copy(update={"cpu_table": ()})
    assert affinity_split([2, 2], [False, False], slope, max_device=2) == [False, False]
    assert affinity_split([2, 2], [False, False], profiled, max_device=2) == [True, True]
    with pytest.raises(ValueError, match=r"cpu_table: rows must ascend from 1 and seconds must not fall"):
        TierSpeeds(cpu_s_per_row=1e-4, cpu_table=((1, 1e-3), (16, 5e-4)), bytes_per_expert=1)


def papers_greedy(rows: list[int], speeds: TierSpeeds, fixed: float) -> list[bool]:
    """Eq. 1 as the paper words it: load from the highest intensity down while R > 1, stopping on the
    better side of R = 1."""
    order = sorted(range(len(rows)), key=lambda e: -rows[e])
    cpu_s, load_s, loaded = sum(speeds.cpu_seconds(r) for r in rows), fixed, []
    for e in order:
        if rows[e] == 0 or cpu_s <= load_s:  # R <= 1: stop loading
            break
        if max(cpu_s - speeds.cpu_seconds(rows[e]), load_s + speeds.load_seconds()) >= cpu_s:
            break  # crossing R = 1 here would lengthen the critical path
        cpu_s, load_s = cpu_s - speeds.cpu_seconds(rows[e]), load_s + speeds.load_seconds()
        loaded.append(e)
    return [e in loaded for e in range(len(rows))]


def test_with_nothing_cached_and_room_for_all_the_split_is_the_papers_greedy():
    rng = random.Random(1)
    for _ in range(300):
        rows = [rng.choice([0, 1, 3, 10, 50, 400]) for _ in range(rng.randint(1, 8))]
        speeds = TierSpeeds(cpu_s_per_row=rng.uniform(1e-6, 1e-4), device_s_per_row=1e-7,
                            upload_bytes_per_s=rng.uniform(1e8, 1e11), bytes_per_expert=10**6)
        fixed = rng.choice([0.0, 2e-3])
        ours = affinity_split(rows, [False] * len(rows), speeds, len(rows), fixed)
        theirs = papers_greedy(rows, speeds, fixed)
        assert critical_path_s(rows, [False] * len(rows), ours, speeds, fixed) == pytest.approx(
            critical_path_s(rows, [False] * len(rows), theirs, speeds, fixed), rel=1e-12)


# --- demand-priority upload order and the cache ---------------------------------------------------------------


def test_upload_order_is_this_layer_then_the_predicted_next_layer_then_popular_within_capacity():
    now, upcoming, popular = [(2, 5), (2, 1)], [(3, 0), (2, 1), (3, 4)], [(2, 5), (0, 7), (1, 1)]
    assert upload_order([now, upcoming, popular], capacity=5) == [(2, 5), (2, 1), (3, 0), (3, 4), (0, 7)]
    assert upload_order([now, upcoming, popular], capacity=1) == [(2, 5)]
    assert upload_order([[], [], []], capacity=4) == []


def test_historical_order_takes_each_layers_top_expert_before_any_second_starting_after_this_layer():
    scores = {(0, 1): 9.0, (0, 2): 5.0, (1, 3): 2.0, (1, 0): 7.0, (2, 6): 1.0, (2, 7): 0.0}
    # from layer 0: layers 1, 2, 0; ranks: (1,0) (2,6) (0,1), then (1,3) (0,2); (2,7) had no rows
    assert historical_order(scores, num_layers=3, start_layer=0) == [(1, 0), (2, 6), (0, 1), (1, 3), (0, 2)]


def _fake_host(key):
    return {"w": torch.full((2, 2), float(key[1]))}


def test_the_cache_evicts_the_least_recently_used_expert_outside_the_plan_and_never_one_in_use():
    cache = DeviceExpertCache(_fake_host, capacity=3, device=torch.device("cpu"))
    cache.schedule([(0, 0), (0, 1), (0, 2)])
    assert cache.uploads == 3 and cache.upload_bytes == 3 * 16
    cache.fetch((0, 0))  # (0, 1) is now the least recently used
    cache.schedule([(0, 3), (0, 0), (0, 2)])  # (0, 1) left the plan: it goes
    assert sorted(cache.keys()) == [(0, 0), (0, 2), (0, 3)] and cache.evictions == 1
    cache.fetch((1, 0), protected=[(0, 0), (0, 2)])  # a miss beyond the plan evicts the plan's only free one
    assert sorted(cache.keys()) == [(0, 0), (0, 2), (1, 0)]
    assert torch.equal(cache.fetch((1, 0))["w"], torch.zeros(2, 2)) and cache.hits == 2
    with pytest.raises(RuntimeError, match="cache_experts"):
        cache.fetch((1, 1), protected=[(0, 0), (0, 2), (1, 0)])
    with pytest.raises(ValueError, match="at least one expert"):
        DeviceExpertCache(_fake_host, capacity=0, device=torch.device("cpu"))


class _GatedHost:
    """`host_params` whose copy of `held` waits for `release`: the feeder is held mid-copy while the test re-plans."""

    def __init__(self, held):
        self.held, self.release, self.reading = held, threading.Event(), threading.Event()

    def __call__(self, key):
        if key == self.held:
            self.reading.set()
            assert self.release.wait(10), "the test never released the held copy"
        return _fake_host(key)


def test_queued_copies_follow_the_latest_plan_and_a_demand_jumps_the_queue(device="cpu"):
    host = _GatedHost(held=(0, 0))
    cache = DeviceExpertCache(host, capacity=4, device=torch.device(device), copies_in_flight=1)
    cache.schedule([(0, 0), (0, 1), (0, 2), (0, 3)])
    assert host.reading.wait(10)  # the feeder is copying (0, 0); the other three wait in the host queue
    cache.schedule([(0, 3), (0, 2), (1, 5)])  # re-planned: (0, 1) is never copied, (0, 3) goes first
    demand = cache.fetch((1, 5))  # the real gate needs (1, 5) now: copied at once, ahead of the queue
    assert torch.equal(demand["w"].cpu(), torch.full((2, 2), 5.0))
    host.release.set()
    cache.drain()
    assert list(cache.copy_log) == [(0, 0), (1, 5), (0, 3), (0, 2)]
    assert cache.copies_dropped == 1 and cache.demand_jumps == 1 and cache.uploads == 4
    assert sorted(cache.keys()) == [(0, 0), (0, 2), (0, 3), (1, 5)]
    assert all(torch.equal(cache.fetch(key)["w"].cpu(), _fake_host(key)["w"]) for key in cache.keys())
    cache.clear()
    assert cache.keys() == [] and cache._feeder is None


def test_every_plan_is_copied_whole_whenever_it_comes_while_the_feeder_runs_or_ends():
    """A plan made while the feeder is finishing (its queue just found empty) must get a feeder: after each plan,
    once the cache has drained, all of it is resident."""
    rng = random.Random(0)
    cache = DeviceExpertCache(_fake_host, capacity=4, device=torch.device("cpu"), copies_in_flight=1)
    for _ in range(300):
        plan = rng.sample([(layer, e) for layer in range(3) for e in range(4)], k=rng.randint(1, 4))
        cache.schedule(plan)
        if rng.random() < 0.3:
            cache.drain()
            assert set(plan) <= set(cache.keys()), (plan, cache.keys())
    cache.drain()
    assert set(plan) <= set(cache.keys()) and cache._feeder is None


def test_a_fetch_waits_for_the_copy_the_feeder_is_making_and_a_failed_copy_ends_the_feeder():
    host = _GatedHost(held=(0, 1))
    cache = DeviceExpertCache(host, capacity=2, device=torch.device("cpu"), copies_in_flight=1)
    cache.schedule([(0, 1)])
    assert host.reading.wait(10)
    threading.Timer(0.05, host.release.set).start()
    assert torch.equal(cache.fetch((0, 1))["w"], torch.ones(2, 2))  # waited for the feeder's copy: not made twice
    assert cache.uploads == 1 and cache.hits == 1 and cache.demand_jumps == 0

    def broken(key):
        raise OSError("host memory unreadable")
    failing = DeviceExpertCache(broken, capacity=2, device=torch.device("cpu"), copies_in_flight=1)
    failing.schedule([(0, 0), (0, 1)])
    failing.drain()  # the feeder logged its failure and ended, its queue dropped: nothing hangs
    assert failing.keys() == [] and failing._feeder is None
    with pytest.raises(OSError, match="unreadable"):  # the computation's own fetch raises the cause
        failing.fetch((0, 1))


def test_expert_tiers_are_a_job_setting_off_by_default(tmp_path):
    assert not JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out")).expert_tiers.enabled
    job = job_dict(tmp_path, tmp_path / "out", expert_tiers={"enabled": True, "cache_experts": 4})
    assert JobConfig.from_dict(job).expert_tiers == ExpertTiersConfig(enabled=True, cache_experts=4)


# --- a tiered ExpertManager equals an untiered one ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir():
    """The tiny pre-trained Mixtral (its router has real preferences), built on first use (~2.5 min on
    2 cores) and cached, so these tests run on CI's clean machine too."""
    return tiny_model_path()


KEYS = [(layer, e) for layer in (0, 1) for e in range(8)]
COUNTS = [40, 1, 0, 7, 20, 2, 3, 15]  # rows per expert of each layer: skewed, one expert without rows


def make_manager(model_dir, tiers: ExpertTiersConfig | None = None, device: str = "cpu") -> ExpertManager:
    spec = ExpertManagerSpec(worker=0, keys=KEYS, model_dir=str(model_dir), lora=LORA, seed=3, device=device,
                             **({"tiers": tiers} if tiers else {}))
    manager = ExpertManager(spec)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # non-zero B, so every LoRA factor gets a gradient
        for name, param in manager.shard.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return manager


def requests(layer: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert ids [R], rows [R, D], d(outputs) [R, D]) of one layer, grouped by expert as the broker sends."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([e for e, n in enumerate(COUNTS) for _ in range(n)])
    return ids, torch.randn(len(ids), hidden, generator=generator), torch.randn(len(ids), hidden, generator=generator)


def run_both_layers(manager: ExpertManager) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """Forward layers 0 then 1, backward 1 then 0 (as the master does); outputs, input grads, LoRA grads."""
    outs, grads, data = [], {}, {layer: requests(layer, 128, seed=layer) for layer in (0, 1)}
    for layer in (0, 1):
        ids, rows, _ = data[layer]
        outs.append(manager.forward_rows(layer, ids, rows, key=("mb", layer)))
    for layer in (1, 0):
        grads[layer] = manager.backward_rows(("mb", layer), data[layer][2])
    return outs, [grads[0], grads[1]], manager.lora_grads()


@pytest.mark.parametrize("speeds, cache_experts, expect", [
    (CPU_ONLY, 8, "cpu"),
    (ALL_TO_DEVICE, 8, "device"),
    (ALL_TO_DEVICE, 3, "both"),  # the cap: 3 experts per request on the device, the rest on the CPU
], ids=["all-cpu", "all-device", "capped-mixed"])
def test_a_tiered_manager_equals_an_untiered_one(tiny_model_dir, speeds, cache_experts, expect):
    reference = run_both_layers(make_manager(tiny_model_dir))
    tiered = make_manager(tiny_model_dir, ExpertTiersConfig(enabled=True, cache_experts=cache_experts))
    tiered.tiers.use_speeds(speeds)
    outs, grads, lora = run_both_layers(tiered)
    for got, want in zip(outs + grads, reference[0] + reference[1]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for key, named in reference[2].items():
        for name, want in named.items():
            torch.testing.assert_close(lora[key][name], want, rtol=0, atol=1e-6, msg=f"{key} {name}")
    stats = tiered.report().tiers
    active = 2 * sum(1 for n in COUNTS if n)  # 7 experts with rows per layer, two layers
    assert stats.experts_cpu + stats.experts_device == active
    assert stats.rows_cpu + stats.rows_device == 2 * sum(COUNTS)
    if expect == "cpu":
        assert stats.experts_device == 0 and stats.uploads == 0
    if expect == "device":
        assert stats.experts_cpu == 0 and stats.uploads >= active and stats.dropped_weights > 0
    if expect == "both":
        assert stats.experts_device == 2 * 3 and stats.experts_cpu == active - 6
        # the backward of layer 1 found layer 0's experts evicted: the cache held 3 at a time
        assert stats.uploads > stats.experts_device and stats.evictions > 0
        assert stats.rows_device == 2 * (40 + 20 + 15)  # the three busiest experts of each layer


def test_full_parameter_zo_writes_the_host_copies_and_the_device_cache_serves_what_was_written(tiny_model_dir):
    """Full-parameter ZO perturbs a tiered worker's frozen weights in their host copies; the experts the device cache
    held from the last pass are dropped, so the next pass computes with the written weights, as an untiered
    worker does."""
    untiered = make_manager(tiny_model_dir)
    tiered = make_manager(tiny_model_dir, ExpertTiersConfig(enabled=True, cache_experts=8))
    tiered.tiers.use_speeds(ALL_TO_DEVICE)
    ids, rows, _ = requests(0, 128, seed=0)
    with torch.no_grad():
        tiered.forward_rows(0, ids, rows)  # the layer's experts now sit in the cache
        uploads = tiered.tiers.cache.uploads
        for manager in (untiered, tiered):
            manager.zo_apply([(11, 0.05)], "full")
        torch.testing.assert_close(tiered.forward_rows(0, ids, rows), untiered.forward_rows(0, ids, rows),
                                   rtol=0, atol=1e-6)
    assert tiered.tiers.cache.uploads > uploads  # uploaded again, from the written host copies


def test_a_tiered_manager_without_grad_keeps_no_graph_and_answers_an_empty_request(tiny_model_dir):
    tiered = make_manager(tiny_model_dir, ExpertTiersConfig(enabled=True, cache_experts=2))
    tiered.tiers.use_speeds(ALL_TO_DEVICE)
    ids, rows, _ = requests(0, 128, seed=0)
    reference = make_manager(tiny_model_dir).forward_rows(0, ids, rows)
    torch.testing.assert_close(tiered.forward_rows(0, ids, rows), reference, rtol=0, atol=1e-6)
    empty = tiered.forward_rows(1, ids[:0], rows[:0], key="empty")
    assert empty.shape == (0, 128) and tiered.backward_rows("empty", rows[:0]).shape == (0, 128)
    assert not tiered.shard._saved


@pytest.mark.parametrize("family", ["gpt_oss", "llama4_text"])
def test_a_tiered_manager_equals_an_untiered_one_for_other_expert_layouts(family):
    """gpt-oss: transposed, interleaved, biased stacks (low-rank path); Llama 4: experts called on rows grouped
    by expert, LoRA folded into the weights (peft's path), whose folded weights the graph keeps."""
    model = debug_model(family, seed=0)
    blocks = find_moe_blocks(model)
    layer, num_experts, hidden = blocks[0].index, blocks[0].layout.num_experts, blocks[0].layout.hidden_size
    weights = expert_weights(blocks[:1])
    counts = [(9, 1, 0, 4, 2, 6, 1, 3)[e % 8] for e in range(num_experts)]
    ids = torch.tensor([e for e, n in enumerate(counts) for _ in range(n)])
    generator = torch.Generator().manual_seed(5)
    rows, grad = torch.randn(len(ids), hidden, generator=generator), torch.randn(len(ids), hidden, generator=generator)
    results = []
    for tiers, speeds in [(None, None), (ExpertTiersConfig(enabled=True, cache_experts=2), ALL_TO_DEVICE)]:
        spec = ExpertManagerSpec(worker=0, keys=sorted(weights), weights=weights, hf_config=model.config, lora=LORA,
                                 seed=3, **({"tiers": tiers} if tiers else {}))
        manager = ExpertManager(spec)
        with torch.no_grad():
            for name, param in manager.shard.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(6)) * 0.1)
        if speeds:
            manager.tiers.use_speeds(speeds)
        out = manager.forward_rows(layer, ids, rows, key="k")
        results.append((out, manager.backward_rows("k", grad), manager.lora_grads()))
    (out, grad_in, lora), (t_out, t_grad_in, t_lora) = results
    torch.testing.assert_close(t_out, out, rtol=0, atol=1e-6)
    torch.testing.assert_close(t_grad_in, grad_in, rtol=0, atol=1e-6)
    for key, named in lora.items():
        for name, want in named.items():
            torch.testing.assert_close(t_lora[key][name], want, rtol=0, atol=1e-6, msg=f"{key} {name}")
    assert manager.report().tiers.experts_device == 2


def test_the_device_tier_computes_from_the_cached_weights_without_a_second_copy(tiny_model_dir):
    """Issue 33: the device experts read the cache's own tensors, and what a call allocates (forward and
    backward, all of it on the device path here) stays within `working_bytes`, which a device budget leaves
    beside the cache, far below one more copy of the call's weights (stacking them into one did not: a peak of
    3.6 MB here, against 0.87 MB now and 1.18 MB of `working_bytes`)."""
    tiered = make_manager(tiny_model_dir, ExpertTiersConfig(enabled=True, cache_experts=8))
    tiered.tiers.use_speeds(ALL_TO_DEVICE)
    cache = tiered.tiers.cache
    cache.schedule([(0, e) for e in range(8)])  # resident beforehand: the uploads are the cache, not the call
    ids, rows, grad = requests(0, 128, seed=0)
    with LiveBytes() as allocated:
        out = tiered.forward_rows(0, ids, rows, key="k")
        grad_rows = tiered.backward_rows("k", grad)
    reference = make_manager(tiny_model_dir)
    torch.testing.assert_close(out, reference.forward_rows(0, ids, rows, key="k"), rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_rows, reference.backward_rows("k", grad), rtol=0, atol=1e-6)
    busy = [e for e, n in enumerate(COUNTS) if n]
    assert cache.uploads == 8 and tiered.report().tiers.experts_device == len(busy)
    cached = {(0, e): {t.untyped_storage().data_ptr() for t in cache.fetch((0, e)).values()} for e in range(8)}
    assert all(cached[(0, e)] <= allocated.read for e in busy)  # the weights computed with: the cache's
    weights_of_call = sum(t.nbytes for e in busy for t in cache.fetch((0, e)).values())
    working = tiered.tiers.working_bytes(0, len(ids), len(busy))
    assert allocated.peak <= working < weights_of_call / 2


# --- the popularity predictor ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def routing(tiny_model_dir):
    """Real routing of the tiny model on Tiny Shakespeare (its fine-tuning data): fit and held-out pairs."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = pack_text(tokenizer, data_dir() / "tinyshakespeare" / "input.txt", seq_len=64, max_blocks=48)
    batches = list(sequential_batches(data, batch_size=8))
    return model, routing_pairs(model, batches[:4]), routing_pairs(model, batches[4:])


def test_the_fitted_predictor_forecasts_the_next_layers_experts_better_than_a_uniform_guess(routing):
    model, fit_pairs, held_out = routing
    predictor = PopularityPredictor.from_model(model)
    assert predictor.layers() == [1, 2, 3]
    before = predictor.top_k_overlap(held_out)
    losses = predictor.fit(fit_pairs, steps=40)
    after = predictor.top_k_overlap(held_out)
    uniform = 2 / 8  # a random guess of K = 2 of E = 8 experts shares K / E of the real ones
    assert losses[-1] < losses[0]
    for layer in (1, 2, 3):
        assert after[layer] > uniform + 0.15, (before, after)
        assert after[layer] >= before[layer] - 0.02
    real_E = torch.bincount(held_out[2][1].reshape(-1), minlength=8)
    assert demand_overlap(predictor.predict_rows(2, held_out[2][0]), real_E) > demand_overlap(torch.ones(8), real_E)


def test_a_tiered_manager_scores_its_forecast_of_the_next_layer(routing, tiny_model_dir):
    model, fit_pairs, held_out = routing
    predictor = PopularityPredictor.from_model(model)
    predictor.fit(fit_pairs, steps=10)
    manager = make_manager(tiny_model_dir, ExpertTiersConfig(enabled=True, cache_experts=4))
    manager.tiers.use_speeds(SPEEDS)
    manager.set_predictor(predictor.state_dict(), predictor.top_k)
    rows0 = held_out[1][0][:64]  # layer 0's router input: what its experts receive
    ids0 = torch.arange(64) % 8  # any experts of layer 0
    manager.forward_rows(0, ids0, rows0)
    rows1, top1 = held_out[2][0][:64], held_out[1][1][:64]  # layer 1's real choices for the same tokens
    manager.forward_rows(1, top1.reshape(-1), rows1.repeat_interleave(2, dim=0))
    stats = manager.report().tiers
    assert stats.predictions == 1 and 0.0 <= stats.predicted_overlap <= 1.0
    assert stats.speeds == SPEEDS


def test_a_layer_the_fit_would_predict_worse_keeps_the_router_copy_it_started_from():
    """Layer 1 starts as the very router behind its targets (overlap 1.0); one Adam step of lr 100 wrecks
    it, so it keeps its start, bit for bit. Layer 2 starts at zero and keeps what it learns."""
    generator = torch.Generator().manual_seed(0)
    true_router = nn.Linear(8, 6, bias=False)
    with torch.no_grad():
        true_router.weight.copy_(torch.randn(6, 8, generator=generator))
    rows = torch.randn(256, 8, generator=generator)
    top_k = true_router(rows).topk(2, dim=-1).indices
    pairs = {1: (rows, top_k), 2: (rows, top_k)}
    start = nn.Linear(8, 6, bias=False)
    with torch.no_grad():
        start.weight.copy_(true_router.weight)
    blank = nn.Linear(8, 6, bias=False)
    with torch.no_grad():
        blank.weight.zero_()
    predictor = PopularityPredictor({1: start, 2: blank}, top_k=2)
    assert predictor.top_k_overlap(pairs)[1] == 1.0
    predictor.fit(pairs, steps=1, lr=100.0)
    assert torch.equal(predictor.routers["1"].weight, true_router.weight)
    assert not torch.equal(predictor.routers["2"].weight, torch.zeros(6, 8))  # fitted, kept
    assert predictor.top_k_overlap(pairs)[1] == 1.0


def test_top_k_overlap_counts_shared_choices_per_token():
    predicted = torch.tensor([[0, 1], [2, 3]])
    real = torch.tensor([[1, 0], [3, 4]])
    assert top_k_overlap(predicted, real) == pytest.approx((2 / 2 + 1 / 2) / 2)
    assert demand_overlap(torch.tensor([3, 1, 0]), torch.tensor([1, 1, 2])) == pytest.approx(0.25 + 0.25)
    assert demand_overlap(torch.zeros(3), torch.ones(3)) is None


# --- a whole job ------------------------------------------------------------------------------------------------


@pytest.mark.job
def test_a_tiered_job_equals_peft_and_reports_its_tiers(tmp_path, monkeypatch):
    # speeds as if a device were there: a load costs 1e4 B / 1e8 B/s = 1e-4 s, ten rows of CPU time, so
    # the busy experts go to the (CPU-backed) device tier and the quiet ones stay on the CPU
    monkeypatch.setattr(tiered_module, "measure_speeds", lambda tiered: TierSpeeds(
        cpu_s_per_row=1e-5, device_s_per_row=1e-7, upload_bytes_per_s=1e8, bytes_per_expert=10**4))
    model_dir = make_checkpoint(tmp_path / "model")
    _, summary = run_equal_to_peft(peft_job(model_dir, tmp_path, steps=2, cluster={"num_workers": 2},
                                            expert_tiers={"enabled": True, "cache_experts": 3}))
    assert [stats.worker for stats in summary.expert_tiers] == [0, 1]
    for stats in summary.expert_tiers:
        assert stats.experts_cpu > 0 and stats.experts_device > 0 and stats.uploads > 0
        assert stats.predictions > 0 and 0.0 < stats.predicted_overlap <= 1.0  # fitted by the runner


# --- the CUDA path -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_on_cuda_queued_copies_follow_the_latest_plan_and_a_demand_jumps_the_queue():
    test_queued_copies_follow_the_latest_plan_and_a_demand_jumps_the_queue(device="cuda")


@pytest.mark.gpu
def test_on_cuda_host_weights_are_pinned_uploads_run_on_their_own_stream_and_results_match(tiny_model_dir):
    reference = run_both_layers(make_manager(tiny_model_dir))
    tiered = make_manager(tiny_model_dir, ExpertTiersConfig(enabled=True, cache_experts=3), device="cuda")
    assert all(t.is_pinned() for t in tiered.tiers.host_params((0, 0)).values())
    cache = tiered.tiers.cache
    assert cache.stream is not None and cache.demand_stream.priority < cache.stream.priority  # a demand goes first
    speeds = tiered.tiers.measured_speeds()
    assert speeds.has_device and speeds.upload_bytes_per_s > 0 and speeds.device_s_per_row > 0
    tiered.tiers.use_speeds(ALL_TO_DEVICE)
    data = {layer: requests(layer, 128, seed=layer) for layer in (0, 1)}
    before = torch.cuda.memory_allocated()
    outs = [tiered.forward_rows(layer, data[layer][0], data[layer][1], key=("mb", layer)) for layer in (0, 1)]
    # the graphs waiting for backward keep no device weights: the cache's 3 experts and small activations
    assert torch.cuda.memory_allocated() - before <= 3 * speeds.bytes_per_expert + 2**20
    grads = {layer: tiered.backward_rows(("mb", layer), data[layer][2]) for layer in (1, 0)}
    for got, want in zip(outs + [grads[0], grads[1]], reference[0] + reference[1]):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)  # other kernels than the CPU's
    lora = tiered.lora_grads()
    for key, named in reference[2].items():
        for name, want in named.items():
            torch.testing.assert_close(lora[key][name], want, rtol=1e-4, atol=1e-5)
    stats = tiered.report().tiers
    assert stats.experts_device == 6 and stats.experts_cpu == 8 and stats.dropped_weights > 0
    assert stats.upload_bytes >= 6 * speeds.bytes_per_expert


# --- what placement sees of a tiered worker: compute per row and capacity ------------------------------------------


def test_a_request_costs_the_cpu_speed_without_a_device_and_less_with_one_that_beats_it():
    assert request_seconds_per_row(CPU_ONLY, 256, 8, resident=0, max_device=8) == CPU_ONLY.cpu_s_per_row
    # a device 100x faster per row, a load worth 10 CPU rows: 32 rows per expert go to the device, uploads
    # and CPU run side by side, so a row costs less than on the CPU and no less than on the device
    tiered = request_seconds_per_row(SPEEDS, 256, 8, resident=0, max_device=8)
    assert SPEEDS.device_s_per_row < tiered < SPEEDS.cpu_s_per_row
    # all cached: no loads, every row on the device
    assert request_seconds_per_row(SPEEDS, 256, 8, resident=8, max_device=8) == pytest.approx(SPEEDS.device_s_per_row)
    # brute force over every split of the uncached request: the rule's choice is the cheapest
    rows_E = [32] * 8
    best = min(critical_path_s(rows_E, [False] * 8, split, SPEEDS) + sum(32 for d in split if d) * 1e-7
               for split in itertools.product([False, True], repeat=8))
    assert tiered * 256 == pytest.approx(best)


def test_a_tiered_manager_reports_its_tiers_compute_and_its_host_memory(tiny_model_dir):
    manager = make_manager(tiny_model_dir, ExpertTiersConfig(enabled=True, cache_experts=4))
    manager.tiers.use_speeds(SPEEDS)
    experts_of_layer = 8  # KEYS: two layers of 8, a cache of 4: a quarter of each layer's experts cached
    report = manager.report(256)
    assert report.seconds_per_row == request_seconds_per_row(SPEEDS, 256, experts_of_layer, 2, 4)
    assert report.memory_pool == f"{report.node_id}/host"  # not its device's: the cache is bounded


def test_workers_sharing_one_memory_split_it():
    free, per_expert = [1000, 1000, 1000, 600], 100
    assert capacity_from_memory(free, per_expert) == [10, 10, 10, 6]  # each its own memory
    # three tiered workers on one node's host memory, one on a GPU of its own
    assert capacity_from_memory(free, per_expert, ["a/host", "a/host", "a/host", "a/cuda:0"]) == [3, 3, 3, 6]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_a_tiered_manager_first_asked_without_grad_measures_its_speeds_all_the_same(tiny_model_dir, mode):
    # in-process (InProcessPool) the first request may come from an eval or ZO forward under no_grad, or from
    # the routing profile (`placement.profile: measure`) under inference mode
    tiered = make_manager(tiny_model_dir, ExpertTiersConfig(enabled=True, cache_experts=2))
    ids, rows, _ = requests(0, 128, seed=0)
    with mode():
        out = tiered.forward_rows(0, ids, rows)
    torch.testing.assert_close(out, make_manager(tiny_model_dir).forward_rows(0, ids, rows), rtol=0, atol=1e-6)
    speeds = tiered.report().tiers.speeds
    assert speeds.cpu_s_per_row > 0 and [rows for rows, _ in speeds.cpu_table] == list(PROFILE_ROWS)
    assert speeds.cpu_s_per_row == speeds.cpu_table[-1][1] / PROFILE_ROWS[-1]  # its table's largest call, per row
