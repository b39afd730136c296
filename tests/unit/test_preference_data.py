"""Tests of data.kind preference (vela_ray.data.preference): DPO pairs read as LLaMA-Factory and TRL ship them,
tokenised to the ids TRL 1.16's DPOTrainer computes (its own `_prepare_dataset` and `DataCollatorForPreference`
called here), truncation and dropping counted, bad records named, and batches that never part a pair."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.fixtures import chat_tokenizer, write_json
from vela_ray.data.config import DataConfig
from vela_ray.data.datasets import BAD_RECORD, batch_at, batch_rows, build_data, iterate_batches, sequential_batches
from vela_ray.data.examples import IGNORE_INDEX
from vela_ray.data.tokenized import PROMPT_FILLS, TokenizedDataset
from vela_ray.training.tiny_model import CHAT_TEMPLATE

LONG = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: You are all "
        "resolved rather to die than to famish? All: Resolved. resolved. First Citizen: First, you know Caius Marcius "
        "is chief enemy to the people.")

# LLaMA-Factory's dpo_en_demo.json layout: ShareGPT prompt turns, each answer one {from: gpt, value} object
SHAREGPT = [
    {"conversations": [{"from": "human", "value": "Who goes there?"}],
     "chosen": {"from": "gpt", "value": "A friend, my lord."}, "rejected": {"from": "gpt", "value": "Nobody."}},
    {"conversations": [{"from": "system", "value": "Speak as a player."}, {"from": "human", "value": "Stand."},
                       {"from": "gpt", "value": "I stand."}, {"from": "human", "value": "Unfold yourself."}],
     "chosen": {"from": "gpt", "value": "Long live the king!"}, "rejected": {"from": "gpt", "value": "No."}},
    {"conversations": [{"from": "human", "value": "Speak the speech."}],  # a long answer: truncated at seq_len 100
     "chosen": {"from": "gpt", "value": LONG}, "rejected": {"from": "gpt", "value": "I will not."}},
    {"conversations": [{"from": "human", "value": LONG}],  # a prompt alone of 100+ tokens: dropped
     "chosen": {"from": "gpt", "value": "Well said."}, "rejected": {"from": "gpt", "value": "Ill said."}},
]
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def _trl_records(records):
    """The same pairs in TRL's conversational layout: prompt messages, each answer a one-message list."""
    return [{"prompt": [{"role": ROLES[m["from"]], "content": m["value"]} for m in r["conversations"]],
             "chosen": [{"role": "assistant", "content": r["chosen"]["value"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]["value"]}]} for r in records]


def _trl_batch(tokenizer, records, seq_len):
    """What TRL 1.16's DPOTrainer feeds its model for `records` (one batch of all of them): its own
    `_prepare_dataset` (prompt extraction, tokenisation, the filter of prompts that fill max_length) and
    `DataCollatorForPreference` (keep_start truncation, right padding): chosen rows first, then rejected."""
    from datasets import Dataset
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    args = SimpleNamespace(dataset_num_proc=None, max_length=seq_len, truncation_mode="keep_start")
    prepared = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tokenizer), Dataset.from_list(records),
                                           tokenizer, args, "train")
    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=seq_len)
    return collator([prepared[i] for i in range(len(prepared))])


def _assert_equals_trl(dataset, trl, pad_id):
    """Row 2i (2i + 1) of `dataset` is TRL's chosen (rejected) row i: the same ids, labels exactly TRL's
    completion mask, and beyond TRL's length only padding."""
    pairs = trl["input_ids"].shape[0] // 2
    assert (dataset.group, len(dataset), dataset.num_examples) == (2, 2 * pairs, pairs)
    for i in range(pairs):
        for ours, theirs in ((2 * i, i), (2 * i + 1, pairs + i)):
            length = int(trl["attention_mask"][theirs].sum())
            ids = trl["input_ids"][theirs, :length]
            labels = torch.where(trl["completion_mask"][theirs, :length].bool(), ids, IGNORE_INDEX)
            assert dataset.input_ids[ours, :length].tolist() == ids.tolist()
            assert dataset.labels[ours, :length].tolist() == labels.tolist()
            assert int(dataset.attention_mask[ours].sum()) == length and dataset.attention_mask[ours, :length].all()
            assert (dataset.input_ids[ours, length:] == pad_id).all()
            assert (dataset.labels[ours, length:] == IGNORE_INDEX).all()


# --- the ids are TRL's ---------------------------------------------------------------------------------------


