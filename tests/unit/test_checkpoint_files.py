"""Checkpoint files: atomic publication, verification, refusal of corrupt or mismatched checkpoints."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from vela_ray.training import checkpoint

META = {"model_type": "mixtral", "moe_layers": 2, "experts": 6, "lora_r": 4}


def _write(root, step, size=16, meta=META, keep=None):
    staging = checkpoint.begin(root, step)
    checkpoint.write_tensors(staging / "backbone.safetensors", {"w": torch.full((size,), float(step))})
    states = {(0, 1): {"lora_A_down": torch.ones(2, 3), "lora_A_down.exp_avg": torch.ones(2, 3)},
              (1, 5): {"lora_A_down": torch.zeros(2, 3)}}
    checkpoint.write_tensors(staging / "experts" / "part-0.safetensors", checkpoint.expert_part_tensors(states))
    checkpoint.write_json(staging / "trainer.json", {"step": step})
    return checkpoint.finalize(staging, step, meta, keep=keep)


def test_finalized_checkpoint_verifies_and_indexes_experts_by_logical_key(tmp_path):
    path = _write(tmp_path, 3)
    manifest = checkpoint.verify(path)
    assert manifest["step"] == 3 and set(manifest["experts"]) == {"0.1", "1.5"}
    states = checkpoint.read_expert_states(path, manifest, [(1, 5), (0, 1)])
    assert set(states[(0, 1)]) == {"lora_A_down", "lora_A_down.exp_avg"}
    assert checkpoint.latest(tmp_path) == path


def test_keep_prunes_to_the_newest_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        _write(tmp_path, step, keep=2)
    assert [p.name for p in checkpoint.valid_checkpoints(tmp_path)] == ["step-000003", "step-000004"]


def test_a_truncated_file_is_refused(tmp_path):
    path = _write(tmp_path, 1)
    part = path / "experts" / "part-0.safetensors"
    part.write_bytes(part.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"part-0.safetensors has \d+ bytes, the manifest says \d+ \(truncated\?\)"):
        checkpoint.verify(path)
    assert checkpoint.latest(tmp_path) is None


def test_a_checksum_mismatch_is_refused(tmp_path):
    path = _write(tmp_path, 1)
    data = bytearray((path / "backbone.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "backbone.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"backbone.safetensors fails its sha256 checksum"):
        checkpoint.verify(path)


def test_a_checkpoint_of_another_model_or_rank_is_refused(tmp_path):
    manifest = checkpoint.verify(_write(tmp_path, 1))
    with pytest.raises(ValueError, match=r"lora_r: checkpoint 4 vs this job 8"):
        checkpoint.check_compatible(manifest, {**META, "lora_r": 8}, tmp_path)
    with pytest.raises(ValueError, match=r"model_type: checkpoint 'mixtral' vs this job 'qwen3_moe'"):
        checkpoint.check_compatible(manifest, {**META, "model_type": "qwen3_moe"}, tmp_path)


def test_missing_experts_are_named(tmp_path):
    path = _write(tmp_path, 1)
    with pytest.raises(ValueError, match=r"no state for experts \[\(1, 0\)\]"):
        checkpoint.read_expert_states(path, checkpoint.verify(path), [(1, 0)])


def test_resolve_latest_without_checkpoints_says_where_it_looked(tmp_path):
    with pytest.raises(ValueError, match=r"no valid checkpoint under"):
        checkpoint.resolve("latest", tmp_path)


def _corrupt(path):
    data = bytearray((path / "backbone.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksum can tell
    (path / "backbone.safetensors").write_bytes(bytes(data))


def test_resolve_latest_falls_back_past_a_corrupt_newest_checkpoint_and_names_it(tmp_path, caplog):
    good = _write(tmp_path, 1)
    _corrupt(_write(tmp_path, 2))
    with caplog.at_level("WARNING", logger="vela_ray.training.checkpoint"):
        assert checkpoint.resolve("latest", tmp_path) == good
    assert "skipping corrupt checkpoint" in caplog.text and "step-000002" in caplog.text
    assert "resuming from" in caplog.text and str(good) in caplog.text


def test_a_corrupt_checkpoint_latest_skips_is_set_aside_and_never_kept_in_place_of_a_valid_one(tmp_path, caplog):
    valid = _write(tmp_path, 1)
    _corrupt(_write(tmp_path, 2))  # same size: the size check pruning makes passes it
    with caplog.at_level("WARNING", logger="vela_ray.training.checkpoint"):
        assert checkpoint.resolve("latest", tmp_path) == valid
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("step-000002.corrupt-")]
    assert len(aside) == 1 and caplog.text.count(f"moved aside to {aside[0].name}") == 1
    assert checkpoint.step_dirs(tmp_path) == [valid]  # never resumed from again
    _write(tmp_path, 3, keep=2)  # the resumed run's next checkpoint: the valid one before stays
    assert [p.name for p in checkpoint.valid_checkpoints(tmp_path)] == ["step-000001", "step-000003"]
    assert (aside[0] / checkpoint.MANIFEST).is_file()  # kept whole, for a look: nothing deleted


def test_resolve_latest_with_only_corrupt_checkpoints_counts_them(tmp_path):
    _corrupt(_write(tmp_path, 1))
    with pytest.raises(ValueError, match=r"no valid checkpoint under .* \(1 corrupt: step-000001\)"):
        checkpoint.resolve("latest", tmp_path)


def test_resolve_a_mistyped_directory_says_it_does_not_exist_and_names_the_newest(tmp_path):
    with pytest.raises(ValueError, match=r"step-00012 does not exist \(.* holds no checkpoint\)"):
        checkpoint.resolve(tmp_path / "step-00012", tmp_path)
    newest = _write(tmp_path, 12)
    with pytest.raises(ValueError, match=rf"step-00012 does not exist \(the newest under .* is {newest}\)"):
        checkpoint.resolve(tmp_path / "step-00012", tmp_path)


def test_resolve_a_checkpoint_root_names_a_checkpoint_in_it(tmp_path):
    _write(tmp_path, 1)
    with pytest.raises(ValueError, match=r"is a checkpoint root, not a checkpoint; .*step-000001"):
        checkpoint.resolve(tmp_path, tmp_path)


def test_resolve_a_corrupt_directory_says_what_is_wrong(tmp_path):
    path = _write(tmp_path, 1)
    _corrupt(path)
    with pytest.raises(ValueError, match=r"backbone.safetensors fails its sha256 checksum"):
        checkpoint.resolve(path, tmp_path)


def test_prune_deletes_staging_directories_left_by_a_crash(tmp_path):
    stale = checkpoint.begin(tmp_path, 7)  # a writer that died before finalize
    (stale / "experts" / "part-0.safetensors").write_bytes(b"half")
    _write(tmp_path, 1, keep=3)
    assert not stale.exists()
    assert checkpoint.staging_dirs(tmp_path) == []
    assert [p.name for p in checkpoint.valid_checkpoints(tmp_path)] == ["step-000001"]


_SLOW_WRITER = """
import sys, time, torch
from pathlib import Path
from vela_ray.training import checkpoint
root = Path(sys.argv[1])
staging = checkpoint.begin(root, 2)
checkpoint.write_tensors(staging / "trainer_partial.safetensors", {"w": torch.zeros(4)})
print("WRITING", flush=True)
for i in range(1000):  # keeps writing parts until killed
    checkpoint.write_tensors(staging / "experts" / f"part-{i}.safetensors", {"l0.e0.x": torch.zeros(1 << 16)})
    time.sleep(0.01)
"""


def test_a_writer_killed_mid_checkpoint_leaves_the_previous_one_latest(tmp_path):
    previous = _write(tmp_path, 1)
    writer = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "WRITING"
    time.sleep(0.3)
    writer.kill()
    writer.wait()
    assert any(p.name.startswith(".step-000002.tmp-") for p in tmp_path.iterdir())  # the half-written one
    assert checkpoint.latest(tmp_path) == previous
    checkpoint.verify(previous)
    _write(tmp_path, 3, keep=3)  # the next checkpoint's prune removes the dead writer's staging dir
    assert checkpoint.staging_dirs(tmp_path) == []
