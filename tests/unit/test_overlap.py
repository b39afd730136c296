"""Several micro-batches in flight on a master (`training.overlap`, issue 46): each driven by a thread of its
own, so one computes while another's rows are at the experts; and within one, a block's shared expert computed
while its own rows are away (`training.overlap.shared_experts`, `vela_ray.model.shared_expert`).

Exact: against single-process peft (losses rel 1e-5, adapters to rounding) on a plain MoE, a shared expert
(Qwen2-MoE), MLA with a shared expert (DeepSeek-V3) and gpt-oss's biased experts; the step really has several
micro-batches at the experts at once; and the settings that need the serial step get it, saying why. The shared
expert: equal to peft on DeepSeek-V3 and Llama 4 (after the experts) and Qwen2-MoE (before them: nothing to
overlap), with 1 and 2 micro-batches in flight; really computed while the rows are away, once per block call; off,
the blocks are the ones transformers built.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import pytest
import torch
from transformers.models.llama4.modeling_llama4 import Llama4Router, Llama4TextMLP

from tests.equivalence import build_pair, exported_adapter, reference_adapter_state, run_both
from tests.fixtures import job_dict
from tests.unit.test_activation_checkpointing import checkpointed
from vela_ray.config import JobConfig, OverlapSection
from vela_ray.model.activity import MasterActivity
from vela_ray.model.broker import ExpertBroker
from vela_ray.model.modeling import find_moe_blocks
from vela_ray.model.transport import InProcessTransport

STEPS, MICRO_BATCHES, IN_FLIGHT = 3, 4, 3


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_micro_batches_in_flight_train_equal_to_peft_and_to_the_serial_step(family):
    serial, overlapped = build_pair(family), build_pair(family)
    ref_losses, serial_losses = run_both(serial, STEPS, count=MICRO_BATCHES)
    _, overlapped_losses = run_both(overlapped, STEPS, count=MICRO_BATCHES, in_flight=IN_FLIGHT)
    for losses in (overlapped_losses, serial_losses):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    want, got = exported_adapter(serial), exported_adapter(overlapped)
    assert got.keys() == want.keys() == reference_adapter_state(serial).keys()
    for key, value in want.items():  # AdamW moves a rounding-level gradient's element by ~lr either way
        assert float((got[key] - value).abs().max()) <= 2e-3 * float(value.abs().max()), key


class _SlowLink(InProcessTransport):
    """In-process experts behind a link that takes `delay_s` each way and lets calls travel at once (as Ray's
    object refs do): it records how many calls are away at the same time."""

    def __init__(self, shards, delay_s: float = 0.03):
        super().__init__(shards)
        self.delay_s, self.away, self.most_away = delay_s, 0, 0
        self._count = threading.Lock()

    def _travel(self, call, *args):
        with self._count:
            self.away += 1
            self.most_away = max(self.most_away, self.away)
        try:
            time.sleep(self.delay_s)
            return call(*args)
        finally:
            with self._count:
                self.away -= 1

    def forward(self, requests):
        return self._travel(super().forward, requests)

    def backward(self, key, grads):
        return self._travel(super().backward, key, grads)


@pytest.mark.parametrize("in_flight", [1, IN_FLIGHT])
def test_the_micro_batches_rows_are_at_the_experts_at_once(in_flight):
    """The serial step has one broker call away at a time; with 3 in flight, 3 micro-batches' rows are away
    together (each thread waiting on the link while the others compute), and the numbers stay peft's. The master
    is idle (`MasterActivity`) for its whole wait when serial, and only while every micro-batch waits when not:
    less than the summed round trips, which overlap."""
    links = []
    pair = build_pair("mixtral", make_transport=lambda shards: links.append(_SlowLink(shards)) or links[-1])
    dispatcher = pair.master.dispatcher
    start = time.perf_counter()
    ref_losses, vela_losses = run_both(pair, 1, count=MICRO_BATCHES, in_flight=in_flight)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert links[0].most_away == 1 if in_flight == 1 else links[0].most_away >= 2
    round_trips, idle = sum(dispatcher.round_trip_s.values()), dispatcher.activity.idle_s
    calls = 2 * MICRO_BATCHES * 2  # forward and backward of 2 MoE layers per micro-batch
    assert round_trips >= calls * links[0].delay_s
    if in_flight == 1:
        assert idle == pytest.approx(round_trips, rel=0.02)
    else:
        assert idle < 0.7 * round_trips
    assert idle < time.perf_counter() - start


def test_the_master_is_idle_only_while_every_running_micro_batch_waits():
    activity = MasterActivity()
    with activity.waiting():  # outside a step (eval, profiling): a wait is idle
        time.sleep(0.02)
    assert activity.idle_s == pytest.approx(0.02, abs=0.015)
    before = activity.idle_s
    with activity.running(), activity.running():
        with activity.waiting():  # one of two waits while the other computes: not idle
            time.sleep(0.03)
            assert activity.idle_s == before
            with activity.waiting():  # both wait: idle
                time.sleep(0.03)
        time.sleep(0.02)
    assert activity.idle_s - before == pytest.approx(0.03, abs=0.015)


@pytest.mark.parametrize("setting, says", [
    ({"cluster": {"master_tp": 2}}, "cluster.master_tp above 1"),
    ({"masters": {"count": 2, "sequence_migration": True}}, "masters.sequence_migration"),
    ({"lora": {"expert_stacks": [], "lora_dropout": 0.1}}, "lora.lora_dropout above 0"),
    ({"training": {"condensation": {"enabled": True}}}, "training.condensation.enabled"),
])
def test_what_cannot_overlap_runs_serially_saying_why(tmp_path, caplog, setting, says):
    sections = {key: dict(value) for key, value in setting.items()}
    sections["training"] = {**sections.get("training", {}), "overlap": {"micro_batches_in_flight": 2}}
    config = JobConfig.from_dict(job_dict(tmp_path / "model", tmp_path / "out", **sections))
    with caplog.at_level(logging.INFO, logger="vela_ray.config"):
        assert config.training.overlap.in_flight(config) == 1
    assert [r.getMessage() for r in caplog.records if says in r.getMessage() and "one at a time" in r.getMessage()]
    plain = JobConfig.from_dict(job_dict(tmp_path / "model", tmp_path / "out",
                                         training={"overlap": {"micro_batches_in_flight": 2}}))
    assert plain.training.overlap.in_flight(plain) == 2
    assert OverlapSection().in_flight(plain) == 1  # the default: today's serial step


# -- the shared expert while the rows are away (`training.overlap.shared_experts`) ------------------------------

SHARED = {"deepseek_v3": "shared_experts", "llama4_text": "shared_expert", "qwen2_moe": "shared_expert"}


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("family", list(SHARED))
def test_shared_experts_computed_while_the_rows_are_away_train_equal_to_peft(family, in_flight):
    """DeepSeek-V3 and Llama 4 call their shared expert after the experts (computed while the rows are away),
    Qwen2-MoE before them (nothing to overlap, nothing harmed); one or two micro-batches in flight, each thread with
    its own notes."""
    torch.set_num_threads(1)
    pair = build_pair(family)
    assert all(b.shared is not None for b in pair.master.peft_model.modules() if isinstance(b, ExpertBroker))
    ref_losses, vela_losses = run_both(pair, STEPS, count=MICRO_BATCHES, in_flight=in_flight)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    got, want = exported_adapter(pair), reference_adapter_state(pair)
    assert got.keys() == want.keys()
    for key, value in want.items():  # AdamW moves a rounding-level gradient's element by ~lr either way
        assert float((got[key] - value).abs().max()) <= 2e-3 * float(value.abs().max()), key


class _WaitsForTheSharedExpert(InProcessTransport):
    """In-process experts whose forward first waits (up to `patience_s`) until the shared expert of the layer's
    block has computed for this call, on the other thread; it notes per layer whether it saw that happen."""

    def __init__(self, shards, patience_s: float):
        super().__init__(shards)
        self.patience_s = patience_s
        self.computed: collections.Counter = collections.Counter()  # layer -> shared expert computations
        self.sent: collections.Counter = collections.Counter()  # layer -> forwards
        self.seen_while_away: list[tuple[int, bool]] = []
        self._changed = threading.Condition()

    def shared_expert_computed(self, layer: int) -> None:
        with self._changed:
            self.computed[layer] += 1
            self._changed.notify_all()

    def forward(self, requests):
        layer = next(iter(requests.values())).layer
        with self._changed:
            seen = self._changed.wait_for(lambda: self.computed[layer] > self.sent[layer], self.patience_s)
            self.sent[layer] += 1
            self.seen_while_away.append((layer, seen))
        return super().forward(requests)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("family", ["deepseek_v3", "llama4_text"])
def test_the_shared_expert_computes_while_its_blocks_rows_are_away_once_per_call(family, overlap):
    """The transport holds every forward until the block's shared expert has computed: on, it computes meanwhile
    (seen in every call, once per block call); off, only once the rows are back (seen in none, each wait given up
    after 0.2 s). The test has teeth: a shared expert computed after the round trip is never seen. The master is
    not idle while it computes the shared expert (a slow one here, 30 ms): on, a forward's wait is mostly work."""
    links = []
    pair = build_pair(family, shared_experts=overlap,
                      make_transport=lambda shards: links.append(
                          _WaitsForTheSharedExpert(shards, 10.0 if overlap else 0.2)) or links[-1])
    link, block_calls = links[0], collections.Counter()

    def slow_shared_expert(layer: int) -> None:
        time.sleep(0.03)
        link.shared_expert_computed(layer)

    for block in find_moe_blocks(pair.master.peft_model):
        # the shared expert's last projection runs once per real computation, a stashed answer skips it
        getattr(block.block, SHARED[family]).down_proj.register_forward_hook(
            lambda *_, layer=block.index: slow_shared_expert(layer))
        block.block.experts.register_forward_pre_hook(lambda *_, layer=block.index: block_calls.update([layer]))
    ref_losses, vela_losses = run_both(pair, 1, count=2)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert link.seen_while_away and all(seen == overlap for _, seen in link.seen_while_away), link.seen_while_away
    assert link.computed == block_calls == link.sent  # 2 micro-batches' forwards: once per block call
    trips, idle = pair.master.dispatcher.round_trip_s, pair.master.dispatcher.activity.idle_s
    if overlap:
        assert idle < trips["backward"] + 0.5 * trips["forward"]
    else:
        assert idle == pytest.approx(trips["backward"] + trips["forward"], rel=0.02)


