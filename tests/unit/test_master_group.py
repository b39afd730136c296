"""The masters as one group in one process (`runtime.masters.MasterGroup` over `runtime.local.ThreadRanks`): a
tensor-parallel master, and data-parallel masters of tensor-parallel ranks, each rank a thread with gloo groups of
its own, train equal to single-process transformers + peft, with the bytes one master sends; with token
condensation every rank condenses the rows it sends, at master 0's threshold, and the run counts them all."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, run_in_process
from vela_ray.config import JobConfig
from vela_ray.model.condensation import Condenser
from vela_ray.model.traffic import DIRECTIONS
from vela_ray.runtime.masters import MasterMesh

STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model = make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral", "mixtral")
    init_adapter(model, model.parent / "adapter")
    return model


def _config(model_dir: Path, out: Path, masters: int = 1, tp: int = 1, condensation: dict | None = None,
            **sections) -> JobConfig:
    sections.setdefault("lora", {"r": 4, "alpha": 8, "init_adapter": str(model_dir.parent / "adapter")})
    training = {"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1}, "batch_size": 4,
                "micro_batch_size": 2, "eval_every": 2, **({"condensation": condensation} if condensation else {})}
    return JobConfig.from_dict(job_dict(model_dir, out, steps=STEPS, training=training, masters={"count": masters},
                                        cluster={"master_tp": tp}, data_plane={"transport": "object_ref"},
                                        **sections))


def _adapter(summary) -> dict[str, torch.Tensor]:
    return load_file(Path(summary.adapter_dir) / "adapter_model.safetensors")


def test_the_mesh_numbers_master_zero_first_then_each_masters_ranks():
    mesh = MasterMesh(dp=2, tp=3)
    assert mesh.ranks()[:4] == [(0, 0, 0), (0, 1, 0), (0, 2, 0), (1, 0, 0)]
    assert [mesh.flat(m, t, s) for m, t, s in mesh.ranks()] == list(range(6))
    stages = MasterMesh(dp=2, pp=2)  # a master's pipeline stages follow each other, as its TP ranks do
    assert stages.ranks() == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    assert [stages.flat(m, t, s) for m, t, s in stages.ranks()] == list(range(4))


@pytest.mark.job
@pytest.mark.parametrize("masters,tp", [(1, 2), (2, 2)])
def test_tensor_parallel_ranks_in_one_process_train_equal_to_peft(model_dir, tmp_path, masters, tp):
    one = run_in_process(_config(model_dir, tmp_path / "one"))
    config = _config(model_dir, tmp_path / "tp", masters, tp)
    split = run_in_process(config)
    ref_losses, ref_state = reference_losses(config)
    torch.testing.assert_close(torch.tensor(split.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    evals = [[h.eval_loss for h in s.history if h.eval_loss is not None] for s in (one, split)]
    torch.testing.assert_close(torch.tensor(evals[1]), torch.tensor(evals[0]), rtol=1e-5, atol=0)
    exported = _adapter(split)
    assert exported.keys() == ref_state.keys()
    for key, value in _adapter(one).items():  # AdamW's first steps amplify a different summation order
        assert float((exported[key] - value).abs().max()) <= 2e-3 * float(value.abs().max()), key
    # each routed row went once, from one rank: the workers saw what one master sends them
    assert split.traffic_bytes_by_worker == one.traffic_bytes_by_worker
    assert split.tokens_routed == one.tokens_routed
    assert split.master_tp == tp


@pytest.mark.job
@pytest.mark.parametrize("saved_tp,resumed_tp", [(2, 1), (1, 2)])
def test_a_run_saved_at_one_tp_degree_resumes_at_another(model_dir, tmp_path, saved_tp, resumed_tp):
    """A checkpoint holds full tensors whatever the TP degree (`tensor_parallel.state`): a run saved at step 2 by
    `saved_tp` ranks resumes on `resumed_tp` ranks and steps on as the saved run did."""
    saved = run_in_process(_config(model_dir, tmp_path / "saved", tp=saved_tp, checkpoint={"every": 2}))
    job = _config(model_dir, tmp_path / "resumed", tp=resumed_tp).model_dump(mode="json")
    job["checkpoint"]["resume"] = str(tmp_path / "saved" / "checkpoints" / "step-000002")
    resumed = run_in_process(JobConfig.from_dict(job))
    assert [r.step for r in resumed.resumes] == [2]
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(saved.losses), rtol=1e-5, atol=0)


def test_a_setting_threads_cannot_host_is_refused_with_its_fix(model_dir, tmp_path):
    config = JobConfig.from_dict(job_dict(model_dir, tmp_path / "fsdp", steps=1,
                                          masters={"count": 2, "shard_frozen_backbone": True},
                                          data_plane={"transport": "object_ref"},
                                          training={"batch_size": 2}))
    with pytest.raises(ValueError, match="masters.shard_frozen_backbone.*VelaJob"):
        run_in_process(config)


@pytest.mark.job
def test_tensor_parallel_masters_migrate_sequences_as_one_master_per_group_does(model_dir, tmp_path):
    """Sequence migration over 3 masters of 2 TP ranks: each master's ranks decide together on their shares'
    routing (the same moves as TP 1), every rank moves its own copy of the hidden states (T times the bytes), and
    the losses equal peft's. The combine happens at home: the ranks gather a layer's outputs among themselves."""
    nodes = ["node-a", "node-b", "node-c"]

    def run(tp: int, out: Path):
        config = JobConfig.from_dict(job_dict(
            model_dir, out, steps=3, training={"optimizer": {"lr": 5e-3, "warmup_steps": 1}, "batch_size": 6,
                                               "micro_batch_size": 6},
            lora={"r": 4, "alpha": 8, "init_adapter": str(model_dir.parent / "adapter")},
            masters={"count": 3, "sequence_migration": True}, cluster={"master_tp": tp},
            data_plane={"transport": "object_ref"}))
        return config, run_in_process(config, master_node=nodes[0], worker_nodes=nodes)

    config, split = run(2, tmp_path / "tp2")
    _, whole = run(1, tmp_path / "tp1")
    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(split.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    moves, one = split.sequence_moves, whole.sequence_moves
    assert moves["moves"] == one["moves"] > 0 and moves["micro_batches"] == one["micro_batches"]
    # TP 1 combines on the new master (it relays rows besides moving hidden states); TP 2 at home
    assert moves["sent_bytes"] == 2 * (one["sent_bytes"] - one["relay_bytes"]) and moves["relayed_rows"] == 0
    assert split.traffic_bytes_by_worker == whole.traffic_bytes_by_worker


@pytest.mark.job
def test_a_tensor_parallel_deepseek_v3_master_trains_equal_to_peft(tmp_path):
    """MLA attention split by heads (its low-rank q/kv projections replicated), a dense first layer and shared
    experts beside the brokers; with activation checkpointing (each rank recomputes its layers, their collectives
    again, and replays the experts' outputs), as the deploy job trains."""
    model = make_checkpoint(tmp_path / "model", "deepseek_v3")
    lora = {"r": 4, "alpha": 8, "init_adapter": str(init_adapter(model, tmp_path / "init"))}
    config = JobConfig.from_dict(job_dict(
        model, tmp_path / "out", steps=3, lora=lora, cluster={"master_tp": 2},
        training={"optimizer": {"lr": 5e-3, "max_grad_norm": 0.5, "warmup_steps": 1},
                  "activation_checkpointing": True}))
    summary = run_in_process(config)
    ref_losses, ref_state = reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    exported = _adapter(summary)
    for key, value in ref_state.items():
        assert float((exported[key] - value).abs().max()) <= 2e-3 * float(value.abs().max()), key
# --- token condensation on every rank -----------------------------------------------------------------------

ROW_BYTES = 32 * 4  # debug Mixtral: hidden 32, float32


@pytest.fixture
def thresholds(monkeypatch) -> dict[int, list[float]]:
    """Each condenser's (one per rank) threshold at every layer of every training forward, in order."""
    seen: dict[int, list[float]] = defaultdict(list)
    select = Condenser.select

    def recording(self, layer, *args):
        seen[id(self)].append(self.threshold)
        return select(self, layer, *args)

    monkeypatch.setattr(Condenser, "select", recording)
    return seen


@pytest.mark.job
@pytest.mark.parametrize("masters,tp", [(2, 1), (1, 2)])
def test_every_rank_condenses_its_own_rows_at_master_zeros_threshold(model_dir, tmp_path, thresholds, masters, tp):
    """LOSSY: each data-parallel master condenses its share of the batch, each TP rank its share of each layer's
    rows; every rank's adaptive threshold follows the whole batch's loss, as master 0's does, and the summary
    counts every rank's rows (each routed row once, by the rank that sent it)."""
    exact = run_in_process(_config(model_dir, tmp_path / "exact", masters, tp))
    on = run_in_process(_config(model_dir, tmp_path / "on", masters, tp, condensation={"enabled": True}))
    assert all(math.isfinite(loss) for loss in on.losses) and on.losses[0] != exact.losses[0]
    torch.testing.assert_close(torch.tensor(on.losses), torch.tensor(exact.losses), rtol=2e-2, atol=0)
    record = on.condensation
    assert record.threshold_policy == "adaptive" and 0 < record.rows_condensed < record.rows_seen
    assert record.rows_seen == sum(map(sum, on.tokens_routed))  # not master 0's share alone
    assert record.bytes_saved == dict.fromkeys(DIRECTIONS, record.rows_condensed * ROW_BYTES)
    exact_total, on_total = sum(exact.traffic_bytes_by_tier.values()), sum(on.traffic_bytes_by_tier.values())
    assert exact_total - on_total == record.bytes_saved_total  # what no rank sent is what they say they saved
    # one condenser per rank, each at the same threshold as master 0's at every layer of every step
    assert len(thresholds) == masters * tp
    first, *others = thresholds.values()
    assert all(other == first for other in others) and len(set(first)) > 1  # the threshold moved with the loss


@pytest.mark.job
@pytest.mark.parametrize("masters,tp", [(2, 1), (1, 2)])
def test_condensation_at_threshold_one_condenses_nothing_and_trains_equal_to_peft(model_dir, tmp_path, masters,
                                                                                   tp):
    config = _config(model_dir, tmp_path / "one", masters, tp, condensation={"enabled": True, "threshold": 1.0})
    summary = run_in_process(config)
    ref_losses, _ = reference_losses(config)
    torch.testing.assert_close(torch.tensor(summary.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    record = summary.condensation
    assert record.rows_seen == sum(map(sum, summary.tokens_routed)) > 0
    assert record.rows_condensed == 0 and record.bytes_saved_total == 0


@pytest.mark.job
def test_a_resumed_run_condenses_on_every_rank_at_the_threshold_it_had(model_dir, tmp_path, thresholds):
    """Master 0's checkpointed losses go into every rank's condenser: the resumed step condenses at the
    threshold the uninterrupted run's did, on both masters."""
    whole = _config(model_dir, tmp_path / "a", 2, condensation={"enabled": True}, checkpoint={"every": 2})
    run_in_process(whole)
    at_step_3 = {values[-1] for values in thresholds.values()}
    assert len(at_step_3) == 1 and at_step_3 != {0.5}
    thresholds.clear()
    job = whole.model_dump(mode="json")
    job["output"]["dir"] = str(tmp_path / "b")
    job["checkpoint"]["resume"] = str(tmp_path / "a" / "checkpoints" / "step-000002")
    resumed = run_in_process(JobConfig.from_dict(job))
    assert resumed.condensation.rows_condensed > 0
    assert len(thresholds) == 2 and {t for values in thresholds.values() for t in values} == at_step_3


@pytest.mark.job
def test_condensing_masters_migrate_sequences(model_dir, tmp_path, monkeypatch):
    """Condensation with sequence migration (each master condenses the rows of the sequences it holds; the
    combine happens at home): a moved sequence's rows are not taken for the ones before by the next layer's
    history, which each master forgets when its sequences move."""
    forgot = []
    forget = Condenser.forget_history
    monkeypatch.setattr(Condenser, "forget_history", lambda self: (forgot.append(id(self)), forget(self)))
    config = JobConfig.from_dict(job_dict(
        model_dir, tmp_path / "out", steps=3, training={"optimizer": {"lr": 5e-3, "warmup_steps": 1},
                                                        "batch_size": 6, "micro_batch_size": 6,
                                                        "condensation": {"enabled": True}},
        lora={"r": 4, "alpha": 8, "init_adapter": str(model_dir.parent / "adapter")},
        masters={"count": 3, "sequence_migration": True}, data_plane={"transport": "object_ref"}))
    summary = run_in_process(config, master_node="node-a", worker_nodes=["node-a", "node-b", "node-c"])
    assert all(math.isfinite(loss) for loss in summary.losses)
    assert summary.sequence_moves["moves"] > 0 and summary.sequence_moves["relayed_rows"] == 0
    record = summary.condensation
    assert 0 < record.rows_condensed < record.rows_seen == sum(map(sum, summary.tokens_routed))
    assert len(set(forgot)) >= 2  # a master gives as many sequences as it takes: movers come in twos or more
