"""Tests of vela_ray.data.chat: record layouts, template choice, assistant-only labels, and errors."""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from tests.fixtures import label_runs
from vela_ray.data.chat import alpaca_to_messages, chat_template_of, conversation_of, encode_chat
from vela_ray.data.datasets import InstructExample
from vela_ray.data.examples import IGNORE_INDEX
from vela_ray.paths import data_dir
from vela_ray.training.tiny_model import CHAT_TEMPLATE, TinyModelConfig, build_tiny_model, train_tokenizer

SHAKESPEARE = data_dir() / "tinyshakespeare" / "input.txt"
GSM8K = data_dir() / "instruct" / "gsm8k_alpaca.json"

TWO_TURNS = [
    {"role": "system", "content": "Speak as a player."},
    {"role": "user", "content": "Who goes there?"},
    {"role": "assistant", "content": "A friend, my lord."},
    {"role": "user", "content": "Then stand and unfold yourself."},
    {"role": "assistant", "content": "Long live the king!"},
]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = train_tokenizer(SHAKESPEARE.read_text()[:30_000], vocab_size=400)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer




# --- the template and the labels -----------------------------------------------------------------


def test_tiny_template_renders_chatml_like_turns_with_eos_after_assistant_turns(tokenizer):
    text = tokenizer.apply_chat_template(TWO_TURNS[:3], tokenize=False)
    assert text == ("<s><|system|>\nSpeak as a player.\n<|user|>\nWho goes there?\n"
                    "<|assistant|>\nA friend, my lord.</s>\n")
    prompt = tokenizer.apply_chat_template(TWO_TURNS[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|system|>\nSpeak as a player.\n<|user|>\nWho goes there?\n<|assistant|>\n"


def test_two_turn_labels_are_exactly_the_assistant_turns_token_by_token(tokenizer):
    [example] = encode_chat(tokenizer, [TWO_TURNS], None, source="test")
    text = tokenizer.apply_chat_template(TWO_TURNS, tokenize=False)
    assert example.input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert example.input_ids[0] == tokenizer.bos_token_id
    assert example.input_ids.count(tokenizer.bos_token_id) == 1
    runs = label_runs(example.labels)
    assert [tokenizer.decode(run) for run in runs] == ["A friend, my lord.</s>\n", "Long live the king!</s>\n"]
    for run in runs:
        assert run[-2:] == [tokenizer.eos_token_id, tokenizer("\n", add_special_tokens=False)["input_ids"][0]]
    # every labelled token is its own id; every other one (BOS, headers, system and user text) is ignored
    assert all(label in (IGNORE_INDEX, token) for token, label in zip(example.input_ids, example.labels))
    ignored = [t for t, label in zip(example.input_ids, example.labels) if label == IGNORE_INDEX]
    assert tokenizer.decode(ignored) == ("<s><|system|>\nSpeak as a player.\n<|user|>\nWho goes there?\n"
                                         "<|assistant|>\n<|user|>\nThen stand and unfold yourself.\n<|assistant|>\n")


def test_a_template_without_bos_gets_the_tokenizers_bos_once(tokenizer):
    no_bos = CHAT_TEMPLATE.replace("{{ bos_token }}", "")
    [example] = encode_chat(tokenizer, [TWO_TURNS], no_bos, source="test")
    [with_bos] = encode_chat(tokenizer, [TWO_TURNS], None, source="test")
    assert example.input_ids[0] == tokenizer.bos_token_id and example.labels[0] == IGNORE_INDEX
    assert example.input_ids.count(tokenizer.bos_token_id) == 1
    assert example == with_bos  # the tokenizer's BOS stands where the template's would


def test_the_built_tiny_model_saves_the_template(tmp_path):
    config = TinyModelConfig(corpus=SHAKESPEARE, max_corpus_chars=20_000, vocab_size=300, num_layers=1,
                             hidden_size=16, intermediate_size=16, num_heads=2, num_kv_heads=1, num_experts=2,
                             top_k=1, seq_len=16, batch_size=2, steps=1, warmup_steps=0)
    build_tiny_model(config, tmp_path, skew_data=tmp_path / "none.txt", num_threads=1)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == CHAT_TEMPLATE
    [example] = encode_chat(loaded, [TWO_TURNS], None, source="built")
    assert [loaded.decode(run) for run in label_runs(example.labels)] == ["A friend, my lord.</s>\n",
                                                                     "Long live the king!</s>\n"]


def test_a_template_that_is_not_prefix_stable_is_refused(tokenizer):
    last_only = "{{ bos_token }}{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(ValueError) as err:
        encode_chat(tokenizer, [TWO_TURNS], last_only, source="test")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("test: conversation 0: message 2: the chat template is not prefix-stable")
    assert "assistant tokens cannot be located" in message


def test_a_failing_template_names_the_conversation(tokenizer):
    strict = "{% if messages|length > 3 %}{{ raise_exception('too long') }}{% endif %}" + CHAT_TEMPLATE
    with pytest.raises(ValueError, match=r"^test: conversation 1: the chat template failed: .*too long$"):
        encode_chat(tokenizer, [TWO_TURNS[:3], TWO_TURNS], strict, source="test")


# --- record layouts --------------------------------------------------------------------------------


SHAREGPT = {"system": "Speak as a player.", "conversations": [
    {"from": "human", "value": "Who goes there?"}, {"from": "gpt", "value": "A friend, my lord."},
    {"from": "user", "value": "Then stand and unfold yourself."},
    {"from": "assistant", "value": "Long live the king!"}]}


def test_sharegpt_messages_and_top_level_system_give_identical_examples(tokenizer):
    records = [{"messages": TWO_TURNS}, {"system": TWO_TURNS[0]["content"], "messages": TWO_TURNS[1:]}, SHAREGPT,
               {"conversations": [{"from": "system", "value": "Speak as a player."}] + SHAREGPT["conversations"]}]
    conversations = [conversation_of(r, f"data.jsonl: record {i}") for i, r in enumerate(records)]
    assert all(c == TWO_TURNS for c in conversations)
    examples = encode_chat(tokenizer, conversations, None, source="data.jsonl")
    assert all(e == examples[0] for e in examples)


def test_an_empty_top_level_system_is_absent():
    assert conversation_of({"system": "", "messages": TWO_TURNS[1:3]}, "r") == TWO_TURNS[1:3]


def test_alpaca_sharegpt_and_messages_from_gsm8k_encode_identically(tokenizer):
    records = json.loads(GSM8K.read_text())[:40]
    alpaca = [InstructExample(r["instruction"], r.get("input", ""), r["output"]) for r in records]
    alpaca[1] = InstructExample(alpaca[1].instruction, "Answer in one line.", alpaca[1].output)  # with an input
    system = "You solve grade-school maths."
    messages = [alpaca_to_messages(e, system=system) for e in alpaca]
    assert messages[1][1]["content"] == f"{alpaca[1].instruction}\n\nAnswer in one line."
    assert messages[0][1:] == [{"role": "user", "content": alpaca[0].instruction},
                               {"role": "assistant", "content": alpaca[0].output}]
    as_messages = [{"messages": m} for m in messages]
    as_sharegpt = [{"system": system, "conversations": [
        {"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in c[1:]]}
        for c in messages]
    encoded = [encode_chat(tokenizer, [conversation_of(r, f"gsm8k: record {i}") for i, r in enumerate(layout)],
                           None, source="gsm8k") for layout in (as_messages, as_sharegpt)]
    assert encoded[0] == encoded[1]
    assert encoded[0] == encode_chat(tokenizer, messages, None, source="gsm8k")
    for example, record in zip(encoded[0], alpaca):
        [run] = label_runs(example.labels)
        assert tokenizer.decode(run) == record.output + "</s>\n"


# --- template choice ------------------------------------------------------------------------------


def test_chat_template_from_a_file_a_string_or_the_tokenizer(tokenizer, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat_template_of(tokenizer, str(path)) == path.read_text()
    assert chat_template_of(tokenizer, "{{ messages }}") == "{{ messages }}"
    assert chat_template_of(tokenizer, None) == CHAT_TEMPLATE


def test_chat_template_errors_are_one_line(tokenizer, tmp_path):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    bare.name_or_path = "tiny/bare"
    with pytest.raises(ValueError) as err:
        chat_template_of(bare, None)
    assert str(err.value) == ("the tokenizer of tiny/bare has no chat template; set data.chat_template to a Jinja "
                              "template file or string")
    with pytest.raises(ValueError, match=r"no chat template"):
        encode_chat(bare, [TWO_TURNS], None, source="test")
    with pytest.raises(ValueError, match=r"^data\.chat_template: .*missing\.jinja.* is neither a file nor a Jinja"):
        chat_template_of(tokenizer, str(tmp_path / "missing.jinja"))
    (tmp_path / "empty.jinja").write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jinja is empty"):
        chat_template_of(tokenizer, str(tmp_path / "empty.jinja"))


# --- validation -----------------------------------------------------------------------------------


USER, ASSISTANT = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}


@pytest.mark.parametrize("record, message", [
    ({"messages": "hi"}, "r: field 'messages' must be a list of {role, content} objects"),
    ({"messages": [USER, "hi"]}, "r: field 'messages' must be a list of {role, content} objects; message 1 is a str"),
    ({"conversations": {"from": "human"}}, "r: field 'conversations' must be a list of {from, value} objects"),
    ({"messages": [USER, ASSISTANT, {"role": "bot", "content": "x"}]},
     "r: message 2: unknown role 'bot'; use system, user or assistant (or tool for a tool's answer)"),
    ({"messages": [USER, {"role": "gpt", "content": "x"}]},
     "r: message 1: unknown role 'gpt'; use system, user or assistant (or tool for a tool's answer)"),
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "x"}]},
     "r: message 1: unknown 'from' value 'bot'; use system, human or gpt (or function_call and observation for a "
     "tool call and its answer)"),
    ({"messages": [USER, {"role": "assistant"}]}, "r: message 1: missing field 'content' (its fields: ['role']); "
     "write messages as {role, content} or {from, value}, or name your keys with data.tags role_tag and content_tag"),
    ({"messages": [{"text": "Hi"}, ASSISTANT]}, "r: message 0: missing field 'role' (its fields: ['text']); "
     "write messages as {role, content} or {from, value}, or name your keys with data.tags role_tag and content_tag"),
    ({"conversations": [{"from": "human"}]}, "r: message 0: missing field 'value' (its fields: ['from']); "
     "write messages as {role, content} or {from, value}, or name your keys with data.tags role_tag and content_tag"),
    ({"messages": [USER, {"role": "assistant", "content": ["a", "b"]}]},
     "r: message 1: field 'content' must be a string or a list of {type: text, text} parts, got list ['a', 'b']"),
    ({"conversations": [{"from": "human", "value": 3}]},
     "r: message 0: field 'value' must be a string or a list of {type: text, text} parts, got int 3"),
    ({"instruction": "Hi", "output": "Hello"},
     "r: no 'messages' or 'conversations' field; a chat record needs one (or map yours with data.columns)"),
    ({"messages": [USER], "conversations": []}, "r: both 'messages' and 'conversations' fields; keep one"),
    ({"messages": [USER]}, "r: no assistant message: nothing to learn; a conversation needs at least one "
                           "assistant turn"),
    ({"messages": []}, "r: no assistant message: nothing to learn; a conversation needs at least one "
                       "assistant turn"),
    ({"messages": [USER, {"role": "system", "content": "Be brief."}, ASSISTANT]},
     "r: message 1: a system message must come first"),
    ({"system": "Be brief.", "messages": [{"role": "system", "content": "x"}, USER, ASSISTANT]},
     "r: both a top-level 'system' field and a system message (message 0); keep one"),
    ({"system": 3, "messages": [USER, ASSISTANT]}, "r: field 'system' must be a string, got int"),
    ({"messages": [ASSISTANT, USER, ASSISTANT]},
     "r: message 0: the conversation starts with an assistant turn; add the user (or system) message before it"),
    (["not", "an", "object"], "r: expected a JSON object, got list"),
])
def test_invalid_records_are_one_line_errors_naming_record_and_field(record, message):
    with pytest.raises(ValueError) as err:
        conversation_of(record, "r")
    assert str(err.value) == message
    assert "\n" not in str(err.value)


def test_encode_chat_checks_conversations_built_in_code(tokenizer):
    with pytest.raises(ValueError, match=r"^src: conversation 1: no assistant message: nothing to learn"):
        encode_chat(tokenizer, [TWO_TURNS, [USER]], None, source="src")
    with pytest.raises(ValueError, match=r"^src: conversation 0 is empty: nothing to learn$"):
        encode_chat(tokenizer, [[]], None, source="src")


def test_slow_tokenizers_are_refused():
    slow = type("SlowTokenizer", (), {"is_fast": False})()
    with pytest.raises(ValueError, match=r"^src: chat data needs a fast tokenizer \(character offsets"):
        encode_chat(slow, [TWO_TURNS], None, source="src")