def test_a_checkpointed_layer_recomputes_its_shared_expert_where_its_forward_did():
    """Under activation checkpointing the recompute computes the shared expert in the broker's call too, with
    nothing away: the checkpoint finds the tensors it saved in the first forward's order (else torch raises
    CheckpointError), each pass computes it once, and the numbers stay peft's."""
    torch.set_num_threads(1)
    pair = checkpointed(build_pair("llama4_text"))
    computed, broker_calls = collections.Counter(), collections.Counter()
    for block in find_moe_blocks(pair.master.peft_model):
        block.block.shared_expert.down_proj.register_forward_hook(
            lambda *_, layer=block.index: computed.update([layer]))
        block.block.experts.register_forward_pre_hook(lambda *_, layer=block.index: broker_calls.update([layer]))
    ref_losses, vela_losses = run_both(pair, 2)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert computed == broker_calls  # forward and recompute, once each
    assert sum(broker_calls.values()) == 2 * 2 * 2 * len(broker_calls)  # steps x micro-batches x (forward, recompute)


def test_a_block_calling_its_shared_expert_on_another_tensor_stops_the_overlap_and_stays_exact(caplog):
    """Aria calls its shared expert on a new view of its router's tokens: the first call finds the stash was computed
    on another tensor, computes as the block asks and stops the overlap for that block, saying so once; checkpointed,
    the recompute does as its forward did (the stash again, unused). Equal to peft throughout."""
    torch.set_num_threads(1)
    pair = checkpointed(build_pair("aria_text"))
    with caplog.at_level(logging.WARNING, logger="vela_ray.model.shared_expert"):
        ref_losses, vela_losses = run_both(pair, 2)
    torch.testing.assert_close(torch.tensor(vela_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    shared = [block.block.experts.shared for block in find_moe_blocks(pair.master.peft_model)]
    assert shared and not any(expert.serves for expert in shared)
    assert len([r for r in caplog.records if "other inputs than its router's" in r.getMessage()]) == len(shared)


def test_shared_experts_off_leaves_the_blocks_as_transformers_built_them():
    """Off: every router and shared expert is the transformers class itself and no broker has a shared expert.
    On: the same modules under the same names, so peft's targets and the adapter's keys do not move."""
    on, off = build_pair("llama4_text"), build_pair("llama4_text", shared_experts=False)
    for block in find_moe_blocks(off.master.peft_model):
        assert type(block.block.shared_expert) is Llama4TextMLP and type(block.block.router) is Llama4Router
        assert block.block.experts.shared is None
    for block in find_moe_blocks(on.master.peft_model):
        assert isinstance(block.block.shared_expert, Llama4TextMLP) and isinstance(block.block.router, Llama4Router)
        assert type(block.block.shared_expert).__name__ == "Llama4TextMLP"
    assert [n for n, _ in on.master.peft_model.named_parameters()] == \
        [n for n, _ in off.master.peft_model.named_parameters()]
    assert exported_adapter(on).keys() == exported_adapter(off).keys() == reference_adapter_state(on).keys()


def test_shared_experts_with_tensor_parallel_masters_run_after_the_rows_saying_why(tmp_path, caplog):
    tp = JobConfig.from_dict(job_dict(tmp_path / "model", tmp_path / "out", cluster={"master_tp": 2}))
    with caplog.at_level(logging.INFO, logger="vela_ray.config"):
        assert not tp.training.overlap.overlaps_shared_experts(tp)
    assert [r for r in caplog.records if "cluster.master_tp above 1" in r.getMessage()
            and "training.overlap.shared_experts" in r.getMessage()]
    plain = JobConfig.from_dict(job_dict(tmp_path / "model", tmp_path / "out"))
    assert plain.training.overlap.overlaps_shared_experts(plain)  # the default: on
    off = JobConfig.from_dict(job_dict(tmp_path / "model", tmp_path / "out",
                                       training={"overlap": {"shared_experts": False}}))
    assert not off.training.overlap.overlaps_shared_experts(off)
