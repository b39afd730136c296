"""Tests of vela_ray.data.datasets: text packing, instruction masking, batching order, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vela_ray.data.config import DataConfig
from vela_ray.data.datasets import (
    IGNORE_INDEX,
    build_dataset,
    batch_at,
    iterate_batches,
    micro_batches,
    load_instruct,
    load_instruct_examples,
    pack_text,
    render_prompt,
    sequential_batches,
)
from vela_ray.paths import data_dir
from vela_ray.training.tiny_model import train_tokenizer

SHAKESPEARE = data_dir() / "tinyshakespeare" / "input.txt"


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(SHAKESPEARE.read_text()[:30_000], vocab_size=400)


def _ids(tokenizer, text: str) -> list[int]:
    return [i for line in tokenizer(text.splitlines(keepends=True), add_special_tokens=False)["input_ids"]
            for i in line]


def _write_json(path: Path, records) -> Path:
    path.write_text(json.dumps(records))
    return path


# --- text ---------------------------------------------------------------------------


def test_pack_text_cuts_the_token_stream_into_full_blocks(tokenizer, tmp_path):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 5
    path = tmp_path / "a.txt"
    path.write_text(text)
    stream = _ids(tokenizer, text)
    dataset = pack_text(tokenizer, path, seq_len=8)
    assert len(dataset) == len(stream) // 8
    assert dataset.input_ids.flatten().tolist() == stream[:len(dataset) * 8]
    assert torch.equal(dataset.labels, dataset.input_ids)
    assert bool(dataset.attention_mask.eq(1).all())


def test_pack_text_joins_a_directory_of_files_in_name_order_with_eos(tokenizer, tmp_path):
    (tmp_path / "b.txt").write_text("second file here\n")
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / "notes.md").write_text("ignored")
    dataset = pack_text(tokenizer, tmp_path, seq_len=2)
    expected = _ids(tokenizer, "first file\n") + [tokenizer.eos_token_id] + _ids(tokenizer, "second file here\n")
    assert dataset.input_ids.flatten().tolist() == expected[:len(expected) // 2 * 2]


def test_text_too_short_for_one_block_is_an_error(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("tiny")
    with pytest.raises(ValueError, match=r"short\.txt.*cannot fill one block of seq_len=64"):
        pack_text(tokenizer, path, seq_len=64)


def test_empty_text_file_is_an_error(tokenizer, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt: 0 tokens: the file is empty"):
        pack_text(tokenizer, path, seq_len=4)


def test_unknown_file_types_are_errors(tokenizer, tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"data\.csv: unknown text file type '\.csv'"):
        pack_text(tokenizer, tmp_path / "data.csv", seq_len=4)
    (tmp_path / "data.xml").write_text("<a/>\n")
    with pytest.raises(ValueError, match=r"data\.xml: .*\.json.*\.parquet"):
        load_instruct_examples(tmp_path / "data.xml")
    with pytest.raises(ValueError, match="holds no text files"):
        pack_text(tokenizer, tmp_path, seq_len=4)


# --- instruction data -----------------------------------------------------------------


def test_instruct_masks_the_prompt_and_padding_out_of_the_loss(tokenizer, tmp_path):
    path = _write_json(tmp_path / "d.json", [{"instruction": "Say hi.", "input": "", "output": "hi there"}])
    dataset = load_instruct(tokenizer, path, seq_len=160)
    example = load_instruct_examples(path)[0]
    prompt = [tokenizer.bos_token_id] + tokenizer(render_prompt(example), add_special_tokens=False)["input_ids"]
    response = tokenizer("hi there", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    length = len(prompt) + len(response)
    assert length < 160
    assert dataset.input_ids[0, :length].tolist() == prompt + response
    assert dataset.labels[0, :len(prompt)].eq(IGNORE_INDEX).all()
    assert dataset.labels[0, len(prompt):length].tolist() == response
    assert dataset.labels[0, length:].eq(IGNORE_INDEX).all()
    assert dataset.attention_mask[0].tolist() == [1] * length + [0] * (160 - length)
    assert dataset.input_ids[0, length:].eq(tokenizer.pad_token_id).all()


def test_instruct_uses_the_input_template_only_when_there_is_an_input(tokenizer, tmp_path):
    path = _write_json(tmp_path / "d.json", [{"instruction": "Add.", "input": "2 and 3", "output": "5"},
                                             {"instruction": "Add.", "output": "5"}])
    with_input, without = load_instruct_examples(path)
    assert "### Input:\n2 and 3" in render_prompt(with_input)
    assert "### Input:" not in render_prompt(without)


def test_instruct_rows_longer_than_seq_len_are_truncated(tokenizer, tmp_path):
    path = _write_json(tmp_path / "d.json", [{"instruction": "Write.", "output": "word " * 200}])
    dataset = load_instruct(tokenizer, path, seq_len=160)
    assert dataset.attention_mask.eq(1).all()
    assert (dataset.labels[0] != IGNORE_INDEX).any()


def test_seed_task_instances_become_one_example_each(tmp_path):
    path = tmp_path / "seed.jsonl"
    path.write_text(json.dumps({"instruction": "Classify.", "instances": [
        {"input": "a", "output": "x"}, {"input": "b", "output": "y"}]}) + "\n\n"
        + json.dumps({"instruction": "Greet.", "output": "hello"}) + "\n")
    examples = load_instruct_examples(path)
    assert [(e.instruction, e.input, e.output) for e in examples] == [
        ("Classify.", "a", "x"), ("Classify.", "b", "y"), ("Greet.", "", "hello")]


def test_the_shipped_instruction_files_load():
    assert len(load_instruct_examples(data_dir() / "instruct" / "alpaca_seed_tasks.jsonl")) >= 175
    assert len(load_instruct_examples(data_dir() / "instruct" / "gsm8k_alpaca.json", limit=10)) == 10


@pytest.mark.parametrize("records, message", [
    ([{"instruction": "a", "output": "b"}, {"instruction": "c"}], r"bad\.json: record 1: missing field 'output'"),
    ([{"output": "b"}], r"bad\.json: record 0: missing field 'instruction'"),
    ([{"instruction": "a", "output": 5}], r"record 0: field 'output' must be a string, got int"),
    ([{"instruction": "  ", "output": "b"}], r"record 0: field 'instruction' is empty"),
    (["just a string"], r"record 0: expected a JSON object, got str"),
    ([{"instruction": "a", "instances": [{"input": "x"}]}], r"record 0 instance 0: missing field 'output'"),
    ({"instruction": "a"}, r"bad\.json: expected a JSON list of records .*, got a dict"),
    ([], r"bad\.json: holds no instruction records"),
])
def test_malformed_instruction_records_name_file_record_and_field(tmp_path, records, message):
    path = _write_json(tmp_path / "bad.json", records)
    with pytest.raises(ValueError, match=message):
        load_instruct_examples(path)


def test_broken_jsonl_line_names_the_record(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3: record 1 is not valid JSON"):
        load_instruct_examples(path)


def test_malformed_json_names_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n {"instruction": "a", "output": "b"},\n {"instruction": "c" "output": "d"}\n]\n')
    with pytest.raises(ValueError, match=r"bad\.json: line 3 column \d+: not valid JSON"):
        load_instruct_examples(path)


@pytest.mark.parametrize("name", ["empty.json", "empty.jsonl"])
def test_an_empty_instruction_file_says_it_is_empty(tmp_path, name):
    (tmp_path / name).write_text("\n")
    with pytest.raises(ValueError, match=rf"{name}: the file is empty"):
        load_instruct_examples(tmp_path / name)


# --- batching --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blocks(tokenizer):
    return build_dataset(DataConfig(kind="text", path=SHAKESPEARE, seq_len=16, limit=21), tokenizer)


def test_batches_are_a_pure_function_of_seed_and_step(blocks):
    stream = list(iterate_batches(blocks, batch_size=4, seed=3, num_steps=12))
    resumed = list(iterate_batches(blocks, batch_size=4, seed=3, start_step=7, num_steps=5))
    for step in range(12):
        assert torch.equal(stream[step]["input_ids"], batch_at(blocks, step, 4, seed=3)["input_ids"])
    for got, want in zip(resumed, stream[7:]):
        assert torch.equal(got["input_ids"], want["input_ids"])
    assert not torch.equal(batch_at(blocks, 0, 4, seed=4)["input_ids"], stream[0]["input_ids"])


def test_each_epoch_visits_full_batches_of_distinct_rows(blocks):
    # 21 rows, batch 4: 5 batches per epoch, one row left out per epoch
    first_row = {tuple(r.tolist()): i for i, r in enumerate(blocks.input_ids)}
    for epoch in range(2):
        seen = [first_row[tuple(r.tolist())] for step in range(epoch * 5, epoch * 5 + 5)
                for r in batch_at(blocks, step, 4, seed=0)["input_ids"]]
        assert len(seen) == len(set(seen)) == 20
    assert set(batch_at(blocks, 0, 4, seed=0)) == {"input_ids", "labels", "attention_mask"}


def test_sequential_batches_cover_every_row_once_in_order(blocks):
    batches = list(sequential_batches(blocks, batch_size=8))
    assert [b["input_ids"].shape[0] for b in batches] == [8, 8, 5]
    assert torch.equal(torch.cat([b["input_ids"] for b in batches]), blocks.input_ids)
    assert len(list(sequential_batches(blocks, batch_size=8, max_batches=2))) == 2


def test_batch_larger_than_the_data_set_is_an_error(blocks):
    with pytest.raises(ValueError, match="21 rows cannot fill one batch of 32"):
        batch_at(blocks, 0, 32, seed=0)


def test_split_holds_out_a_seeded_disjoint_eval_set(blocks):
    train, held_out = blocks.split(eval_fraction=0.2, seed=1)
    assert (len(train), len(held_out)) == (17, 4)
    rows = {tuple(r.tolist()) for r in torch.cat([train.input_ids, held_out.input_ids])}
    assert len(rows) == 21
    assert torch.equal(blocks.split(0.2, seed=1)[1].input_ids, held_out.input_ids)
    with pytest.raises(ValueError, match="eval_fraction must be in"):
        blocks.split(eval_fraction=1.0, seed=0)


def test_data_config_checks_the_path_and_builds_both_kinds(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        DataConfig(kind="text", path=tmp_path / "missing.txt", seq_len=8)
    path = _write_json(tmp_path / "d.json", [{"instruction": "a", "output": "b"}] * 3)
    instruct = DataConfig(kind="instruct", path=path, seq_len=160, limit=2)
    assert build_dataset(instruct, tokenizer).input_ids.shape == (2, 160)
    text = DataConfig(kind="text", path=SHAKESPEARE, seq_len=8, limit=5)
    assert build_dataset(text, tokenizer).input_ids.shape == (5, 8)



def test_micro_batches_cut_consecutive_rows_and_keep_every_one():
    batch = {"input_ids": torch.arange(10).reshape(5, 2), "labels": torch.arange(10, 20).reshape(5, 2)}
    parts = micro_batches(batch, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 1]
    for name in batch:
        torch.testing.assert_close(torch.cat([p[name] for p in parts]), batch[name])
