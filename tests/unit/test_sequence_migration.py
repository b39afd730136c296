"""Sequence migration (LUFFY Sec. IV) among data-parallel masters in one process: sequences move to where
their rows were served and back, and training is plain peft's on the whole batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fixtures import init_adapter, job_dict, make_checkpoint, reference_losses, run_in_process
from vela_ray.config import JobConfig
from vela_ray.observability.metrics import MemoryMetricsBackend, MetricsSink
from vela_ray.observability.report import summary_text
from vela_ray.training.sequence_migration import NodeMap, one_mask, reslot

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NODES = ["node-a", "node-b", "node-c"]  # worker n on node n; master m on node m (as Ray places them)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    model = make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")
    init_adapter(model, model.parent / "adapter")
    return model


def _run(model_dir: Path, out: Path, migration: bool, backend: MemoryMetricsBackend | None = None,
         combine: str = "new_master"):
    training = {"optimizer": {"lr": 5e-3, "warmup_steps": 1}, "batch_size": 6, "micro_batch_size": 6}
    config = JobConfig.from_dict(job_dict(
        model_dir, out, steps=3, training=training,
        lora={"r": 4, "alpha": 8, "init_adapter": str(model_dir.parent / "adapter")},
        masters={"count": 3, "sequence_migration": migration, "sequence_migration_combine": combine}))
    return config, run_in_process(config, metrics=MetricsSink(backend or MemoryMetricsBackend()),
                                  master_node=NODES[0], worker_nodes=NODES)


def _adapter(summary) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(summary.adapter_dir) / "adapter_model.safetensors")


@pytest.mark.job
def test_migrating_sequences_trains_exactly_like_peft_and_moves_hidden_states_across_nodes(model_dir, tmp_path):
    metrics = MemoryMetricsBackend()
    config, moved = _run(model_dir, tmp_path / "moved", True, metrics)
    _, at_home = _run(model_dir, tmp_path / "at-home", True, combine="home")
    _, stayed = _run(model_dir, tmp_path / "stayed", False)

    ref_losses, _ = reference_losses(config)
    for run in (moved, at_home):
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(stayed.losses), rtol=1e-5, atol=0)
        for name, value in _adapter(stayed).items():
            torch.testing.assert_close(_adapter(run)[name], value, rtol=1e-3, atol=5e-5)
    # sequences did move between the masters' nodes: each move sends a sequence's hidden states [T, D] in
    # fp32 forward and its gradient backward (the way home included); the routing is the same either way
    assert moved.master_nodes == NODES and stayed.sequence_moves is None
    moves, home_moves = moved.sequence_moves, at_home.sequence_moves
    assert moves["micro_batches"] == 3 * 3 and moves["skipped"] == 0 and moves["moves"] > 0
    sequence_bytes = config.data.seq_len * reference_hidden(model_dir) * 4
    assert moves["sent_bytes"] == moves["cross_node_bytes"]
    assert moves["sent_bytes"] - moves["relay_bytes"] == 2 * moves["moves"] * sequence_bytes
    assert moved.history[-1].sequence_moves["moves"] > 0
    assert f"sequence migration moved {moves['moves']} sequences" in summary_text(moved)
    assert f"{moves['relayed_rows']} expert rows combined on the master their sequence moved to" in summary_text(moved)
    assert "sequence migration off" in summary_text(stayed)
    assert metrics.value("vela_sequence_migration_bytes_total", link_tier="cross_node") == moves["cross_node_bytes"]
    assert moved.tokens_routed == stayed.tokens_routed == at_home.tokens_routed
    # the emulated nodes bin each master's rows by its own tier: a third of them stay on the node
    tiers = stayed.traffic_bytes_by_tier
    assert tiers["same_process"] == 0 and 0 < tiers["same_node"] < tiers["cross_node"]

    # LUFFY's combine on the new master decides as the combine at home does (the same moves), but the workers
    # answer a moving sequence's rows to its new master: a row (8-byte code), its routing weight and that
    # weight's gradient (4 bytes each) cross between the masters per relayed row, plus one key per message
    assert home_moves["moves"] == moves["moves"] and home_moves["relayed_rows"] == home_moves["relay_bytes"] == 0
    assert home_moves["sent_bytes"] == 2 * moves["moves"] * sequence_bytes
    assert moves["relayed_rows"] > 0
    extra = moves["relay_bytes"] - 16 * moves["relayed_rows"]
    assert extra > 0 and extra % 8 == 0
    # every row still reaches its worker once and each output and gradient leaves it once, whichever master
    # takes it: per worker, the bytes are those of no migration; only which link carries them changes
    assert moved.traffic_bytes_by_worker == at_home.traffic_bytes_by_worker == stayed.traffic_bytes_by_worker
    assert moved.worker_received_bytes == at_home.worker_received_bytes == stayed.worker_received_bytes
    assert moved.traffic_bytes_by_tier != at_home.traffic_bytes_by_tier
    for run in (moved, at_home):
        assert sum(run.traffic_bytes_by_tier.values()) == sum(stayed.traffic_bytes_by_tier.values())


def reference_hidden(model_dir: Path) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["hidden_size"]


def test_reslot_keeps_staying_sequences_in_place_and_fills_freed_slots_in_order():
    slots = [[0, 1], [2, 3], [4, 5]]
    # 1 -> master 2, 4 -> master 0, 5 -> master 1, 3 -> master 2
    assert reslot(slots, np.array([0, 2, 1, 2, 0, 1])) == [[0, 4], [2, 5], [1, 3]]
    assert reslot(slots, np.array([0, 0, 1, 1, 2, 2])) == slots


def test_one_mask_tells_when_every_slot_gets_the_same_layer_inputs():
    ids = torch.ones(2, 4, dtype=torch.long)
    assert one_mask({"input_ids": ids}) and one_mask({"input_ids": ids, "attention_mask": torch.ones(2, 4)})
    assert not one_mask({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])})
    assert not one_mask({"input_ids": ids, "position_ids": torch.arange(4).repeat(2, 1)})


def test_node_map_indexes_masters_and_workers_by_their_nodes():
    nodes = NodeMap.of(["b", "a"], ["a", "a", "c", "b"])
    assert nodes.master_node_M == [0, 1] and nodes.worker_node_W == [1, 1, 2, 0] and nodes.num_nodes == 3


def test_sequence_migration_needs_several_masters(tmp_path):
    with pytest.raises(ValueError, match="masters.sequence_migration moves sequences between masters"):
        JobConfig.from_dict(job_dict(tmp_path, tmp_path, masters={"sequence_migration": True}))


@pytest.mark.job
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "jamba"])
def test_other_families_decoder_layers_migrate_exactly(family, tmp_path):
    """A dense first layer and shared experts (DeepSeek-V3), sliding-window layers with sinks (gpt-oss),
    Mamba layers between the MoE ones (Jamba): sequences still move and the losses do not change."""
    model = make_checkpoint(tmp_path / family, family=family)
    summaries = []
    for migration in (False, True):
        config = JobConfig.from_dict(job_dict(
            model, tmp_path / f"out-{migration}", steps=2, training={"batch_size": 6, "micro_batch_size": 6},
            masters={"count": 3, "sequence_migration": migration, "sequence_migration_candidates": 2}))
        summaries.append(run_in_process(config, master_node=NODES[0], worker_nodes=NODES))
    stayed, moved = summaries
    assert moved.sequence_moves["moves"] > 0 and moved.sequence_moves["relayed_rows"] > 0  # combined where they went
    torch.testing.assert_close(torch.tensor(moved.losses), torch.tensor(stayed.losses), rtol=1e-6, atol=0)


@pytest.mark.job
@pytest.mark.parametrize("family, checkpointing", [("mixtral", False), ("gpt_oss", False), ("jamba", False),
                                                   ("mixtral", True)])
def test_padded_micro_batches_of_unequal_lengths_migrate_exactly(family, checkpointing, tmp_path):
    """Instruction examples padded to the longest in the micro-batch (unequal lengths, so Eq. 1's attention
    cost takes part): sequences move with their own attention masks, and the losses and LoRA weights are
    those without migration (also when the migrating run recomputes its layers in the backward)."""
    import json

    records = [{"instruction": "Say it" + " again" * n, "input": "", "output": "so" + " it is" * n} for n in range(12)]
    (tmp_path / "data.json").write_text(json.dumps(records))
    data = {"kind": "instruct", "path": str(tmp_path / "data.json"), "seq_len": 192}
    model_dir = make_checkpoint(tmp_path / "model", family=family, vocab=1024, max_position_embeddings=256)
    summaries = {}
    for migration in (False, True):
        training = {"batch_size": 6, "micro_batch_size": 6, "activation_checkpointing": checkpointing and migration}
        config = JobConfig.from_dict(job_dict(model_dir, tmp_path / f"out-{migration}", steps=2, data=data,
                                              training=training,
                                              masters={"count": 3, "sequence_migration": migration,
                                                       "sequence_migration_candidates": 2}))
        summaries[migration] = run_in_process(config, master_node=NODES[0], worker_nodes=NODES)
    moves = summaries[True].sequence_moves
    assert moves["micro_batches"] == 6 and moves["skipped"] == 0 and moves["moves"] > 0 and moves["relayed_rows"] > 0
    torch.testing.assert_close(torch.tensor(summaries[True].losses), torch.tensor(summaries[False].losses),
                               rtol=1e-5, atol=0)
    for name, value in _adapter(summaries[False]).items():  # the LoRA weights after two steps: same gradients
        torch.testing.assert_close(_adapter(summaries[True])[name], value, rtol=1e-4, atol=1e-6)


def test_a_watched_gloo_group_exchanges_uneven_tensors_among_masters():
    """A real gloo group of three ranks (threads), rank 0 watched as master 0 is: rank 0 sends to 1, rank 1 to
    0 and 2, rank 2 to nobody, in bf16; each gets exactly what was sent to it, and the watched wait ends."""
    import threading
    import time

    from vela_ray.model.collective import make_group, make_store
    from vela_ray.training.replicas import ProcessGroupReplicas

    store = make_store("127.0.0.1", 0, 3, is_master=True, timeout_s=60)
    groups = {}

    def join(rank: int) -> None:
        own = store if rank == 0 else make_store("127.0.0.1", store.port, 3, is_master=False, timeout_s=60)
        groups[rank] = make_group(own, rank, 3, timeout_s=60)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    start = time.monotonic()

    def watch(group_failed: bool) -> None:
        if time.monotonic() - start > 20:  # an exchange the watch cannot see completed would spin here
            raise RuntimeError("the watched exchange never completed")

    def rows(value: float, n: int) -> torch.Tensor:
        return torch.full((n, 4, 2), value, dtype=torch.bfloat16)

    plan = {0: ({1: rows(1.0, 1)}, {1: ((2, 4, 2), torch.bfloat16)}),
            1: ({0: rows(10.0, 2), 2: rows(12.0, 3)}, {0: ((1, 4, 2), torch.bfloat16)}),
            2: ({}, {1: ((3, 4, 2), torch.bfloat16)})}
    got = {}

    def exchange(rank: int) -> None:
        replicas = ProcessGroupReplicas(groups[rank], watch=watch if rank == 0 else None)
        got[rank] = replicas.exchange(*plan[rank])

    threads = [threading.Thread(target=exchange, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert got[0].keys() == {1} and torch.equal(got[0][1], rows(10.0, 2))
    assert got[1].keys() == {0} and torch.equal(got[1][0], rows(1.0, 1))
    assert got[2].keys() == {1} and torch.equal(got[2][1], rows(12.0, 3))


def test_attention_cost_of_unequal_lengths_changes_the_decision():
    """Eq. 1 decides between candidates (q = 2): the same routing, as the runtime asks (current masters, a
    master keeps its number of slots), placed differently when the lengths differ: the two short sequences
    gather on one master instead of each sitting beside a long one; with equal lengths the cost is the same
    either way and traffic decides. With q = 1 (traffic only) every sequence stays."""
    from placement import migrate_sequences

    served = [[16, 0], [75, 53], [4, 12], [9, 7]]
    kwargs = dict(current_S=[0, 0, 1, 1], hidden_size=64, capacity_tokens=[10**6] * 2, capacity_sequences=[2, 2])
    assert migrate_sequences([8, 64, 8, 8], served, [0, 1], q=1, **kwargs).tolist() == [0, 0, 1, 1]
    unequal = migrate_sequences([8, 64, 8, 8], served, [0, 1], q=2, **kwargs).tolist()
    equal = migrate_sequences([64, 64, 64, 64], served, [0, 1], q=2, **kwargs).tolist()
    assert unequal == [1, 0, 1, 0] and equal == [0, 1, 1, 0]


def test_slot_counts_bound_how_many_sequences_a_master_takes():
    """Masters keep their batch shapes: however short the sequences, none takes more than its slots."""
    from placement import migrate_sequences

    served = [[10, 0], [10, 0], [10, 0], [0, 10]]
    master = migrate_sequences([5, 5, 5, 5], served, [0, 1], q=1, current_S=[0, 0, 1, 1],
                               capacity_tokens=[100, 100], capacity_sequences=[2, 2])
    assert np.bincount(master, minlength=2).tolist() == [2, 2]
    with pytest.raises(ValueError, match="capacity_sequences"):
        migrate_sequences([5, 5, 5], served[:3], [0, 1], capacity_sequences=[1, 1])


def _brokered(family: str):
    """A debug model of `family` with expert brokers over one in-process shard, and its dispatcher."""
    from vela_ray.model.broker import ExpertDispatcher
    from vela_ray.model.experts import ExpertShard, LoraSpec
    from vela_ray.model.families import debug_model
    from vela_ray.model.modeling import attach_brokers, expert_weights, experts_prototypes, find_moe_blocks
    from vela_ray.model.transport import InProcessTransport

    model = debug_model(family, seed=0)
    blocks = find_moe_blocks(model)
    shard = ExpertShard.from_weights(expert_weights(blocks), LoraSpec(r=4, alpha=8), experts_prototypes(model.config))
    dispatcher = ExpertDispatcher(torch.zeros(len(blocks), blocks[0].layout.num_experts, dtype=torch.long),
                                  InProcessTransport([shard]))
    attach_brokers(model, dispatcher)
    return model, dispatcher


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_the_combine_moves_to_the_new_master_only_where_a_layer_adds_its_experts_output(family):
    """The probe behind LUFFY's combine on the new master: a decoder layer whose output moves by exactly what its
    broker returns passes (shared experts beside it included); one that scales its MoE output does not, and the
    migration then combines at home. The probe sends no row and leaves torch's RNG and training modes alone."""
    from vela_ray.training.sequence_migration import SequenceMigration, _decoder_layers, adds_expert_outputs

    model, dispatcher = _brokered(family)
    model.train()
    moe, _, stack = _decoder_layers(model)
    rng = torch.get_rng_state()
    assert all(adds_expert_outputs(model, stack, index) for index in moe)
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert int(torch.tensor(dispatcher.traffic().rows).sum()) == 0

    index = next(iter(moe))
    block = stack[index].mlp
    plain = block.forward

    def doubled(*args, **kwargs):
        out = plain(*args, **kwargs)
        return (2 * out[0], *out[1:]) if isinstance(out, tuple) else 2 * out
    block.forward = doubled
    assert not adds_expert_outputs(model, stack, index)
    migration = SequenceMigration(model, dispatcher, 0, 2, NodeMap([0, 1], [0], 2))
    assert migration.combine == "home"
    del block.forward
    assert SequenceMigration(model, dispatcher, 0, 2, NodeMap([0, 1], [0], 2)).combine == "new_master"


