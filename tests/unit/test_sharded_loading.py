"""Zero-redundancy TP loading (issue 37): slice reads, the default shard plan, and a 2×2 (dp×tp) gloo run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import save_file

# only light imports at module level: the spawned ranks import this module (transformers takes seconds)
from tests.ray.head import free_port
from vela_ray.model.sharded_loading import (DEFAULT_PLAN, Layout, ShardReader, backbone_specs,
                                            broadcast_from_replica_root, load_backbone_shards, load_sharded,
                                            load_sharded_files, make_replica_groups, shard_range)


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


def test_default_plan():
    plan = DEFAULT_PLAN
    assert plan("model.layers.3.self_attn.q_proj.weight") == 0
    assert plan("model.layers.3.self_attn.v_proj.bias") == 0
    assert plan("model.layers.3.self_attn.o_proj.weight") == 1
    assert plan("model.layers.3.self_attn.o_proj.bias") is None
    assert plan("model.layers.3.mlp.shared_expert.gate_proj.weight") == 0
    assert plan("model.layers.3.mlp.shared_expert.down_proj.weight") == 1
    assert plan("model.layers.3.mlp.gate.weight") is None  # router
    assert plan("model.layers.3.mlp.shared_expert_gate.weight") is None
    assert plan("model.layers.3.mlp.experts.gate_up_proj") is None
    assert plan("model.embed_tokens.weight") is None and plan("model.norm.weight") is None
    # LoRA as thesis §3.2: the adapter on the sharded side of W is split, the other replicated
    assert plan("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight") == 0
    assert plan("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight") is None
    assert plan("base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight") == 1
    assert plan("base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight") is None


def test_slices_equal_the_full_tensors_and_only_shard_bytes_are_read(checkpoint):
    specs = {s.name: s for s in backbone_specs(checkpoint)}
    assert len({s.file for s in specs.values()}) > 1
    picked = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
              "model.layers.1.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight",
              "model.layers.1.mlp.gate.weight", "model.norm.weight", "model.embed_tokens.weight"]
    assert {specs[n].dim for n in picked} == {0, 1, None}
    assert specs["model.layers.1.mlp.gate.weight"].source == "model.layers.1.block_sparse_moe.gate.weight"
    tp = 2
    for name in picked:
        spec = specs[name]
        full = _full(spec.file, spec.source)
        for tp_rank in range(tp):
            with ShardReader() as reader:
                shard = reader.read(spec.file, spec.source, spec.dim, tp, tp_rank)
            if spec.dim is None:
                expected = full
            else:
                start, stop = shard_range(full.shape[spec.dim], tp, tp_rank)
                expected = full.narrow(spec.dim, start, stop - start)
            torch.testing.assert_close(shard, expected, rtol=0, atol=0)
            assert reader.stats.bytes_read == expected.numel() * expected.element_size()
            if spec.dim is not None:
                assert reader.stats.bytes_read * tp == full.numel() * full.element_size()


def test_uneven_split_is_refused():
    with pytest.raises(ValueError, match="does not split evenly"):
        shard_range(10, 4, 0)


def _worker(rank: int, world: int, port: int, specs: list, out: str) -> None:
    """One rank. The backbone specs come from the parent (rank 0 would build them itself in
    `load_backbone_shards`, tested single-process below) so no rank imports transformers."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        layout = Layout(dp=2, tp=2)
        groups = make_replica_groups(layout)
        shards, stats = load_sharded(specs if rank == 0 else None, layout, groups)
        # the chunked path (a GPU master fed by gloo): pieces of at most 1 KiB, reassembled here
        pieces: dict[str, torch.Tensor] = {}

        def on_chunk(name: str, offset: int, piece: torch.Tensor) -> None:
            flat = pieces.setdefault(name, torch.empty(shards[name].numel(), dtype=piece.dtype))
            flat[offset:offset + piece.numel()] = piece
            assert piece.numel() * piece.element_size() <= 1024

        load_sharded(specs if rank == 0 else None, layout, groups, on_chunk=on_chunk, chunk_bytes=1024)
        chunked = {name: flat.view(shards[name].shape) for name, flat in pieces.items()}
        lora, lora_stats = load_sharded_files([Path(out) / "adapter.safetensors"], layout, replica_groups=groups)
        tp_rank = layout.tp_rank(rank)
        own = {"exp_avg": torch.full((3,), float(tp_rank))} if layout.dp_rank(rank) == 0 else None
        optim = broadcast_from_replica_root(own, layout, groups)
        torch.save({"shards": shards, "bytes_read": stats.bytes_read, "files_opened": stats.files_opened,
                    "bytes_received": stats.bytes_received, "lora": lora, "lora_bytes": lora_stats.bytes_read,
                    "optim": optim, "chunked": chunked}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_by_two_group_load(checkpoint, tmp_path):
    """dp=2 × tp=2: every rank ends with exactly its TP shard; only dp_rank-0 ranks read; the bytes read
    over all ranks are one model's (backbone) bytes, and the same for a LoRA state on resume."""
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 4),
               "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight": torch.randn(4, 32),
               "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight": torch.randn(32, 4)}
    save_file(adapter, str(tmp_path / "adapter.safetensors"))
    layout = Layout(dp=2, tp=2)
    specs = backbone_specs(checkpoint)
    # fork: the ranks inherit the imported modules (a spawn re-imports torch in each, seconds apiece)
    mp.start_processes(_worker, args=(layout.world_size, free_port(), specs, str(tmp_path)),
                       nprocs=layout.world_size, join=True, start_method="fork")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(layout.world_size)]
    model_bytes = sum(_full(s.file, s.source).numel() * 4 for s in specs)
    for rank, result in enumerate(results):
        tp_rank = layout.tp_rank(rank)
        assert set(result["shards"]) == {s.name for s in specs}
        for spec in specs:
            full = _full(spec.file, spec.source)
            if spec.dim is not None:
                start, stop = shard_range(full.shape[spec.dim], layout.tp, tp_rank)
                full = full.narrow(spec.dim, start, stop - start)
            torch.testing.assert_close(result["shards"][spec.name], full, rtol=0, atol=0)
            torch.testing.assert_close(result["chunked"][spec.name], full, rtol=0, atol=0)
        for name, full in adapter.items():
            dim = DEFAULT_PLAN(name)
            expected = full if dim is None else full.chunk(layout.tp, dim)[tp_rank]
            torch.testing.assert_close(result["lora"][name], expected, rtol=0, atol=0)
        torch.testing.assert_close(result["optim"]["exp_avg"], torch.full((3,), float(tp_rank)))
        if layout.dp_rank(rank) > 0:  # a replica: opened no checkpoint file, read nothing, received its shard
            assert result["bytes_read"] == 0 and result["files_opened"] == [] and result["lora_bytes"] == 0
            assert result["bytes_received"] > 0
        else:
            assert result["bytes_read"] > 0
    assert sum(r["bytes_read"] for r in results) == model_bytes
    assert sum(r["lora_bytes"] for r in results) == sum(t.numel() * 4 for t in adapter.values())


