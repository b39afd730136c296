"""A tensor-parallel master through Ray (`cluster.master_tp`): master 0's backbone sharded over MasterRank actors
on its node (gloo here, NCCL on GPUs), each rank sending its share of every MoE layer's rows.

Against single-process transformers + peft and against the same job with one master process: equal losses,
eval losses and exported adapter; the same bytes to every worker (each row sent once, by one rank, so the
experts' LoRA gradients reach the workers once); checkpoints holding the full tensors (a run saved at one TP
degree resumes at another: tests/unit/test_master_group.py, in one process).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from actors.masters import RANK_FAILURE_GRACE_S, RANK_LOSS_GRACE_S, _connection_broke, _raise_if_failed
from benchmarks._harness import kill_when
from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, run_in_process
from vela_ray.api import VelaJob
from vela_ray.config import JobConfig
from vela_ray.errors import WorkerLostError
from vela_ray.model.experts import LoraSpec
from vela_ray.observability.report import summary_text

STEPS, EVERY = 4, 2


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """The same job at master_tp 1 and 2 (checkpoints every EVERY steps, eval every EVERY steps): at 2 through Ray,
    at 1 in one process (the one master the TP ranks are held to: its losses, eval losses, adapter, checkpoint and
    the bytes its brokers send each worker are the pool's and plane's alike; a Ray job more would add half a
    minute of CI)."""
    root = tmp_path_factory.mktemp("master_tp")
    model_dir = make_checkpoint(root / "model", "mixtral")
    lora = {"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model_dir, root / "init"))}

    def job(tp: int, out: Path) -> dict:
        # one master over object refs, its TP ranks each over collective planes of their own: the same numbers
        return job_dict(model_dir, out, steps=STEPS, lora=lora, cluster={"master_tp": tp},
                        data_plane={"transport": "collective" if tp > 1 else "object_ref"},
                        checkpoint={"every": EVERY, "keep": 10},
                        training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1},
                                  "eval_every": EVERY})

    jobs = {tp: job(tp, root / f"tp{tp}") for tp in (1, 2)}
    summaries = {1: run_in_process(JobConfig.from_dict(jobs[1])), 2: VelaJob(JobConfig.from_dict(jobs[2])).run()}
    return {"jobs": jobs, "summaries": summaries, "root": root}


def _adapter(summary) -> dict[str, torch.Tensor]:
    return load_file(Path(summary.adapter_dir) / "adapter_model.safetensors")


def _assert_close_to_scale(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Element-wise within 2e-3 of each tensor's scale, as tests/ray/test_job_runtime.py holds adapters to peft's:
    AdamW's first steps move every element by about lr * sign(grad), so an element whose gradient is rounding-level
    lands up to ~lr away in two runs that sum in another order (tests/tp_harness.py, SMOOTH_OPTIM)."""
    for key, value in want.items():
        assert float((got[key] - value).abs().max()) <= 2e-3 * float(value.abs().max()), key