def test_a_worker_holds_relayed_rows_for_their_master_and_finishes_backward_with_its_gradients():
    """`transport.HeldRows`: the sender gets its rows back, the other master collects its own; backward takes the
    sender's gradients and the other master's deposit, each in its rows, and refuses to run before the deposit."""
    from vela_ray.model.transport import HeldRows

    held = HeldRows()
    out = torch.arange(10.0).view(5, 2)
    reply = torch.tensor([-1, 2, -1, 1, 2])
    assert torch.equal(held.hold("k", reply, out), out[[0, 2]])
    assert torch.equal(held.collect("k", 2), out[[1, 4]]) and torch.equal(held.collect("k", 1), out[[3]])
    with pytest.raises(KeyError, match="collected twice"):
        held.collect("k", 2)
    with pytest.raises(KeyError, match="relayed it no rows here"):
        held.deposit("k", 0, torch.zeros(1, 2))
    held.deposit("k", 2, -torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="before master 1 deposited"):
        held.complete("k", torch.ones(2, 2), lambda g: g)
    held.hold("k", reply, out)
    held.deposit("k", 2, -torch.ones(2, 2))
    held.deposit("k", 1, 5 * torch.ones(1, 2))
    grad = held.complete("k", torch.ones(2, 2), lambda g: g)
    assert grad[:, 0].tolist() == [1, -1, 1, 5, -1]
    assert torch.equal(held.complete("other", torch.ones(3, 2), lambda g: 2 * g), 2 * torch.ones(3, 2))
