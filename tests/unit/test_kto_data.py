"""Tests of data.kind unpaired_preference (vela_ray.data.unpaired): KTO examples read as LLaMA-Factory and TRL ship
them, tokenised to the ids TRL 1.16's KTOTrainer computes (its own `_prepare_dataset` and
`DataCollatorForUnpairedPreference` called here), each row's label carried into batches, truncation and dropping
counted, bad records named, and data whose examples all carry one label refused."""

from __future__ import annotations

import copy
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from tests.fixtures import chat_tokenizer, write_json
from vela_ray.data.config import DataConfig
from vela_ray.data.datasets import BAD_RECORD, batch_at, build_data, micro_batches, sequential_batches
from vela_ray.data.examples import IGNORE_INDEX
from vela_ray.data.tokenized import PROMPT_FILLS, TokenizedDataset
from vela_ray.training.tiny_model import CHAT_TEMPLATE

LONG = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: You are all "
        "resolved rather to die than to famish? All: Resolved. resolved. First Citizen: First, you know Caius Marcius "
        "is chief enemy to the people.")


def _turn(role, content):
    return {"content": content, "role": role}


# LLaMA-Factory's kto_en_demo.json layout: role/content `messages`, the last the completion, and a boolean `label`
KTO_DEMO = [
    {"messages": [_turn("user", "Who goes there?"), _turn("assistant", "A friend, my lord.")], "label": True},
    {"messages": [_turn("user", "Who goes there?"), _turn("assistant", "Nobody.")], "label": False},
    {"messages": [_turn("system", "Speak as a player."), _turn("user", "Stand."), _turn("assistant", "I stand."),
                  _turn("user", "Unfold yourself.")] + [_turn("assistant", "Long live the king!")], "label": True},
    {"messages": [_turn("user", "Speak the speech.")] + [_turn("assistant", LONG)],  # cut at seq_len 100
     "label": False},
    {"messages": [_turn("user", LONG), _turn("assistant", "Well said.")], "label": True},  # a prompt of 100+: dropped
]
KTO_EN_DEMO_ENTRY = {"file_name": "kto_en_demo.json", "formatting": "sharegpt",
                     "columns": {"messages": "messages", "kto_tag": "label"},
                     "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                              "assistant_tag": "assistant"}}
"""LLaMA-Factory's data/dataset_info.json entry for kto_en_demo.json."""


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def _trl_records(records):
    """The same examples in TRL's unpaired conversational layout: prompt and completion messages, and label."""
    return [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:], "label": r["label"]} for r in records]


def _trl_batch(tokenizer, records, seq_len):
    """What TRL 1.16's KTOTrainer feeds its model for `records` (one batch of all of them): its own
    `_prepare_dataset` (tokenisation, the filter of prompts that fill max_length) and
    `DataCollatorForUnpairedPreference` (keep_start truncation, right padding)."""
    from datasets import Dataset
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer

    args = SimpleNamespace(dataset_num_proc=None, max_length=seq_len, per_device_train_batch_size=len(records))
    trainer = SimpleNamespace(_tokenizer=tokenizer, calculate_KL=False)
    prepared = KTOTrainer._prepare_dataset(trainer, Dataset.from_list(records), tokenizer, args, "eval")
    collator = DataCollatorForUnpairedPreference(pad_token_id=tokenizer.pad_token_id, max_length=seq_len)
    return collator([prepared[i] for i in range(len(prepared))])


def _assert_equals_trl(dataset, trl, pad_id):
    """Row i of `dataset` is TRL's row i: the same ids, labels exactly TRL's completion mask, beyond TRL's length
    only padding, and TRL's label as `desirable`."""
    count = trl["input_ids"].shape[0]
    assert (dataset.group, len(dataset), dataset.num_examples) == (1, count, count)
    assert dataset.desirable.dtype == torch.bool and dataset.desirable.tolist() == trl["label"].tolist()
    for i in range(count):
        length = int(trl["attention_mask"][i].sum())
        ids = trl["input_ids"][i, :length]
        labels = torch.where(trl["completion_mask"][i, :length].bool(), ids, IGNORE_INDEX)
        assert dataset.input_ids[i, :length].tolist() == ids.tolist()
        assert dataset.labels[i, :length].tolist() == labels.tolist()
        assert int(dataset.attention_mask[i].sum()) == length and dataset.attention_mask[i, :length].all()
        assert (dataset.input_ids[i, length:] == pad_id).all() and (dataset.labels[i, length:] == IGNORE_INDEX).all()


