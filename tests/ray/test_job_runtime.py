"""The whole runtime through Ray: VelaJob -> MasterActor -> ExpertManagers, against plain peft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, run_in_process
from vela_ray.api import VelaJob
from vela_ray.config import JobConfig
from vela_ray.observability.report import summary_text

STEPS = 4


# Qwen3-MoE's step over both Ray data planes is tests/ray/test_transport_conformance.py's; a whole job
# more would add half a minute of CI for no path that Mixtral's does not take. The same holds for gpt-oss (its
# biases and clamped activation are the ExpertManager's, tested in one process by test_every_family.py: rows
# cross the data planes whatever the family computes on them). The collective plane (the
# default) carries `one_on_master`'s whole job: its two actors serve over it, beside a worker in the
# master's process.
SECTIONS = {"object_ref": {"data_plane": {"transport": "object_ref"}},
            "all_on_master": {"cluster": {"workers_on_master": 3}},  # the one-GPU configuration: no worker actors
            "one_on_master": {"cluster": {"workers_on_master": 1}}}  # 2 actors + 1 in-process


@pytest.mark.parametrize("family,transport", [("mixtral", "object_ref"), ("mixtral", "all_on_master"),
                                              ("mixtral", "one_on_master")])
def test_job_through_ray_matches_single_process_peft(ray_session, tmp_path, family, transport):
    model_dir = make_checkpoint(tmp_path / "model", family)
    job = job_dict(model_dir, tmp_path / "out", steps=STEPS,
                   lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))},
                   **SECTIONS[transport],
                   placement={"cost_model": "communication+compute"},
                   training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}})
    if transport == "one_on_master":  # a tracker fed by the MasterActor, from its workers' reports
        job["training"]["report_to"] = ["tensorboard"]
    config = JobConfig.from_dict(job)
    summary = VelaJob(config).run()

    ref_losses, ref_state = reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    exported = load_file(Path(summary.adapter_dir) / "adapter_model.safetensors")
    assert exported.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert float((exported[key] - value).abs().max()) <= 2e-3 * float(value.abs().max()), key

    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["losses"] == summary.losses
    assert sum(written["traffic_bytes_by_tier"].values()) > 0
    used_tiers = {tier for tier, n in written["traffic_bytes_by_tier"].items() if n}
    assert written["data_plane"] == {"object_ref": "object_ref", "all_on_master": "in-process",
                                     "one_on_master": "collective (gloo) + in-process"}[transport]
    assert f"over {written['data_plane']}" in summary_text(tmp_path / "out")  # what the user reads at the end
    assert written["data_plane"] in (tmp_path / "out" / "report.html").read_text()
    if transport == "all_on_master":  # no worker actors: every row went by direct call
        assert used_tiers == {"same_process"}
        assert written["master_node"] not in ("", "local")
    if transport == "one_on_master":  # worker 2 in the master's process, the others over the collective plane
        assert written["worker_tiers"] == ["same_node", "same_node", "same_process"] and len(used_tiers) == 2
        assert len(set(json.loads((tmp_path / "out" / "workers.json").read_text())["pids"])) == 3
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
        events.Reload()
        assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(summary.losses, rel=1e-6)
        assert all(e.value > 0 for e in events.Scalars("time/worker_compute_max_s"))
    assert (tmp_path / "out" / "placement.json").is_file() and (tmp_path / "out" / "profile.npy").is_file()
    placed = written["placement"]  # the compute-aware cost model measured every worker's compute per row
    assert placed["cost_model"] == "communication+compute"
    compute = placed["problem"]["compute_seconds_per_row"]
    assert len(compute) == config.cluster.num_workers
    assert all(0 < s < 0.01 for s in compute)
    assert 0 < placed["expected_comm_time_s"] < placed["expected_step_time_s"]
    split = written["step_breakdown_s"]
    assert 0 < split["expert_round_trip"] < split["step"] and split["worker_compute_sum"] > 0
    for step in summary.history:  # serial: the master idles for its whole wait on the experts
        assert step.master_idle_s == pytest.approx(step.expert_round_trip_s, rel=0.05, abs=2e-3)
    assert 0 < split["master"] < split["step"]


def test_a_family_outside_the_tested_set_is_verified_at_preflight_and_trains(ray_session, tmp_path, monkeypatch):
    """As after a transformers upgrade: Mixtral is not in the tested set, so preflight checks a debug-size copy
    against peft before Ray starts; the job then trains equal to peft and its summary says how it was verified."""
    from vela_ray.training import family_check

    record = family_check.verified_families().model_dump()
    record["trained"] = [f for f in record["trained"] if f != "mixtral"]
    monkeypatch.setattr(family_check, "VERIFIED_FILE", tmp_path / "verified.json")
    family_check.VERIFIED_FILE.write_text(json.dumps(record))

    model_dir = make_checkpoint(tmp_path / "model", "mixtral")
    job = job_dict(model_dir, tmp_path / "out", steps=2,
                   lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))},
                   **SECTIONS["all_on_master"])
    config = JobConfig.from_dict(job)
    summary = VelaJob(config).run()
    assert summary.family_check.startswith("mixtral: verified by the preflight (not in the tested set")
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(reference_losses(config)[0]),
                               rtol=1e-5, atol=0)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["family_check"] == summary.family_check
    assert f"family {summary.family_check}" in summary_text(tmp_path / "out")


def test_a_model_with_its_own_code_trains_through_ray_equal_to_peft(ray_session, tmp_path):
    """`model.trust_remote_code`: the master and each ExpertManager run the model's own code (registered in
    every process that reads the checkpoint), after preflight checked a debug-size copy against peft."""
    from tests.unit.test_family_checks import remote_code_checkpoint

    from vela_ray.model.loading import register_model_code

    model_dir = remote_code_checkpoint(tmp_path / "model")
    register_model_code(str(model_dir.resolve()))  # this process builds the peft reference from it too
    job = job_dict(model_dir, tmp_path / "out", steps=2, model={"trust_remote_code": True},
                   lora={"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))},
                   data_plane={"transport": "object_ref"})
    config = JobConfig.from_dict(job)
    summary = VelaJob(config).run()
    assert summary.family_check.startswith("mixtral_remote: verified by the preflight")
    assert len(set(json.loads((tmp_path / "out" / "workers.json").read_text())["pids"])) == 3  # real actors
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(reference_losses(config)[0]),
                               rtol=1e-5, atol=0)


def test_a_checkpointed_job_through_ray_equals_peft_and_sends_what_an_unchecked_one_does(ray_session, tmp_path):
    """Activation checkpointing over the collective plane (the default): ExpertManager actors in their own
    processes, the master recomputing its layers and replaying the experts' outputs. The unchecked job it is held to
    runs in one process: what the brokers send each worker does not depend on the pool or the data plane (every
    rows' byte counted once, at the broker), and a Ray job more would add half a minute of CI."""
    model_dir = make_checkpoint(tmp_path / "model", "mixtral")
    lora = {"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, tmp_path / "init"))}
    configs = {on: JobConfig.from_dict(job_dict(
        model_dir, tmp_path / f"out-{on}", steps=3, lora=lora,
        training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}, "activation_checkpointing": on}))
        for on in (False, True)}
    summaries = {True: VelaJob(configs[True]).run(), False: run_in_process(configs[False])}
    assert summaries[True].data_plane == "collective (gloo)"
    ref_losses, _ = reference_losses(configs[True])
    torch.testing.assert_close(torch.tensor(summaries[True].losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert summaries[True].traffic_bytes_by_worker == summaries[False].traffic_bytes_by_worker
    assert summaries[True].tokens_routed == summaries[False].tokens_routed
