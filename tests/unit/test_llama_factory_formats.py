"""LLaMA-Factory's data formats read by vela-ray: Alpaca with system and history, ShareGPT with tool calls
and tags, OpenAI content parts, text records, dataset_info.json entries; refusals of what vela-ray would
otherwise ignore (KTO tags, images, preference pairs, downloads); skipping bad records; placeholders.

Each test writes a small file in the format, as LLaMA-Factory's own data/ demo files lay it out."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.fixtures import label_runs
from vela_ray.data.chat import conversation_of, encode_chat
from vela_ray.data.config import DataConfig
from vela_ray.data.datasets import BAD_RECORD, _turn, build_data, instruct_examples, read_instruct_examples
from vela_ray.data.examples import IGNORE_INDEX
from vela_ray.paths import data_dir
from vela_ray.training.tiny_model import CHAT_TEMPLATE, train_tokenizer

SHAKESPEARE = data_dir() / "tinyshakespeare" / "input.txt"

# A ChatML-like template that renders tools and tool calls, as real tool-calling templates do.
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|tools|>\\n' }}{% for tool in tools %}{{ tool.function.name }}: "
    "{{ tool.function.description }}{{ '\\n' }}{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{{ '<call>' + call.function.name + ' ' + (call.function.arguments | tojson) + '</call>' }}{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = train_tokenizer(SHAKESPEARE.read_text()[:30_000], vocab_size=400)
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer




def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _row(dataset, index: int = 0) -> tuple[list[int], list[int]]:
    """Row `index`'s ids and labels without the padding."""
    length = int(dataset.attention_mask[index].sum())
    return dataset.input_ids[index, :length].tolist(), dataset.labels[index, :length].tolist()


def _write(path, records) -> str:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text(json.dumps(records, indent=1))
    return path


# --- Alpaca with system and history ----------------------------------------------------------------

ALPACA = [{"instruction": "And your name?", "input": "", "output": "Horatio, my lord.",
           "system": "You are a guard of Elsinore.",
           "history": [["Who goes there?", "A friend to this ground."], ["Stand, ho!", "Friends, sir."]]},
          {"instruction": "Speak.", "input": "to the ghost", "output": "Stay, illusion!"}]


def test_alpaca_system_and_history_are_rendered_and_every_response_is_a_label(tokenizer, tmp_path):
    path = _write(tmp_path / "alpaca.json", ALPACA)
    built = build_data(DataConfig(kind="instruct", path=path, seq_len=256), tokenizer)
    ids, labels = _row(built.dataset, 0)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    # the system prompt replaces the Alpaca preamble; each turn is closed by EOS and a blank line
    prompts = ["You are a guard of Elsinore.\n\n" + _turn("Who goes there?"), "\n\n" + _turn("Stand, ho!"),
               "\n\n" + _turn("And your name?")]
    answers = ["A friend to this ground.", "Friends, sir.", "Horatio, my lord."]
    expected_ids, expected_labels = [bos], [IGNORE_INDEX]
    for prompt, answer in zip(prompts, answers):
        expected_ids += _ids(tokenizer, prompt) + _ids(tokenizer, answer) + [eos]
        expected_labels += [IGNORE_INDEX] * len(_ids(tokenizer, prompt)) + _ids(tokenizer, answer) + [eos]
    assert ids == expected_ids
    assert labels == expected_labels
    assert [tokenizer.decode(run) for run in label_runs(labels)] == [a + "</s>" for a in answers]
    # a record without system or history keeps vela-ray's Alpaca prompt, with the input section
    ids, labels = _row(built.dataset, 1)
    [plain] = instruct_examples(tokenizer, read_instruct_examples(path)[0][1:])
    assert (ids, labels) == (plain.input_ids, plain.labels)
    assert tokenizer.decode(ids).startswith("<s>Below is an instruction that describes a task, paired with an input")
    assert built.records.read == 2 and built.records.skipped == 0