def test_sharegpt_pairs_are_tokenised_truncated_and_dropped_as_trl_does(tokenizer, tmp_path):
    path = write_json(tmp_path / "dpo_en_demo.json", SHAREGPT)
    for seq_len in (256, 100):
        built = build_data(DataConfig(kind="preference", path=path, seq_len=seq_len), tokenizer)
        _assert_equals_trl(built.dataset, _trl_batch(tokenizer, _trl_records(SHAREGPT), seq_len),
                           tokenizer.pad_token_id)
    stats = built.dataset.stats  # seq_len 100: the long answer cut, the long prompt's pair dropped
    assert (stats.examples, stats.kept, stats.truncated, stats.dropped) == (4, 3, 1, {PROMPT_FILLS: 1})
    assert stats.pairs and stats.rows == 6 and built.records.read == 4
    assert 0 < stats.supervised_tokens_lost < stats.supervised_tokens
    assert "50% of 4 pairs dropped or truncated at data.seq_len=100: 1 truncated" in stats.warning("d")
    assert "keep_answer" not in stats.warning("d")


def test_alpaca_openai_and_trl_layouts_read_as_the_same_pairs(tokenizer, tmp_path):
    alpaca = [{"instruction": "Who goes there?", "chosen": "A friend, my lord.", "rejected": "Nobody."},
              {"instruction": "Unfold yourself.", "input": "Stand.", "system": "Speak as a player.",
               "history": [["Stand.", "I stand."]], "chosen": "Long live the king!", "rejected": "No."}]
    openai = [{"messages": [{"role": "user", "content": "Who goes there?"}],
               "chosen": {"role": "assistant", "content": "A friend, my lord."}, "rejected": "Nobody."},
              {"messages": [{"role": "user", "content": "Stand."}, {"role": "assistant", "content": "I stand."},
                            {"role": "user", "content": "Unfold yourself.\n\nStand."}],
               "system": "Speak as a player.", "chosen": "Long live the king!", "rejected": "No."}]
    trl = [{"prompt": [{"role": "system", "content": "Speak as a player."}] + o["messages"] if "system" in o
            else o["messages"], "chosen": [{"role": "assistant", "content": o["chosen"] if isinstance(o["chosen"], str)
                                           else o["chosen"]["content"]}],
            "rejected": [{"role": "assistant", "content": o["rejected"]}]} for o in openai]
    implicit = [{"chosen": t["prompt"] + t["chosen"], "rejected": t["prompt"] + t["rejected"]} for t in trl]
    built = [build_data(DataConfig(kind="preference", path=write_json(tmp_path / f"{name}.json", records), seq_len=64),
                        tokenizer).dataset for name, records in
             (("alpaca", alpaca), ("openai", openai), ("trl", trl), ("implicit", implicit))]
    _assert_equals_trl(built[0], _trl_batch(tokenizer, trl, 64), tokenizer.pad_token_id)
    for other in built[1:]:
        assert torch.equal(other.input_ids, built[0].input_ids) and torch.equal(other.labels, built[0].labels)


ODD_TEMPLATE = CHAT_TEMPLATE.replace("'<|' + message['role'] + '|>\\n' + message['content']",
                                     "'<|' + message['role'] + '|>' + message['content']")
"""The generation prompt ends in a newline its assistant turns lack: the prompt is no prefix of prompt + answer."""


def test_data_chat_template_is_used_and_a_prompt_that_is_no_prefix_is_cut_as_trl_cuts_it(tokenizer, tmp_path,
                                                                                           caplog):
    path = write_json(tmp_path / "dpo.json", SHAREGPT[:2])
    built = build_data(DataConfig(kind="preference", path=path, seq_len=96, chat_template=ODD_TEMPLATE), tokenizer)
    assert "for 2 of 2 pairs the tokenised prompt is not a prefix of prompt + answer" in caplog.text
    theirs = copy.deepcopy(tokenizer)
    theirs.chat_template = ODD_TEMPLATE
    _assert_equals_trl(built.dataset, _trl_batch(theirs, _trl_records(SHAREGPT[:2]), 96), tokenizer.pad_token_id)
    first = built.dataset.labels[0]
    assert tokenizer.decode(first[first != IGNORE_INDEX]).startswith("A friend")


# --- dataset_info.json ranking entries -----------------------------------------------------------------------


