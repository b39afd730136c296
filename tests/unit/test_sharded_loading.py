"""Loading a master rank's backbone (issues 37, 51): slice reads, each tensor read once per node over a node group of
DP x TP master processes (the runtime's rank builder, `master.build_master_rank`), and what it loads equal to what
`load_backbone` (+ `parallelize_backbone`) gives.

Bytes are counted by `loading.BACKBONE_READS`, the counter every backbone read adds to and that
`benchmarks/master_loading.py` sums per node.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests import tp_harness
from vela_ray.model.loading import BACKBONE_READS
from vela_ray.model.sharded_loading import ShardReader, backbone_specs, shard_range

DIMS = {"model.layers.0.self_attn.q_proj.weight": 0, "model.layers.1.self_attn.k_proj.weight": 0,
        "model.layers.1.self_attn.o_proj.weight": 1, "model.layers.0.self_attn.o_proj.weight": 1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A debug Mixtral saved in several safetensors files (hub names: block_sparse_moe.gate is renamed)."""
    from vela_ray.model.families import debug_model
    from vela_ray.model.loading import checkpoint_index

    path = tmp_path_factory.mktemp("mixtral")
    debug_model("mixtral", seed=1).save_pretrained(path, max_shard_size="100KB")
    assert len({f for f in checkpoint_index(path).values()}) > 1
    return path


def _full(file, name) -> torch.Tensor:
    with safe_open(str(file), "pt") as f:
        return f.get_tensor(name)


def test_slices_equal_the_full_tensors_and_only_shard_bytes_are_read(checkpoint):
    specs = {s.name: s for s in backbone_specs(checkpoint, DIMS.get)}
    assert len({s.file for s in specs.values()}) > 1
    picked = [*DIMS, "model.layers.1.mlp.gate.weight", "model.norm.weight", "model.embed_tokens.weight"]
    assert {specs[n].dim for n in picked} == {0, 1, None}
    assert specs["model.layers.1.mlp.gate.weight"].source == "model.layers.1.block_sparse_moe.gate.weight"
    tp = 2
    for name in picked:
        spec = specs[name]
        full = _full(spec.file, spec.source)
        for tp_rank in range(tp):
            before = BACKBONE_READS.bytes
            with ShardReader() as reader:
                shard = reader.read(spec.file, spec.source, spec.dim, tp, tp_rank)
            expected = full if spec.dim is None else full.narrow(spec.dim, *_start_len(full, spec.dim, tp, tp_rank))
            torch.testing.assert_close(shard, expected, rtol=0, atol=0)
            assert BACKBONE_READS.bytes - before == expected.numel() * expected.element_size()


def _start_len(full: torch.Tensor, dim: int, tp: int, tp_rank: int) -> tuple[int, int]:
    start, stop = shard_range(full.shape[dim], tp, tp_rank)
    return start, stop - start


def test_uneven_split_is_refused():
    with pytest.raises(ValueError, match="does not split evenly"):
        shard_range(10, 4, 0)


@pytest.mark.parametrize("dp,tp", [(2, 1), (2, 2)], ids=["dp2xtp1", "dp2xtp2"])
def test_a_node_of_dp_by_tp_master_processes_reads_each_tensor_once(tmp_path, dp, tp):
    """dp x tp master processes on one node, one node group (as `actors.masters.RayPeers` forms it), each built by
    the runtime's `build_master_rank`: every rank holds exactly what a whole load then sharded holds (LoRA draws
    included), the node's first process reads one backbone's bytes (each TP shard of each tensor once), the others
    read nothing and receive theirs. A second read of any tensor on the node would show in the sum."""
    from tests.fixtures import make_checkpoint

    # a vocabulary of 264 splits over the ranks: embedding and LM head vocab-parallel, as a real model's are
    model_dir = str(make_checkpoint(tmp_path / "mixtral", "mixtral", vocab=264, **tp_harness.OVERRIDES["mixtral"]))
    ranks = tp_harness.spawn(dp * tp, f"load:{dp}x{tp}:node", [model_dir])
    figures = [ranks[r][model_dir][r] for r in range(dp * tp)]
    assert all(f["mismatched"] == [] for f in figures), [f["mismatched"][:3] for f in figures]
    backbone = figures[0]["backbone"]
    assert sum(f["read"] for f in figures) == backbone  # the node: one model's bytes, whatever dp x tp
    assert figures[0]["read"] == backbone and all(f["read"] == 0 for f in figures[1:])
    assert all(f["received"] > 0 for f in figures[1:])


def test_a_lone_rank_loads_what_load_backbone_loads_converted_tensors_included(tmp_path):
    """Without TP and alone on its node, `read_backbone` on the unread skeleton gives `load_backbone`'s tensors,
    a tensor transformers converts from whole tensors (lara_mini's fused in_proj, split in four) included, having
    read exactly what `load_backbone` reads."""
    from vela_ray.model.families import debug_model
    from vela_ray.model.loading import backbone_skeleton, load_backbone
    from vela_ray.model.sharded_loading import read_backbone

    debug_model("lara_mini", seed=2).save_pretrained(tmp_path)
    assert any(s.convert for s in backbone_specs(tmp_path, lambda name: None))
    before = BACKBONE_READS.bytes
    reference = load_backbone(tmp_path)
    plain_read = BACKBONE_READS.bytes - before
    skeleton = backbone_skeleton(tmp_path)
    stats = read_backbone(skeleton, None, tmp_path)
    assert stats.bytes_read == plain_read > 0 and stats.bytes_received == stats.bytes_sent == 0
    got, want = skeleton.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        if tensor.device.type != "meta":
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