def test_alpaca_records_read_as_chat_become_turns_of_the_chat_template(tokenizer, tmp_path):
    path = _write(tmp_path / "alpaca.json", ALPACA[:1])
    built = build_data(DataConfig(kind="chat", path=path, seq_len=256, chat_template=CHAT_TEMPLATE), tokenizer)
    ids, labels = _row(built.dataset)
    assert tokenizer.decode(ids) == ("<s><|system|>\nYou are a guard of Elsinore.\n<|user|>\nWho goes there?\n"
                                     "<|assistant|>\nA friend to this ground.</s>\n<|user|>\nStand, ho!\n"
                                     "<|assistant|>\nFriends, sir.</s>\n<|user|>\nAnd your name?\n"
                                     "<|assistant|>\nHoratio, my lord.</s>\n")
    assert [tokenizer.decode(run) for run in label_runs(labels)] == [
        "A friend to this ground.</s>\n", "Friends, sir.</s>\n", "Horatio, my lord.</s>\n"]


def test_bad_history_is_one_line_naming_record_and_field(tmp_path):
    path = _write(tmp_path / "a.json", [{"instruction": "a", "output": "b", "history": [["only one"]]}])
    with pytest.raises(ValueError, match=r"a\.json: record 0: field 'history' must be a list of \[instruction, "
                                         r"response\] string pairs"):
        read_instruct_examples(path)


# --- ShareGPT with tool calls ------------------------------------------------------------------------

TOOLS = [{"name": "get_weather", "description": "The weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
GLAIVE = {"conversations": [
    {"from": "human", "value": "Is it raining in Elsinore?"},
    {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Elsinore"}})},
    {"from": "observation", "value": json.dumps({"rain": True})},
    {"from": "gpt", "value": "Yes, it rains."}], "tools": json.dumps(TOOLS)}


def test_sharegpt_tool_calls_are_labels_and_observations_are_not(tokenizer, tmp_path):
    path = _write(tmp_path / "glaive.json", [GLAIVE])
    built = build_data(DataConfig(kind="chat", path=path, seq_len=256), tokenizer)
    ids, labels = _row(built.dataset)
    text = ('<s><|tools|>\nget_weather: The weather of a city\n<|user|>\nIs it raining in Elsinore?\n'
            '<|assistant|>\n<call>get_weather {"city": "Elsinore"}</call></s>\n<|tool|>\n{"rain": true}\n'
            '<|assistant|>\nYes, it rains.</s>\n')
    assert tokenizer.decode(ids) == text
    assert ids == _ids(tokenizer, text)
    assert [tokenizer.decode(run) for run in label_runs(labels)] == [
        '<call>get_weather {"city": "Elsinore"}</call></s>\n', "Yes, it rains.</s>\n"]
    # every labelled token is its own id; the tools, the question and the observation are not learned
    assert all(label in (IGNORE_INDEX, token) for token, label in zip(ids, labels))
    ignored = tokenizer.decode([t for t, label in zip(ids, labels) if label == IGNORE_INDEX])
    assert '{"rain": true}' in ignored and "get_weather: The weather" in ignored


def test_a_template_without_tool_support_is_refused(tokenizer):
    conversation = conversation_of(GLAIVE, "r")
    with pytest.raises(ValueError, match=r"^src: conversation 0: message 1: the chat template does not render tool "
                                         r"calls \(the call to 'get_weather' is not in its text\)"):
        encode_chat(tokenizer, [conversation], CHAT_TEMPLATE, source="src")
    with pytest.raises(ValueError, match=r"^src: conversation 0: the chat template does not render the tools"):
        encode_chat(tokenizer, [conversation[:1] + conversation[3:]], CHAT_TEMPLATE, source="src",
                    tools=[[{"type": "function", "function": TOOLS[0]}]])


def test_llama_factory_tags_name_other_keys_and_roles():
    tags = {"role_tag": "role", "content_tag": "text", "user_tag": "asker", "assistant_tag": "answerer",
            "observation_tag": "result", "function_tag": "call"}
    call = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "X"})})  # arguments as a string
    record = {"conversations": [{"role": "asker", "text": "Rain?"}, {"role": "call", "text": call},
                                {"role": "result", "text": "yes"}, {"role": "answerer", "text": "Yes."}]}
    assert conversation_of(record, "r", tags) == [
        {"role": "user", "content": "Rain?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "X"}}}]},
        {"role": "tool", "content": "yes"}, {"role": "assistant", "content": "Yes."}]
    with pytest.raises(ValueError, match=r"^r: message 0: unknown 'role' value 'human'; data\.tags declare asker, "
                                         r"answerer, result, call, system$"):
        conversation_of({"conversations": [{"role": "human", "text": "x"}]}, "r", tags)


def test_a_function_call_that_is_not_json_names_the_message():
    record = {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "get_weather("}]}
    with pytest.raises(ValueError, match=r"^r: message 1: field 'value' is not valid JSON"):
        conversation_of(record, "r")