def _kto(path, seq_len=128, **options):
    return DataConfig(kind="unpaired_preference", path=path, seq_len=seq_len, **options)


# --- the ids are TRL's ---------------------------------------------------------------------------------------


def test_kto_en_demo_is_tokenised_truncated_and_dropped_as_trl_does(tokenizer, tmp_path, caplog):
    path = write_json(tmp_path / "kto_en_demo.json", KTO_DEMO)
    for seq_len in (256, 100):
        with caplog.at_level(logging.INFO, logger="vela_ray.data.preference"):
            built = build_data(_kto(path, seq_len), tokenizer)
        _assert_equals_trl(built.dataset, _trl_batch(tokenizer, _trl_records(KTO_DEMO), seq_len),
                           tokenizer.pad_token_id)
    assert built.dataset.desirable.tolist() == [True, False, True, False]  # the long prompt's example dropped
    stats = built.dataset.stats
    assert (stats.examples, stats.kept, stats.truncated, stats.dropped) == (5, 4, 1, {PROMPT_FILLS: 1})
    assert (stats.desirable, stats.undesirable, stats.rows, stats.pairs, stats.keep_start) == (2, 2, 4, False, True)
    assert built.records.read == 5 and 0 < stats.supervised_tokens_lost < stats.supervised_tokens
    assert "40% of 5 examples dropped or truncated at data.seq_len=100: 1 truncated (each sequence's first " \
           "seq_len tokens, TRL's keep_start); 1 dropped (the prompt alone fills seq_len)" in stats.warning("d")
    assert "keep_answer" not in stats.warning("d")
    assert "5 examples read, 4 kept (2 desirable, 2 undesirable; 1 truncated to seq_len=100, keep_start), " \
           "1 dropped; 4 rows" in caplog.text


def test_trl_alpaca_and_sharegpt_layouts_read_as_the_same_examples(tokenizer, tmp_path):
    trl = [{"prompt": [_turn("user", "Who goes there?")], "completion": [_turn("assistant", "A friend.")],
            "label": True},
           {"prompt": [_turn("system", "Speak as a player."), _turn("user", "Stand."), _turn("assistant", "I stand."),
                       _turn("user", "Unfold yourself.\n\nStand.")], "completion": [_turn("assistant", "No.")],
            "label": False}]
    alpaca = [{"instruction": "Who goes there?", "output": "A friend.", "label": True},
              {"instruction": "Unfold yourself.", "input": "Stand.", "system": "Speak as a player.",
               "history": [["Stand.", "I stand."]], "output": "No.", "label": False}]
    sharegpt = [{"conversations": [{"from": "human", "value": "Who goes there?"},
                                   {"from": "gpt", "value": "A friend."}], "label": True},
                {"conversations": [{"from": "human", "value": "Stand."}, {"from": "gpt", "value": "I stand."},
                                   {"from": "human", "value": "Unfold yourself.\n\nStand."},
                                   {"from": "gpt", "value": "No."}], "system": "Speak as a player.", "label": False}]
    strings = [{"messages": t["prompt"], "completion": t["completion"][0]["content"], "label": t["label"]}
               for t in trl]  # a prompt in `messages` and the completion a string
    built = [build_data(_kto(write_json(tmp_path / f"{name}.json", records), 128), tokenizer).dataset
             for name, records in (("trl", trl), ("alpaca", alpaca), ("sharegpt", sharegpt), ("strings", strings))]
    _assert_equals_trl(built[0], _trl_batch(tokenizer, trl, 128), tokenizer.pad_token_id)
    for other in built[1:]:
        assert torch.equal(other.input_ids, built[0].input_ids) and torch.equal(other.labels, built[0].labels)
        assert torch.equal(other.desirable, built[0].desirable)