def test_a_tensor_parallel_master_trains_equal_to_peft_and_to_one_master(runs):
    one, two = runs["summaries"][1], runs["summaries"][2]
    ref_losses, ref_state = reference_losses(JobConfig.from_dict(runs["jobs"][2]))
    torch.testing.assert_close(torch.tensor(two.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    evals = [[h.eval_loss for h in s.history if h.eval_loss is not None] for s in (one, two)]
    assert len(evals[1]) == STEPS // EVERY
    torch.testing.assert_close(torch.tensor(evals[1]), torch.tensor(evals[0]), rtol=1e-5, atol=0)
    exported = _adapter(two)
    assert exported.keys() == ref_state.keys()
    for reference in (ref_state, _adapter(one)):
        _assert_close_to_scale(exported, reference)
    # each routed row went once, from one rank: the workers saw what one master sends them
    assert two.traffic_bytes_by_worker == one.traffic_bytes_by_worker
    assert two.tokens_routed == one.tokens_routed
    pids = json.loads((runs["root"] / "tp2" / "workers.json").read_text())
    assert len(set(pids["master_pids"])) == 2  # master 0 and its second rank, each a process
    assert two.master_tp == 2
    assert "1 data-parallel master on 1 node(s), each over 2 tensor-parallel ranks of its node" in summary_text(
        runs["root"] / "tp2")


@pytest.mark.parametrize("tp,shard_frozen", [(2, False), (2, True)], ids=["2x2", "2x2-fsdp2"])
def test_two_data_parallel_masters_of_tp_ranks_train_equal_to_peft(runs, tmp_path, tp, shard_frozen):
    """The 2-D mesh: masters.count 2 x master_tp `tp`, 2*tp master processes; each master's ranks split its half of
    every micro-batch's rows, the backbone gradients are summed between the masters' ranks of one TP index; with
    `masters.shard_frozen_backbone` each master also keeps half of every decoder layer's frozen weights (of its TP
    shard) with FSDP2 and all-gathers them from the other as it runs the layer, eval and the routing profile
    included. The 2x2 mesh runs with the features it composes with."""
    one = runs["summaries"][1]
    job = json.loads(json.dumps(runs["jobs"][2]))
    # without FSDP2 the features compose on the mesh: every rank on its own collective planes, sequences migrating
    # between the masters (each master's ranks deciding together), condensation on every rank (exact at 1.0)
    composed = not shard_frozen
    job["masters"] = {"count": 2, "shard_frozen_backbone": shard_frozen, "sequence_migration": composed}
    if composed:  # and an ExpertManager in master 0's process, which the 3 other ranks' planes reach through it
        job["training"]["condensation"] = {"enabled": True, "threshold": 1.0}
        job["cluster"]["workers_on_master"] = 1
    job["cluster"]["master_tp"] = tp
    job["output"]["dir"] = str(tmp_path / "out")
    summary = VelaJob(JobConfig.from_dict(job)).run()
    if composed:
        assert summary.sequence_moves["micro_batches"] > 0 and summary.condensation.rows_seen > 0
    ref_losses, ref_state = reference_losses(JobConfig.from_dict(job))
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    evals = [[h.eval_loss for h in s.history if h.eval_loss is not None] for s in (one, summary)]
    torch.testing.assert_close(torch.tensor(evals[1]), torch.tensor(evals[0]), rtol=1e-5, atol=0)
    _assert_close_to_scale(_adapter(summary), ref_state)
    assert summary.tokens_routed == one.tokens_routed  # every row sent once, by one of the ranks
    assert len(set(json.loads((tmp_path / "out" / "workers.json").read_text())["master_pids"])) == 2 * tp


def test_a_tensor_parallel_master_with_lora_dropout_and_its_workers_beside_it_trains_equal_to_peft(ray_session, tmp_path):
    """LoRA dropout on the backbone (the experts frozen, as peft requires): master 0 seeds each step by
    (training.seed, step), its second rank takes master 0's RNG state, and a row-parallel lora_A's rank applies its
    columns of the whole mask, so the job draws peft's masks: the losses of peft seeded alike."""
    model_dir = make_checkpoint(tmp_path / "model", "mixtral")
    start = init_adapter(model_dir, tmp_path / "init", LoraSpec(r=4, alpha=8, expert_stacks=()))
    lora = {"r": 4, "alpha": 8, "init_adapter": str(start), "expert_stacks": [], "lora_dropout": 0.3}
    # every ExpertManager in master 0's process (no worker actors), which the second rank's object refs reach
    # through it (the 2x2 mesh's collective planes reach one such worker beside the actors)
    job = job_dict(model_dir, tmp_path / "out", steps=2, lora=lora, cluster={"master_tp": 2, "workers_on_master": 3},
                   data_plane={"transport": "object_ref"},
                   training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}})
    config = JobConfig.from_dict(job)
    summary = VelaJob(config).run()
    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    plain_losses, _ = reference_losses(config.model_copy(update={"lora": config.lora.model_copy(
        update={"lora_dropout": 0.0})}))
    assert plain_losses[0] != ref_losses[0]  # dropout was on


def test_a_checkpoint_holds_full_tensors_whatever_the_tp_degree(runs):
    saved = {tp: load_file(runs["root"] / f"tp{tp}" / "checkpoints" / f"step-{EVERY:06d}" / "backbone.safetensors")
             for tp in (1, 2)}
    lora = [k for k in saved[1] if ".lora_" in k]
    assert lora and saved[2].keys() == saved[1].keys()
    assert all(saved[2][k].shape == saved[1][k].shape for k in saved[1])  # AdamW's moments too
    _assert_close_to_scale(saved[2], {k: saved[1][k] for k in lora})