def test_backbone_shards_single_process(checkpoint):
    """`load_backbone_shards` end to end on a one-rank gloo group (dp=1, tp=1): the backbone, whole,
    under the model's names (renamed router included), exactly one model's bytes read."""
    from vela_ray.model.loading import load_backbone

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        shards, stats = load_backbone_shards(checkpoint, Layout(dp=1, tp=1))
    finally:
        dist.destroy_process_group()
    reference = {k: v for k, v in load_backbone(checkpoint).state_dict().items() if ".experts." not in k}
    assert set(shards) == set(reference)
    for name, tensor in shards.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)
    assert stats.bytes_read == sum(t.numel() * t.element_size() for t in reference.values())


def test_converted_backbone_tensors_match_load_backbone(tmp_path):
    """A backbone tensor transformers converts from whole tensors (lara_mini's fused in_proj, split in
    four) goes through `loading`'s converter on its reader and comes out as `load_backbone` loads it."""
    from vela_ray.model.families import debug_model
    from vela_ray.model.loading import load_backbone

    debug_model("lara_mini", seed=2).save_pretrained(tmp_path)
    assert any(s.convert for s in backbone_specs(tmp_path))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        shards, stats = load_backbone_shards(tmp_path, Layout(dp=1, tp=1))
    finally:
        dist.destroy_process_group()
    assert stats.full_tensor_reads >= 1
    reference = load_backbone(tmp_path)
    tied = {"lm_head.weight"} if reference.config.tie_word_embeddings else set()
    reference = {k: v for k, v in reference.state_dict().items() if ".experts." not in k and k not in tied}
    assert set(shards) == set(reference)
    for name, tensor in shards.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)