def test_a_csv_file_labels_with_text_and_data_columns_maps_kto_tag(tokenizer, tmp_path):
    path = tmp_path / "kto.csv"
    path.write_text("question,answer,good\nWho goes there?,A friend.,true\nStand.,No.,False\n")
    config = _kto(path, 64, columns={"instruction": "question", "output": "answer", "kto_tag": "good"})
    assert config.columns == {"instruction": "question", "output": "answer", "label": "good"}
    assert build_data(config, tokenizer).dataset.desirable.tolist() == [True, False]
    with pytest.raises(ValueError, match=r"data\.columns maps both label \('good'\) and kto_tag \('bad'\), the same "
                                         r"field; keep one"):
        _kto(path, columns={"label": "good", "kto_tag": "bad"})


ODD_TEMPLATE = CHAT_TEMPLATE.replace("'<|' + message['role'] + '|>\\n' + message['content']",
                                     "'<|' + message['role'] + '|>' + message['content']")
"""The generation prompt ends in a newline its assistant turns lack: the prompt is no prefix of prompt + answer."""


def test_data_chat_template_is_used_and_a_prompt_that_is_no_prefix_is_cut_as_trl_cuts_it(tokenizer, tmp_path,
                                                                                           caplog):
    path = write_json(tmp_path / "kto.json", KTO_DEMO[:3])
    built = build_data(_kto(path, 96, chat_template=ODD_TEMPLATE), tokenizer)
    assert "for 3 of 3 examples the tokenised prompt is not a prefix of prompt + answer" in caplog.text
    theirs = copy.deepcopy(tokenizer)
    theirs.chat_template = ODD_TEMPLATE
    _assert_equals_trl(built.dataset, _trl_batch(theirs, _trl_records(KTO_DEMO[:3]), 96), tokenizer.pad_token_id)


# --- dataset_info.json entries with a kto_tag -----------------------------------------------------------------