def _llama_factory_dir(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_json(data / "dpo_en_demo.json", [{"dialog": [{"speaker": "user", "text": m["value"]} if m["from"] == "human"
                                                   else {"speaker": "bot", "text": m["value"]}
                                                   for m in r["conversations"] if m["from"] != "system"],
                                        "good": {"speaker": "bot", "text": r["chosen"]["value"]},
                                        "bad": {"speaker": "bot", "text": r["rejected"]["value"]}}
                                       for r in SHAREGPT[:1]])
    write_json(data / "alpaca_dpo.json", [{"question": "Who goes there?", "context": "", "good": "A friend, my lord.",
                                       "bad": "Nobody."}])
    tags = {"role_tag": "speaker", "content_tag": "text", "user_tag": "user", "assistant_tag": "bot"}
    info = {
        "dpo_sharegpt": {"file_name": "dpo_en_demo.json", "formatting": "sharegpt", "ranking": True,
                         "columns": {"messages": "dialog", "chosen": "good", "rejected": "bad"}, "tags": tags},
        "dpo_alpaca": {"file_name": "alpaca_dpo.json", "ranking": True,
                       "columns": {"prompt": "question", "query": "context", "chosen": "good", "rejected": "bad"}},
        "dpo_unmapped": {"file_name": "alpaca_dpo.json", "ranking": True, "columns": {"prompt": "question"}},
        "sft_with_chosen": {"file_name": "alpaca_dpo.json", "columns": {"prompt": "question", "chosen": "good"}},
        "kto": {"file_name": "alpaca_dpo.json", "ranking": True,
                "columns": {"chosen": "good", "rejected": "bad", "kto_tag": "label"}},
    }
    (data / "dataset_info.json").write_text(json.dumps(info))
    return data


def test_ranking_entries_read_as_preference(tokenizer, tmp_path):
    data = _llama_factory_dir(tmp_path)
    sharegpt = DataConfig(dataset_info=data, name="dpo_sharegpt", seq_len=64)
    assert (sharegpt.kind, sharegpt.columns) == (
        "preference", {"conversations": "dialog", "chosen": "good", "rejected": "bad"})
    alpaca = DataConfig(dataset_info=data, name="dpo_alpaca", seq_len=64)
    assert (alpaca.kind, alpaca.columns) == (
        "preference", {"instruction": "question", "input": "context", "chosen": "good", "rejected": "bad"})
    direct = build_data(DataConfig(kind="preference", path=write_json(tmp_path / "d.json", SHAREGPT[:1]), seq_len=64),
                        tokenizer).dataset
    for config in (sharegpt, alpaca):
        assert torch.equal(build_data(config, tokenizer).dataset.input_ids, direct.input_ids)


@pytest.mark.parametrize("name, kind, message", [
    ("dpo_sharegpt", "chat", r"data\.kind chat cannot read entry 'dpo_sharegpt' \(formatting sharegpt, ranking: "
                             r"true\); use data\.kind preference"),
    ("dpo_unmapped", None, r"entry 'dpo_unmapped': ranking: true marks a preference pair \(chosen/rejected\), but "
                           r"columns maps no 'chosen'; name the file's chosen and rejected columns"),
    ("sft_with_chosen", None, r"entry 'sft_with_chosen': columns\.chosen \('good'\) is a preference pair "
                              r"\(chosen/rejected\); the entry has no ranking: true, .*; mark the entry ranking: true"),
    ("kto", None, r"entry 'kto': columns\.kto_tag \('label'\) is a KTO desirable/undesirable tag; a ranking entry "
                  r"holds chosen/rejected pairs, .*; drop ranking: true to read the entry as KTO examples \(data\.kind "
                  r"unpaired_preference\)"),
])
def test_ranking_entries_vela_ray_cannot_read_are_refused_in_one_line(tmp_path, name, kind, message):
    with pytest.raises(ValueError, match=message) as err:
        DataConfig(dataset_info=_llama_factory_dir(tmp_path), name=name, **({"kind": kind} if kind else {}))
    assert "\n" not in str(err.value.errors()[0]["msg"])


# --- bad input ----------------------------------------------------------------------------------------------


GOOD = SHAREGPT[0]


@pytest.mark.parametrize("record, message", [
    ({"conversations": GOOD["conversations"], "chosen": GOOD["chosen"]},
     r"record 1: missing field 'rejected'; a preference record needs 'chosen' and 'rejected' beside its prompt"),
    ({**GOOD, "rejected": {"from": "gpt", "value": " "}}, r"record 1: field 'rejected' is empty: there is no answer"),
    ({**GOOD, "rejected": GOOD["chosen"]}, r"record 1: chosen and rejected are the same answer, so the pair prefers "
                                           r"nothing"),
    ({**GOOD, "conversations": GOOD["conversations"] + [{"from": "gpt", "value": "Hm."}]},
     r"record 1: the prompt ends on message 1 \(assistant\); it must end on the user turn that chosen and "
     r"rejected answer"),
    ({**GOOD, "chosen": {"from": "human", "value": "Hm."}}, r"record 1: field 'chosen' starts with a user turn"),
    ({"prompt": "Who goes there?", "chosen": "A friend.", "rejected": "Nobody."},
     r"record 1: field 'prompt' is text \(TRL's standard layout"),
])
def test_bad_pairs_are_one_line_naming_the_record_and_skipped_on_request(tokenizer, tmp_path, record, message):
    path = write_json(tmp_path / "bad.json", [GOOD, record, SHAREGPT[1]])
    with pytest.raises(ValueError, match=r"bad\.json: " + message) as err:
        build_data(DataConfig(kind="preference", path=path, seq_len=128), tokenizer)
    assert "\n" not in str(err.value)
    built = build_data(DataConfig(kind="preference", path=path, seq_len=128, on_bad_record="skip"), tokenizer)
    assert (built.records.read, built.records.skipped, built.dataset.num_examples) == (3, 1, 2)
    assert built.dataset.stats.dropped == {BAD_RECORD: 1} and built.dataset.stats.examples == 3


def test_options_that_do_not_fit_pairs_are_refused_and_sft_kinds_refuse_pairs(tokenizer, tmp_path):
    path = write_json(tmp_path / "dpo.json", SHAREGPT[:1])
    with pytest.raises(ValueError, match=r"data\.packing does not apply to kind preference: .*TRL's DPOTrainer"):
        DataConfig(kind="preference", path=path, packing=True)
    with pytest.raises(ValueError, match=r"data\.truncation keep_answer does not apply to kind preference"):
        DataConfig(kind="preference", path=path, truncation="keep_answer")
    chat = write_json(tmp_path / "chat.json", [{"messages": [{"role": "user", "content": "a"},
                                                         {"role": "assistant", "content": "b"}], "chosen": "c"}])
    with pytest.raises(ValueError, match=r"record 0: field 'chosen' is a preference pair \(chosen/rejected\); .*; use "
                                         r"data\.kind: preference with training\.preference\.objective: dpo$"):
        build_data(DataConfig(kind="chat", path=chat, seq_len=64), tokenizer)


# --- batches take whole pairs -------------------------------------------------------------------------------


def _rows(count: int, group: int) -> TokenizedDataset:
    """`count` rows whose first token is the row's number."""
    ids = torch.arange(count).repeat_interleave(4).view(count, 4)
    return TokenizedDataset(ids, ids.clone(), torch.ones_like(ids), "rows", group=group)


def test_batches_splits_and_subsets_never_part_a_pair():
    pairs = _rows(20, group=2)
    assert pairs.num_examples == 10
    for step in range(7):
        rows = batch_rows(pairs, step, batch_size=3, seed=1)
        assert len(rows) == 6 and all(rows[0::2] % 2 == 0) and (rows[1::2] == rows[0::2] + 1).all()
        assert batch_at(pairs, step, 3, 1)["input_ids"][:, 0].tolist() == rows.tolist()
    streamed = list(iterate_batches(pairs, 3, seed=1, start_step=2, num_steps=5))
    assert all(torch.equal(b["input_ids"], batch_at(pairs, 2 + k, 3, 1)["input_ids"]) for k, b in enumerate(streamed))
    assert [b["input_ids"][:, 0].tolist() for b in sequential_batches(pairs, 4)] == [
        list(range(0, 8)), list(range(8, 16)), list(range(16, 20))]
    train, held_out = pairs.split(0.3, seed=0)
    assert (train.group, held_out.group, train.num_examples, held_out.num_examples) == (2, 2, 7, 3)
    for part in (train, held_out):
        first = part.input_ids[:, 0]
        assert (first[0::2] % 2 == 0).all() and (first[1::2] == first[0::2] + 1).all()
    assert sorted(torch.cat([train.input_ids[:, 0], held_out.input_ids[:, 0]]).tolist()) == list(range(20))
    with pytest.raises(ValueError, match=r"rows: 10 examples \(2 rows each\) cannot fill one batch of 11"):
        batch_rows(pairs, 0, 11, 0)
    with pytest.raises(ValueError, match=r"7 rows are not whole examples of 2 rows each"):
        _rows(7, group=2)


def test_one_row_per_example_batches_and_splits_as_before():
    rows = _rows(21, group=1)
    for step in range(9):  # the order before groups: a permutation of the rows per epoch, full batches
        epoch, within = divmod(step, 21 // 4)
        expected = np.random.default_rng([5, epoch]).permutation(21)[within * 4:(within + 1) * 4]
        assert batch_rows(rows, step, 4, 5).tolist() == expected.tolist()
    order = np.random.default_rng([3, 0xE7A1]).permutation(21)
    train, held_out = rows.split(0.2, seed=3)
    assert held_out.input_ids[:, 0].tolist() == sorted(order[:4].tolist())
    assert train.input_ids[:, 0].tolist() == sorted(order[4:].tolist())
    assert [len(b["input_ids"]) for b in sequential_batches(rows, 8)] == [8, 8, 5]
    with pytest.raises(ValueError, match=r"rows: 21 rows cannot fill one batch of 32"):
        batch_rows(rows, 0, 32, 0)
