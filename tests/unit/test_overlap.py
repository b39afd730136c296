"""Several micro-batches in flight on a master (`training.overlap`, issue 46): each driven by a thread of its
own, so one computes while another's rows are at the experts.

Exact: against single-process peft (losses rel 1e-5, adapters to rounding) on a plain MoE, a shared expert
(Qwen2-MoE), MLA with a shared expert (DeepSeek-V3) and gpt-oss's biased experts; the step really has several
micro-batches at the experts at once; and the settings that need the serial step get it, saying why.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from tests.equivalence import build_pair, exported_adapter, reference_adapter_state, run_both
from tests.fixtures import job_dict
from vela_ray.config import JobConfig, OverlapSection
from vela_ray.model.activity import MasterActivity
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