def test_a_killed_tensor_parallel_rank_stops_the_run_naming_it_and_the_checkpoint(runs, tmp_path):
    """Master 0's second rank SIGKILLed mid-run: master 0's collectives break at once (gloo), and the run stops
    in one line naming a master process and the checkpoint to resume from, not after the group's timeout."""
    job = json.loads(json.dumps(runs["jobs"][2]))
    out = tmp_path / "out"
    job["output"]["dir"], job["training"]["steps"] = str(out), 40
    killer, killed = kill_when(out, (out / "checkpoints" / "step-000002").is_dir, delay_s=0.2, victim="master_pids")
    with pytest.raises(WorkerLostError, match=r"^another master process \(a MasterRank: a data-parallel master or a "
                                              r"tensor-parallel rank\) died during step \d+; .*--resume"):
        VelaJob(JobConfig.from_dict(job)).run()
    killer.join(timeout=10)
    assert killed, "master 0's second rank was never killed"
    assert time.monotonic() - killed["at"] < 60  # named well before the group's 300 s timeout


@ray.remote(max_restarts=0, max_task_retries=0)
class _Rank:
    def dies_after(self, seconds: float) -> None:
        time.sleep(seconds)
        os._exit(1)

    def sleeps(self, seconds: float) -> None:
        time.sleep(seconds)


def test_master_0_waits_for_ray_to_name_a_dead_rank_after_a_broken_connection_and_no_longer(ray_session):
    """After master 0's collective broke (a peer's socket reset), the rank whose death broke it is named even when
    Ray reports it seconds later (it took over 5 s on a loaded 2-core CI machine, and the run stopped with gloo's
    bare error), and as soon as Ray does: a live rank still waiting in its collective is not waited for."""
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:41698: Connection reset by peer")
    assert _connection_broke(gone) and not _connection_broke(ValueError("labels: expected a tensor"))
    dying, waiting = _Rank.remote(), _Rank.remote()
    start = time.monotonic()
    with pytest.raises(ray.exceptions.RayActorError):
        _raise_if_failed([waiting.sleeps.remote(120.0), dying.dies_after.remote(RANK_FAILURE_GRACE_S + 2)],
                         RANK_LOSS_GRACE_S)
    assert RANK_FAILURE_GRACE_S + 2 <= time.monotonic() - start < RANK_LOSS_GRACE_S
    ray.kill(waiting)


def test_a_tensor_parallel_master_recovers_from_a_killed_worker_and_a_killed_rank(runs, tmp_path):
    """`on_worker_loss: recover` with master 0 over 2 TP ranks: an ExpertManager SIGKILLed after the step-2
    checkpoint, then master 0's second rank after the step-4 one. Each time the master group is formed again
    (master 0 rebuilt the one way every rank is, its TP group with it), the run rolls back and replays, and it
    trains as peft does."""
    job = json.loads(json.dumps(runs["jobs"][2]))
    out = tmp_path / "out"
    job["output"]["dir"], job["training"]["steps"] = str(out), 6
    job["fault_tolerance"] = {"on_worker_loss": "recover"}
    job["data_plane"] = {"transport": "object_ref"}  # test_checkpoint_resume recovers 2 masters' collective planes
    checkpoints = out / "checkpoints"
    killers = [kill_when(out, (checkpoints / "step-000002").is_dir, delay_s=0.2, victim="pids"),
               kill_when(out, (checkpoints / "step-000004").is_dir, delay_s=0.2, victim="master_pids")]
    config = JobConfig.from_dict(job)
    summary = VelaJob(config).run()
    for killer, killed in killers:
        killer.join(timeout=10)
        assert killed, "a victim was never killed"
    assert [r.workers for r in summary.recoveries] == [[1], []]
    assert [h.step for h in summary.history] == list(range(1, 7))
    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def test_what_a_tensor_parallel_master_cannot_do_yet_is_refused_in_one_line(tmp_path):
    base = job_dict(tmp_path / "model", tmp_path / "out", cluster={"master_tp": 2})
    for section, values, named in [("training", {"method": "zo"}, "training.method: zo")]:
        job = json.loads(json.dumps(base))
        job[section] = {**job.get(section, {}), **values}
        with pytest.raises(ValueError, match=f"{named} and several master processes .* do not combine"):
            JobConfig.from_dict(job)
    assert JobConfig.from_dict(base).data_plane.transport == "collective"  # every rank forms planes of its own
    dropout = json.loads(json.dumps(base))
    dropout["lora"] = {"expert_stacks": [], "lora_dropout": 0.1}
    assert JobConfig.from_dict(dropout).lora.lora_dropout == 0.1  # the ranks draw one mask (no longer refused)
