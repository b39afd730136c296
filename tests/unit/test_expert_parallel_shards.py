"""Expert parallelism without Ray: its pure pieces (batch sharding, label counts, link tiers, the
e mod N table) and one rank's step in this process, which is vela-ray's `train_step` with the
data-parallel hooks (tests/ray/test_expert_parallel.py runs three ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from placement import sequential_table
from tests.fixtures import make_checkpoint
from vela_ray.baselines.expert_parallel import build_rank
from vela_ray.training.replicas import label_count, shard_rows
from vela_ray.model.adapters import ADAPTER_FILE
from vela_ray.model.experts import LoraSpec
from vela_ray.model.loading import moe_layout
from vela_ray.model.traffic import LOCAL_NODE, link_tiers
from vela_ray.training.schedule import OptimizerConfig
from vela_ray.training.adapter_io import export, import_adapter
from vela_ray.training.master import build_local
from vela_ray.training.step import eval_loss, train_step

LORA = LoraSpec(r=4, alpha=8)
OPTIM = OptimizerConfig(lr=1e-2, max_grad_norm=0.5, warmup_steps=1)


def _batch(rows: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(rows * 4).view(rows, 4)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def test_eight_rows_over_six_ranks_split_two_two_one_one_one_one_in_order():
    batch = _batch(8)
    parts = [shard_rows(batch, r, 6)["input_ids"] for r in range(6)]
    assert [p.shape[0] for p in parts] == [2, 2, 1, 1, 1, 1]
    assert torch.equal(torch.cat(parts), batch["input_ids"])  # contiguous, nothing lost or repeated


def test_fewer_rows_than_ranks_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="a micro-batch of 2 rows cannot feed 3 replicas"):
        shard_rows(_batch(2), 0, 3)


def test_label_count_ignores_the_first_position_and_masked_labels():
    batch = _batch(2)
    batch["labels"][0, 2:] = -100
    # row 0 keeps label positions 1 (2 and 3 masked); row 1 keeps 1, 2, 3: 1 + 3 = 4
    assert label_count(batch) == 4


def test_a_rank_sees_itself_in_process_its_node_mates_same_node_and_the_rest_cross_node():
    nodes = ["a", "a", "b", "b"]
    assert link_tiers(nodes[1], nodes, origin_index=1) == ["same_node", "same_process", "cross_node", "cross_node"]
    assert link_tiers("a", ["a"], origin_index=0) == ["same_process"]


def test_a_master_sees_in_process_workers_in_process_and_ray_workers_by_node():
    assert link_tiers("a", [LOCAL_NODE, "a", "b"]) == ["same_process", "same_node", "cross_node"]


def test_sequential_table_puts_expert_e_on_rank_e_mod_n_in_every_layer():
    table = sequential_table(2, 8, 6)
    assert table.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]] * 2


def _padded_batches(count: int) -> list[dict[str, torch.Tensor]]:
    """Batches with masked labels, so the rank's loss must divide by the micro-batch's label count."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(count):
        ids = torch.randint(3, 200, (3, 12), generator=g)
        labels = ids.clone()
        labels[0, :5] = -100
        out.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return out


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_ranks_step_is_the_single_masters_step_with_data_parallel_hooks(one_rank_group, tmp_path):
    model_dir = make_checkpoint(tmp_path / "model")
    rank = build_rank(model_dir, "float32", LORA, OPTIM, seed=0, rank_nodes=["a"])
    export(rank.master, rank.workers, tmp_path / "init")  # the single master starts from the rank's adapters
    num_layers, num_experts = moe_layout(model_dir)
    master, workers = build_local(AutoModelForCausalLM.from_pretrained(model_dir),  # its experts on 2 workers
                                  sequential_table(num_layers, num_experts, 2), LORA, OPTIM)
    import_adapter(master, workers, tmp_path / "init")
    batches = _padded_batches(3)

    ep = [train_step(rank.master, rank.workers, [b], 1e-2, 0.5, loss_fn=rank.loss, replicas=rank.replicas)
          for b in batches]
    single = [train_step(master, workers, [b], 1e-2, 0.5) for b in batches]

    torch.testing.assert_close(torch.tensor(ep), torch.tensor(single), rtol=1e-5, atol=0)
    torch.testing.assert_close(eval_loss(rank.master, batches, loss_fn=rank.loss, replicas=rank.replicas),
                               eval_loss(master, batches), rtol=1e-5, atol=0)
    assert rank.replicas.grad_bytes > 0  # the backbone gradients went through the all-reduce
    export(rank.master, rank.workers, tmp_path / "ep")
    export(master, workers, tmp_path / "single")
    ep_state, single_state = (load_file(tmp_path / d / ADAPTER_FILE) for d in ("ep", "single"))
    assert ep_state.keys() == single_state.keys()
    for key, value in single_state.items():
        torch.testing.assert_close(ep_state[key], value, rtol=1e-4, atol=1e-6, msg=key)
