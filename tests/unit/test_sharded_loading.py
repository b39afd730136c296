"""Loading a master rank's backbone (issues 37, 51): slice reads, each tensor read once per node over a node group of
DP x TP master processes (the runtime's rank builder, `master.build_master_rank`), and what it loads equal to what
`load_backbone` (+ `parallelize_backbone`) gives.

Bytes are counted by `loading.BACKBONE_READS`, the counter every backbone read adds to and that
`benchmarks/master_loading.py` sums per node.
"""

from __future__ import annotations

import math
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


@pytest.mark.parametrize("dp,tp,chunk", [(2, 1, None), (2, 2, None), (2, 2, 2048)],
                         ids=["dp2xtp1", "dp2xtp2", "dp2xtp2-2KiB-chunks"])
def test_a_node_of_dp_by_tp_master_processes_reads_each_tensor_once(tmp_path, monkeypatch, dp, tp, chunk):
    """dp x tp master processes on one node, one node group (as `actors.masters.RayRanks` forms it), each built by
    the runtime's `build_master_rank`: every rank holds exactly what a whole load then sharded holds (LoRA draws
    included), the node's first process reads one backbone's bytes (each TP shard of each tensor once), the others
    read nothing and receive theirs. A second read of any tensor on the node would show in the sum.

    Host memory (issue 51): no rank holds more than a few chunks beyond its model while it loads, by its own account
    (`ReadStats.staged_bytes`) and by torch's allocator (the profiler); the members receive straight into their
    tensors. With 2 KiB chunks, the largest tensors (embedding, LM head: 33 KiB per TP shard) move in many: a load
    that held a whole tensor, or a TP rank's whole shard of one, would exceed the bound."""
    from tests.fixtures import make_checkpoint
    from vela_ray.model import sharded_loading

    if chunk is not None:  # the forked ranks inherit it
        monkeypatch.setattr(sharded_loading, "MIN_CHUNK_BYTES", chunk)
    # a vocabulary of 264 splits over the ranks: embedding and LM head vocab-parallel, as a real model's are
    model_dir = str(make_checkpoint(tmp_path / "mixtral", "mixtral", vocab=264, **tp_harness.OVERRIDES["mixtral"]))
    ranks = tp_harness.spawn(dp * tp, f"load:{dp}x{tp}:node", [model_dir])
    figures = [ranks[r][model_dir][r] for r in range(dp * tp)]
    assert all(f["mismatched"] == [] for f in figures), [f["mismatched"][:3] for f in figures]
    backbone = figures[0]["backbone"]
    assert sum(f["read"] for f in figures) == backbone  # the node: one model's bytes, whatever dp x tp
    assert figures[0]["read"] == backbone and all(f["read"] == 0 for f in figures[1:])
    assert all(f["received"] > 0 for f in figures[1:])
    step = figures[0]["chunk"]
    assert chunk is None or (step == chunk and 264 * 64 * 4 // tp >= 8 * step)
    # the root: a chunk of whole rows read for a row-parallel weight and the other TP rank's part to send
    assert figures[0]["staged"] <= 2 * step and figures[0]["allocated"] <= 2 * step, figures[0]
    assert all(f["staged"] == 0 and f["allocated"] <= step for f in figures[1:]), figures[1:]


def test_a_node_group_loads_through_its_buffers_when_ranks_cannot_take_the_chunks_in_place(tmp_path, monkeypatch):
    """What a GPU master 0 (its shards on its GPU) and a cast (a float32 checkpoint loaded in bfloat16) make the
    node group do: every chunk read, sent and received through staging buffers, none straight into a tensor. The
    ranks still hold exactly what a whole load then sharded holds, from one backbone's bytes read."""
    from tests.fixtures import make_checkpoint
    from vela_ray.model import sharded_loading

    monkeypatch.setattr(sharded_loading, "MIN_CHUNK_BYTES", 2048)
    monkeypatch.setattr(sharded_loading, "_is_host_buffer", lambda tensor: False)  # the forked ranks inherit both
    model_dir = str(make_checkpoint(tmp_path / "mixtral", "mixtral", vocab=264, **tp_harness.OVERRIDES["mixtral"]))
    ranks = tp_harness.spawn(4, "load:2x2:node:bfloat16", [model_dir])
    figures = [ranks[r][model_dir][r] for r in range(4)]
    assert all(f["mismatched"] == [] for f in figures), [f["mismatched"][:3] for f in figures]
    assert figures[0]["read"] == figures[0]["backbone"] and all(f["read"] == 0 for f in figures[1:])
    assert all(f["staged"] > 0 for f in figures)


def test_a_lone_rank_streams_the_checkpoint_into_its_tensors(tmp_path, monkeypatch):
    """A rank alone on its node (master 0's `seeded_backbone`) reads each tensor straight into its parameter, in
    chunks: nothing staged when the checkpoint's dtype is the model's, one chunk's rows as stored when it is cast
    (float32 read into bfloat16: twice the chunk), never a whole tensor (the embedding is 16 chunks), and the same
    tensors as `load_backbone`'s."""
    from vela_ray.model import sharded_loading
    from vela_ray.model.families import debug_model
    from vela_ray.model.loading import backbone_skeleton, load_backbone
    from vela_ray.model.sharded_loading import chunk_bytes, read_backbone

    monkeypatch.setattr(sharded_loading, "MIN_CHUNK_BYTES", 2048)
    debug_model("mixtral", seed=2, vocab_size=1024).save_pretrained(tmp_path, max_shard_size="100KB")
    largest = max(math.prod(s.shape) * s.dtype.itemsize for s in backbone_specs(tmp_path, lambda name: None))
    step = chunk_bytes(sum(math.prod(s.shape) * 4 for s in backbone_specs(tmp_path, lambda name: None)))
    assert largest >= 16 * step
    for dtype, staged in ((torch.float32, 0), (torch.bfloat16, 2 * step)):
        reference = load_backbone(tmp_path, dtype)
        skeleton = backbone_skeleton(tmp_path, dtype)
        stats, allocated = tp_harness.allocation_peak(lambda: read_backbone(skeleton, None, tmp_path, dtype))
        assert stats.staged_bytes <= staged and allocated <= staged + 1024, (dtype, stats, allocated)
        got, want = skeleton.state_dict(), reference.state_dict()
        for name, tensor in want.items():
            if tensor.device.type != "meta":
                torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


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
