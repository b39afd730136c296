"""Expert parallelism's pure pieces: batch sharding, label counts, link tiers, the e mod N table."""

from __future__ import annotations

import pytest
import torch

from vela_ray.baselines.expert_parallel import label_count, rank_link_tiers, sequential_table, shard_rows


def _batch(rows: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(rows * 4).view(rows, 4)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def test_eight_rows_over_six_ranks_split_two_two_one_one_one_one_in_order():
    batch = _batch(8)
    parts = [shard_rows(batch, r, 6)["input_ids"] for r in range(6)]
    assert [p.shape[0] for p in parts] == [2, 2, 1, 1, 1, 1]
    assert torch.equal(torch.cat(parts), batch["input_ids"])  # contiguous, nothing lost or repeated


def test_fewer_rows_than_ranks_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="a micro-batch of 2 rows cannot feed 3 expert-parallel ranks"):
        shard_rows(_batch(2), 0, 3)


def test_label_count_ignores_the_first_position_and_masked_labels():
    batch = _batch(2)
    batch["labels"][0, 2:] = -100
    # row 0 keeps label positions 1 (2 and 3 masked); row 1 keeps 1, 2, 3: 1 + 3 = 4
    assert label_count(batch) == 4


def test_link_tiers_follow_the_nodes_of_the_ranks():
    assert rank_link_tiers(1, ["a", "a", "b", "b"]) == ["same_node", "same_process", "cross_node", "cross_node"]
    assert rank_link_tiers(0, ["a"]) == ["same_process"]


def test_sequential_table_puts_expert_e_on_rank_e_mod_n_in_every_layer():
    table = sequential_table(2, 8, 6)
    assert table.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]] * 2