def test_sharegpt_records_under_a_messages_column_read_as_sharegpt(tokenizer, tmp_path):
    # vela-ray's data.columns {messages: conversations} on from/value records (the spelling LLaMA-Factory users write)
    path = _write(tmp_path / "s.jsonl", [{"conversations": GLAIVE["conversations"][:1] + [
        {"from": "gpt", "value": "No."}]}])
    config = DataConfig(kind="chat", path=path, seq_len=64, columns={"messages": "conversations"},
                        chat_template=CHAT_TEMPLATE)
    ids, labels = _row(build_data(config, tokenizer).dataset)
    assert [tokenizer.decode(run) for run in label_runs(labels)] == ["No.</s>\n"]


# --- OpenAI content parts ------------------------------------------------------------------------------------


def test_openai_text_parts_are_joined(tokenizer, tmp_path):
    parts = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Who goes there?"}, {"type": "text", "text": "Speak."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A friend."}]}]}
    path = _write(tmp_path / "parts.jsonl", [parts])
    ids, labels = _row(build_data(DataConfig(kind="chat", path=path, seq_len=64), tokenizer).dataset)
    assert tokenizer.decode(ids) == "<s><|user|>\nWho goes there?\nSpeak.\n<|assistant|>\nA friend.</s>\n"
    assert [tokenizer.decode(run) for run in label_runs(labels)] == ["A friend.</s>\n"]


def test_an_image_part_is_refused_by_name(tokenizer, tmp_path):
    parts = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image_url", "image_url": {"url": "http://x/ghost.png"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A ghost."}]}]}
    path = _write(tmp_path / "parts.jsonl", [parts])
    with pytest.raises(ValueError) as err:
        build_data(DataConfig(kind="chat", path=path, seq_len=64), tokenizer)
    assert str(err.value) == (f"{path}: record 0: message 0: content part 1 is of type 'image_url'; vela-ray "
                              "fine-tunes text models and reads text parts only ({type: text, text: ...}); drop the "
                              "image_url parts or the record")


# --- text records -------------------------------------------------------------------------------------------------