def _llama_factory_dir(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_json(data / "kto_en_demo.json", KTO_DEMO[:3])
    write_json(data / "kto_alpaca.json", [{"q": "Who goes there?", "a": "A friend, my lord.", "good": True},
                                      {"q": "Who goes there?", "a": "Nobody.", "good": False}])
    info = {"kto_en_demo": KTO_EN_DEMO_ENTRY,
            "kto_alpaca": {"file_name": "kto_alpaca.json", "columns": {"prompt": "q", "response": "a",
                                                                       "kto_tag": "good"}},
            "kto_label": {"file_name": "kto_alpaca.json", "columns": {"prompt": "q", "response": "a",
                                                                      "label": "good"}}}
    (data / "dataset_info.json").write_text(json.dumps(info))
    return data


def test_an_entry_with_a_kto_tag_reads_as_unpaired_preference(tokenizer, tmp_path):
    data = _llama_factory_dir(tmp_path)
    demo = DataConfig(dataset_info=data, name="kto_en_demo", seq_len=128)
    assert (demo.kind, demo.columns, demo.tags["role_tag"]) == ("unpaired_preference", {"conversations": "messages"},
                                                                "role")
    direct = build_data(_kto(write_json(tmp_path / "d.json", KTO_DEMO[:3])), tokenizer).dataset
    from_entry = build_data(demo, tokenizer).dataset
    assert torch.equal(from_entry.input_ids, direct.input_ids) and torch.equal(from_entry.desirable, direct.desirable)
    alpaca = DataConfig(dataset_info=data, name="kto_alpaca", seq_len=128)
    assert (alpaca.kind, alpaca.columns) == ("unpaired_preference", {"instruction": "q", "output": "a",
                                                                     "label": "good"})
    assert torch.equal(build_data(alpaca, tokenizer).dataset.input_ids, direct.input_ids[:2])


@pytest.mark.parametrize("name, kind, message", [
    ("kto_en_demo", "chat", r"data\.kind chat cannot read entry 'kto_en_demo' \(formatting sharegpt, kto_tag: KTO "
                            r"examples\); supervised fine-tuning \(data\.kind instruct or chat\) would train the "
                            r"undesirable answers as targets; use data\.kind unpaired_preference"),
    ("kto_alpaca", "preference", r"data\.kind preference cannot read entry 'kto_alpaca' \(formatting alpaca, kto_tag: "
                                 r"KTO examples\); use data\.kind unpaired_preference"),
    ("kto_label", None, r"entry 'kto_label': columns\.label \('good'\) is a KTO desirable/undesirable tag; "
                        r"LLaMA-Factory names that column kto_tag, .*; map it as columns\.kto_tag instead"),
])
def test_kto_entries_read_otherwise_are_refused_in_one_line(tmp_path, name, kind, message):
    with pytest.raises(ValueError, match=message) as err:
        DataConfig(dataset_info=_llama_factory_dir(tmp_path), name=name, **({"kind": kind} if kind else {}))
    assert "\n" not in str(err.value.errors()[0]["msg"])


# --- bad input ----------------------------------------------------------------------------------------------


GOOD, BAD = KTO_DEMO[0], KTO_DEMO[1]


@pytest.mark.parametrize("record, message", [
    ({"messages": GOOD["messages"]}, r"record 1: missing field 'label'; a KTO record marks its completion desirable "
                                     r"\(label: true\) or undesirable \(label: false\)"),
    ({**GOOD, "label": "yes"}, r"record 1: field 'label' is str 'yes', not a boolean; write true \(desirable\) or "
                               r"false \(undesirable\)"),
    ({**GOOD, "label": 1}, r"record 1: field 'label' is int 1, not a boolean"),
    ({**GOOD, "kto_tag": False}, r"record 1: both 'label' and 'kto_tag' fields, each a label; keep one"),
    ({"messages": GOOD["messages"][:1] + [_turn("assistant", " ")], "label": True},
     r"record 1: the completion \(the last message\) is empty: there is no completion to mark desirable or not"),
    ({"prompt": GOOD["messages"][:1], "completion": [], "label": True},
     r"record 1: field 'completion' is empty: there is no answer"),
    ({"instruction": "Who goes there?", "output": "", "label": False}, r"record 1: field 'output' is empty"),
    ({"messages": GOOD["messages"][:1], "label": True},
     r"record 1: the conversation ends on a user turn; a KTO record's last turn is the assistant's completion"),
    ({"prompt": GOOD["messages"], "completion": [_turn("assistant", "Hm.")], "label": True},
     r"record 1: the prompt ends on message 1 \(assistant\); it must end on the user turn that the completion "
     r"answers"),
    ({"messages": [_turn("assistant", "Hm."), _turn("assistant", "Hm.")], "label": True},
     r"record 1: the prompt ends on message 0 \(assistant\); it must end on the user turn that the completion"),
    ({"prompt": GOOD["messages"][:1], "label": True}, r"record 1: missing field 'completion'"),
    ({"prompt": "Who goes there?", "completion": "A friend.", "label": True},
     r"record 1: field 'prompt' is text \(TRL's standard layout"),
])
def test_bad_examples_are_one_line_naming_the_record_and_skipped_on_request(tokenizer, tmp_path, record, message):
    path = write_json(tmp_path / "bad.json", [GOOD, record, BAD])
    with pytest.raises(ValueError, match=r"bad\.json: " + message) as err:
        build_data(_kto(path), tokenizer)
    assert "\n" not in str(err.value)
    built = build_data(_kto(path, on_bad_record="skip"), tokenizer)
    assert (built.records.read, built.records.skipped, built.dataset.num_examples) == (3, 1, 2)
    assert built.dataset.stats.dropped == {BAD_RECORD: 1} and built.dataset.stats.examples == 3


def test_pairs_are_refused_and_sft_kinds_refuse_labels(tokenizer, tmp_path):
    pairs = write_json(tmp_path / "dpo.json", [{**GOOD, "chosen": "A friend.", "rejected": "Nobody."}])
    with pytest.raises(ValueError, match=r"record 0: field 'chosen' is a preference pair \(chosen/rejected\); "
                                         r"data\.kind unpaired_preference reads one completion and its label per "
                                         r"record; use data\.kind: preference"):
        build_data(_kto(pairs), tokenizer)
    with pytest.raises(ValueError, match=r"record 0: field 'label' is a KTO desirable/undesirable tag; .*; use "
                                         r"data\.kind: unpaired_preference with training\.preference\.objective: kto"):
        build_data(DataConfig(kind="chat", path=write_json(tmp_path / "kto.json", [GOOD]), seq_len=64), tokenizer)


def test_options_that_do_not_fit_kto_are_refused(tmp_path):
    path = write_json(tmp_path / "kto.json", KTO_DEMO[:2])
    with pytest.raises(ValueError, match=r"data\.packing does not apply to kind unpaired_preference: each example is "
                                         r"its prompt \+ completion in one padded row, as TRL's KTOTrainer lays it; "
                                         r"set data\.packing: false"):
        _kto(path, packing=True)
    with pytest.raises(ValueError, match=r"data\.truncation keep_answer does not apply to kind unpaired_preference: as "
                                         r"TRL's KTOTrainer \(keep_start\)"):
        _kto(path, truncation="keep_answer")


LONG_BAD = {"messages": [_turn("user", LONG), _turn("assistant", "Ill said.")], "label": False}


@pytest.mark.parametrize("records, options, message", [
    ([GOOD, KTO_DEMO[2]], {}, r"kto\.json: KTO needs desirable and undesirable examples: all 2 are desirable; add "
                              r"examples labelled false$"),
    ([BAD, BAD, GOOD], {"limit": 2}, r"all 2 are undesirable \(data\.limit: 2 keeps only the first records\); add "
                                     r"examples labelled true$"),
    ([LONG_BAD, GOOD, GOOD], {"seq_len": 40}, r"all 2 kept are desirable \(1 dropped: the prompt alone fills "
                                              r"seq_len=40\); raise data\.seq_len or add examples labelled false$"),
])
def test_data_whose_examples_carry_one_label_is_refused(tokenizer, tmp_path, records, options, message):
    path = write_json(tmp_path / "kto.json", records)
    with pytest.raises(ValueError, match=message) as err:
        build_data(_kto(path, **options), tokenizer)
    assert "\n" not in str(err.value)


# --- batches carry each row's label -------------------------------------------------------------------------


def test_batches_splits_and_subsets_carry_desirable(tokenizer, tmp_path):
    rows = 10
    ids = torch.arange(rows).repeat_interleave(4).view(rows, 4)
    labels = torch.arange(rows) % 3 == 0
    dataset = TokenizedDataset(ids, ids.clone(), torch.ones_like(ids), "rows", desirable=labels)
    for step in range(4):
        batch = batch_at(dataset, step, 3, seed=1)
        assert batch["desirable"].dtype == torch.bool and batch["desirable"].shape == (3,)
        assert batch["desirable"].tolist() == (batch["input_ids"][:, 0] % 3 == 0).tolist()
        halves = micro_batches(batch, 2)
        assert torch.equal(torch.cat([half["desirable"] for half in halves]), batch["desirable"])
    train, held_out = dataset.split(0.3, seed=0)
    for part in (train, held_out, dataset.subset([7, 3], "two")):
        assert part.desirable.tolist() == (part.input_ids[:, 0] % 3 == 0).tolist()
    assert [b["desirable"].tolist() for b in sequential_batches(dataset, 4)][0] == [True, False, False, True]
    assert "desirable" not in TokenizedDataset(ids, ids.clone(), torch.ones_like(ids), "plain").rows([0, 1])
    with pytest.raises(ValueError, match=r"rows: desirable must be a bool tensor of one label per row \(10\), got "
                                         r"torch\.int64 \(10,\)"):
        TokenizedDataset(ids, ids.clone(), torch.ones_like(ids), "rows", desirable=labels.long())
    built = build_data(_kto(write_json(tmp_path / "kto.json", KTO_DEMO[:4])), tokenizer).dataset
    batch = batch_at(built, 0, 4, seed=0)
    assert sorted(batch) == ["attention_mask", "desirable", "input_ids", "labels"]
    assert {key: value.dtype for key, value in batch.items()} == {
        "input_ids": torch.long, "labels": torch.long, "attention_mask": torch.long, "desirable": torch.bool}