def test_text_records_in_jsonl_and_parquet_are_packed_with_eos_between(tokenizer, tmp_path):
    texts = ["First Citizen: Before we proceed any further, hear me speak.",
             "All: Speak, speak. You are all resolved rather to die than to famish?"]
    stream = _ids(tokenizer, texts[0]) + [tokenizer.eos_token_id] + _ids(tokenizer, texts[1])
    jsonl = _write(tmp_path / "c4.jsonl", [{"text": t} for t in texts])
    built = build_data(DataConfig(kind="text", path=jsonl, seq_len=8), tokenizer)
    assert built.dataset.input_ids.flatten().tolist() == stream[:len(stream) // 8 * 8]
    assert built.records.read == 2
    parquet = tmp_path / "c4.parquet"
    pq.write_table(pa.table({"content": texts}), parquet)
    again = build_data(DataConfig(kind="text", path=parquet, seq_len=8, columns={"text": "content"}), tokenizer)
    assert again.dataset.input_ids.tolist() == built.dataset.input_ids.tolist()
    with pytest.raises(ValueError, match=r"c4\.parquet: record 0: missing field 'text'; .*data\.columns"):
        build_data(DataConfig(kind="text", path=parquet, seq_len=8), tokenizer)


# --- dataset_info.json ---------------------------------------------------------------------------------------------


def _llama_factory_dir(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _write(data / "guards.json", [{"q": "And your name?", "a": "Horatio, my lord.", "sys": "You are a guard.",
                                   "past": [["Who goes there?", "A friend."]]}])
    _write(data / "tools.json", [{"dialog": [{"role": "user", "content": "Is it raining?"},
                                             {"role": "assistant", "content": "It is."}]}])
    _write(data / "kto.json", [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                "label": False}])
    info = {
        "guards": {"file_name": "guards.json", "columns": {"prompt": "q", "response": "a", "system": "sys",
                                                           "history": "past"}},
        "openai_style": {"file_name": "tools.json", "formatting": "sharegpt", "columns": {"messages": "dialog"},
                         "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                  "assistant_tag": "assistant"}},
        "from_hub": {"hf_hub_url": "llamafactory/alpaca_en", "formatting": "alpaca"},
        "kto": {"file_name": "kto.json", "formatting": "sharegpt", "columns": {"messages": "messages",
                                                                              "kto_tag": "label"}},
        "dpo": {"file_name": "guards.json", "ranking": True},
        "c4": {"file_name": "c4.jsonl", "columns": {"prompt": "body"}},
    }
    _write(data / "c4.jsonl", [{"body": "First Citizen: Before we proceed any further, hear me speak."}] * 4)
    (data / "dataset_info.json").write_text(json.dumps(info))
    return data


def test_a_dataset_info_entry_sets_path_kind_columns_and_tags(tokenizer, tmp_path):
    data = _llama_factory_dir(tmp_path)
    config = DataConfig(dataset_info=data / "dataset_info.json", name="guards", seq_len=128)
    assert (config.kind, config.path, config.columns) == (
        "instruct", data / "guards.json", {"instruction": "q", "output": "a", "system": "sys", "history": "past"})
    ids, labels = _row(build_data(config, tokenizer).dataset)
    assert [tokenizer.decode(run) for run in label_runs(labels)] == ["A friend.</s>", "Horatio, my lord.</s>"]
    assert tokenizer.decode(ids).startswith("<s>You are a guard.\n\n### Instruction:\nWho goes there?")
    # the directory itself reads the same; a config dumped and read back is the same config
    assert DataConfig(path=data, name="guards", seq_len=128) == config
    assert DataConfig(**config.model_dump()) == config
    chat = DataConfig(dataset_info=data, name="openai_style", seq_len=64, chat_template=CHAT_TEMPLATE)
    assert (chat.kind, chat.columns, chat.tags["role_tag"]) == ("chat", {"conversations": "dialog"}, "role")
    ids, labels = _row(build_data(chat, tokenizer).dataset)
    assert [tokenizer.decode(run) for run in label_runs(labels)] == ["It is.</s>\n"]
    # an alpaca entry mapping a prompt and no response is LLaMA-Factory's pre-training text
    text = DataConfig(dataset_info=data, name="c4", seq_len=8)
    assert (text.kind, text.columns) == ("text", {"text": "body"})
    assert build_data(text, tokenizer).records.read == 4


def test_tools_under_the_alpaca_prompt_are_refused(tmp_path):
    path = _write(tmp_path / "a.json", [{"instruction": "a", "output": "b", "tools": json.dumps(TOOLS)}])
    with pytest.raises(ValueError, match=r"a\.json: record 0: field 'tools': the Alpaca prompt of data\.kind instruct cannot "
                                         r"show tools; read the records as data\.kind chat"):
        read_instruct_examples(path)


@pytest.mark.parametrize("name, message", [
    ("from_hub", r"dataset_info\.json: entry 'from_hub': hf_hub_url 'llamafactory/alpaca_en': vela-ray reads local "
                 r"files only and downloads nothing; download the data set and name it with file_name"),
    ("dpo", r"dataset_info\.json: entry 'dpo': ranking: true marks a preference pair \(chosen/rejected\)"),
    ("nope", r"data\.dataset_info .*dataset_info\.json: no entry 'nope' \(data\.name\); its entries are \["),
    (None, r"data\.dataset_info .*dataset_info\.json: set data\.name to one of its entries"),
])
def test_dataset_info_entries_vela_ray_cannot_read_are_refused_in_one_line(tmp_path, name, message):
    data = _llama_factory_dir(tmp_path)
    with pytest.raises(ValueError, match=message) as err:
        DataConfig(dataset_info=data / "dataset_info.json", name=name)
    assert "\n" not in str(err.value.errors()[0]["msg"])


# --- fields vela-ray does not train on ---------------------------------------------------------------------


CHAT = [{"role": "user", "content": "Who goes there?"}, {"role": "assistant", "content": "A friend."}]


@pytest.mark.parametrize("extra, message", [
    ({"label": False}, r"record 0: field 'label' is a KTO desirable/undesirable tag; supervised fine-tuning "
                       r"\(data\.kind instruct or chat\) would train the undesirable answers as targets, so vela-ray "
                       r"refuses it rather than ignore it; use data\.kind: unpaired_preference with "
                       r"training\.preference\.objective: kto, or keep only the records labelled true and drop the "
                       r"field$"),
    ({"images": ["ghost.png"]}, r"record 0: field 'images' is images; vela-ray fine-tunes text models, which cannot "
                                r"read them, so vela-ray refuses it"),
    ({"chosen": "a", "rejected": "b"}, r"record 0: field 'chosen' is a preference pair \(chosen/rejected\)"),
])
def test_fields_vela_ray_would_ignore_are_refused_by_name(tokenizer, tmp_path, extra, message):
    path = _write(tmp_path / "d.jsonl", [{"messages": CHAT, **extra}])
    with pytest.raises(ValueError, match=r"d\.jsonl: " + message):
        build_data(DataConfig(kind="chat", path=path, seq_len=64), tokenizer)
    alpaca = _write(tmp_path / "a.json", [{"instruction": "a", "output": "b", **extra}])
    with pytest.raises(ValueError, match=r"a\.json: " + message):
        read_instruct_examples(alpaca)


def test_empty_images_are_no_images(tokenizer, tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"messages": CHAT, "images": []}])
    assert build_data(DataConfig(kind="chat", path=path, seq_len=64), tokenizer).records.read == 1


def test_unreplaced_placeholders_are_warned_once_with_count_and_example(tokenizer, tmp_path, caplog):
    identity = [{"instruction": "hi", "output": "Hello! I am {{name}}, an AI assistant developed by {{author}}."},
                {"instruction": "Who are you?", "output": "I am {{name}}."}, {"instruction": "x", "output": "y"}]
    path = _write(tmp_path / "identity.json", identity)
    with caplog.at_level(logging.WARNING, logger="vela_ray.data.records"):
        read_instruct_examples(path)
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning == (f"{path}: 2 of 3 records hold unreplaced {{{{placeholders}}}} (record 0: '{{{{name}}}}'), "
                       "which the model would learn literally; replace them with their values before training")


# --- bad records ---------------------------------------------------------------------------------------------------


def test_bad_records_refuse_the_file_or_are_skipped_counted_and_named(tokenizer, tmp_path, caplog):
    records = [{"messages": CHAT}, {"messages": [{"role": "bot", "content": "x"}]}, {"messages": CHAT},
               {"messages": CHAT[:1]}]
    path = _write(tmp_path / "chat.jsonl", records)
    with pytest.raises(ValueError, match=r"chat\.jsonl: record 1: message 0: unknown role 'bot'"):
        build_data(DataConfig(kind="chat", path=path, seq_len=64, chat_template=CHAT_TEMPLATE), tokenizer)
    config = DataConfig(kind="chat", path=path, seq_len=64, chat_template=CHAT_TEMPLATE, on_bad_record="skip")
    with caplog.at_level(logging.WARNING, logger="vela_ray.data.records"):
        built = build_data(config, tokenizer)
    assert len(built.dataset) == 2
    assert (built.records.read, built.records.skipped, built.records.used) == (4, 2, 2)
    assert [index for index, _ in built.records.reasons] == [1, 3]
    assert built.dataset.stats.dropped[BAD_RECORD] == 2
    [warning] = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert warning.startswith(f"{path}: skipped 2 of 4 records (data.on_bad_record: skip): record 1: message 0: "
                              "unknown role 'bot'")
    assert "; record 3: no assistant message" in warning
    all_bad = _write(tmp_path / "bad.jsonl", records[1:2])
    with pytest.raises(ValueError, match=r"bad\.jsonl: all 1 records are bad \(data\.on_bad_record: skip\): record 0"):
        build_data(DataConfig(kind="chat", path=all_bad, seq_len=64, on_bad_record="skip"), tokenizer)


def test_instruct_skips_bad_records_too(tokenizer, tmp_path):
    path = _write(tmp_path / "a.json", [{"instruction": "a", "output": "b"}, {"instruction": "c"}])
    built = build_data(DataConfig(kind="instruct", path=path, seq_len=256, on_bad_record="skip"), tokenizer)
    assert (len(built.dataset), built.records.skipped) == (1, 1)
    assert built.records.reasons[0][1].startswith("missing field 'output'")
