"""Chat data: conversations rendered with a chat template, loss on the assistant turns only.

A chat record holds one conversation, in either of the two common layouts:

* OpenAI ``messages``: ``[{"role": "system"|"user"|"assistant", "content": "..."}, ...]``;
* ShareGPT ``conversations``: ``[{"from": "system"|"human"|"user"|"gpt"|"assistant", "value": "..."}, ...]``;

optionally with a top-level ``system`` string that becomes the first (system) message.
`conversation_of` validates one record into a list of ``{role, content}`` messages (errors
name the record and field in one line), `chat_template_of` picks the Jinja template
(``data.chat_template`` or the tokenizer's own) and `encode_chat` renders and tokenises
the conversations into `Example`s whose labels are the tokens of the assistant turns.
Message numbers in errors count from 0, in the record's own list, like record numbers.

Usage::

    conversations = [conversation_of(r, f"{path}: record {i}") for i, r in enumerate(records)]
    examples = encode_chat(tokenizer, conversations, chat_template_of(tokenizer, None), source=str(path))

This module imports no torch or transformers (only for type checking), so a config error
is reported without paying their import.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from vela_ray.data.examples import IGNORE_INDEX, Example, InstructExample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


log = logging.getLogger(__name__)

Message = dict[str, str]  # {"role": "system"|"user"|"assistant", "content": str}

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}

_LAYOUTS = {  # field -> (role key, content key, how an unknown role is reported)
    "messages": ("role", "content", "unknown role {value!r}; use system, user or assistant"),
    "conversations": ("from", "value", "unknown 'from' value {value!r}; use system, human or gpt"),
}


# --- records -> conversations ------------------------------------------------------------------


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _check_conversation(messages: list[Message], where: str) -> None:
    """What every conversation needs, whatever its origin: a system turn only first, an assistant turn
    to learn from, and a user (or system) turn before the first assistant turn (the text before it is
    rendered as a conversation of its own, and a template cannot render an empty one)."""
    for i, message in enumerate(messages):
        if message["role"] == "system" and i > 0:
            raise ValueError(f"{where}: message {i}: a system message must come first")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant message: nothing to learn; a conversation needs at least one "
                         "assistant turn")
    if messages[0]["role"] == "assistant":
        raise ValueError(f"{where}: message 0: the conversation starts with an assistant turn; add the user "
                         "(or system) message before it")


def conversation_of(record: dict, where: str) -> list[Message]:
    """The conversation in one record: OpenAI-style `messages` [{role, content}], or ShareGPT
    `conversations` [{from, value}] (from: system/human/user/gpt/assistant -> system/user/assistant),
    with an optional top-level `system` string put first as a system message.

    `where` names the record in errors (``"data.jsonl: record 12"``). An empty top-level
    ``system`` counts as absent (ShareGPT dumps often carry ``"system": ""``); a record with
    both layouts, or with both a top-level ``system`` and a system message, is refused
    rather than guessed at.
    """
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    present = [field for field in _LAYOUTS if field in record]
    if not present:
        raise ValueError(f"{where}: no 'messages' or 'conversations' field; a chat record needs one "
                         "(or map yours with data.columns)")
    if len(present) > 1:
        raise ValueError(f"{where}: both 'messages' and 'conversations' fields; keep one")
    field = present[0]
    role_key, content_key, unknown = _LAYOUTS[field]
    raw = record[field]
    if not isinstance(raw, list):
        raise ValueError(f"{where}: field {field!r} must be a list of {{{role_key}, {content_key}}} objects")
    messages: list[Message] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ValueError(f"{where}: field {field!r} must be a list of {{{role_key}, {content_key}}} objects; "
                             f"message {i} is a {type(item).__name__}")
        for key in (role_key, content_key):
            if key not in item:
                raise ValueError(f"{where}: message {i}: missing field {key!r}")
        value, content = item[role_key], item[content_key]
        roles = SHAREGPT_ROLES if field == "conversations" else {role: role for role in ROLES}
        role = roles.get(value) if isinstance(value, str) else None
        if role is None:
            raise ValueError(f"{where}: message {i}: {unknown.format(value=value)}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: message {i}: field {content_key!r} must be a string, "
                             f"got {type(content).__name__} {_one_line(repr(content)):.60}")
        messages.append({"role": role, "content": content})
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"{where}: field 'system' must be a string, got {type(system).__name__}")
    if system:
        clash = next((i for i, m in enumerate(messages) if m["role"] == "system"), None)
        if clash is not None:
            raise ValueError(f"{where}: both a top-level 'system' field and a system message (message {clash}); "
                             "keep one")
        messages.insert(0, {"role": "system", "content": system})
    _check_conversation(messages, where)
    return messages


def alpaca_to_messages(example: InstructExample, system: str | None = None) -> list[Message]:
    """An Alpaca example as a conversation: [system], user (instruction, plus a blank line and the
    input when there is one), assistant (the output)."""
    user = f"{example.instruction}\n\n{example.input}" if example.input.strip() else example.instruction
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": example.output}]


# --- template ------------------------------------------------------------------------------------


def chat_template_of(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> str:
    """The Jinja template to render with: `chat_template` (data.chat_template: a path to a file holding
    the template, or the template string itself) if given, else the tokenizer's own; ValueError if neither.

    A value holding ``{{`` or ``{%`` is a template (no file name does); anything else must
    name a file, so a mistyped path is reported instead of being rendered as literal text.
    """
    if chat_template is not None:
        if "{{" in chat_template or "{%" in chat_template:
            return chat_template
        path = Path(chat_template).expanduser()
        try:
            is_file = path.is_file()
        except OSError:  # a name too long for the file system
            is_file = False
        if not is_file:
            raise ValueError(f"data.chat_template: {chat_template!r:.80} is neither a file nor a Jinja template "
                             "(it has no '{{' or '{%')")
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"data.chat_template: {path} is empty; it should hold a Jinja chat template")
        return text
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # named templates (older tokenizer configs): the default one
        own = own.get("default")
    if not own:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"the tokenizer of {name} has no chat template; set data.chat_template to a Jinja "
                         "template file or string")
    return own


# --- encoding ------------------------------------------------------------------------------------


def _render(tokenizer: PreTrainedTokenizerBase, conversations: list[list[Message]], template: str,
            generation_prompt: bool, source: str, numbers: list[int]) -> list[str]:
    """Render a batch of conversations (one template call: per-call overhead dominates short chats);
    if the template raises, find and name the conversation it failed on."""
    if not conversations:
        return []
    try:
        return tokenizer.apply_chat_template(conversations, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as batch_error:  # jinja2 errors, raise_exception() in the template, ...
        for conversation, number in zip(conversations, numbers):
            try:
                tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                              add_generation_prompt=generation_prompt)
            except Exception as err:
                raise ValueError(f"{source}: conversation {number}: the chat template failed: "
                                 f"{type(err).__name__}: {_one_line(err)}") from err
        raise ValueError(f"{source}: the chat template failed: {type(batch_error).__name__}: "
                         f"{_one_line(batch_error)}") from batch_error


def _assistant_spans(tokenizer: PreTrainedTokenizerBase, conversations: list[list[Message]], template: str,
                     source: str) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Each conversation's full rendering and the character spans of its assistant turns in it."""
    numbers = list(range(len(conversations)))
    full = _render(tokenizer, conversations, template, False, source, numbers)
    turns = [(n, i) for n, conversation in enumerate(conversations)
             for i, message in enumerate(conversation) if message["role"] == "assistant"]
    owners = [n for n, _ in turns]
    before = _render(tokenizer, [conversations[n][:i] for n, i in turns], template, True, source, owners)
    through = _render(tokenizer, [conversations[n][:i + 1] for n, i in turns], template, False, source, owners)
    spans: list[list[tuple[int, int]]] = [[] for _ in conversations]
    for (n, i), head, upto in zip(turns, before, through):
        text = full[n]
        if not (text.startswith(head) and text.startswith(upto) and len(head) <= len(upto)):
            raise ValueError(
                f"{source}: conversation {n}: message {i}: the chat template is not prefix-stable (rendering the "
                "conversation up to an assistant turn, with the generation prompt, is not a prefix of rendering it "
                "whole; e.g. it rewrites earlier turns), so assistant tokens cannot be located; use a template "
                "that renders each turn the same whatever follows (data.chat_template)")
        if len(upto) > len(head):
            spans[n].append((len(head), len(upto)))
    return full, spans


def encode_chat(tokenizer: PreTrainedTokenizerBase, conversations: list[list[Message]], chat_template: str | None,
                source: str) -> list[Example]:
    """Render each conversation with the chat template and tokenise it; labels are the tokens of
    assistant turns only (every assistant turn of a multi-turn conversation), IGNORE_INDEX elsewhere
    (system, user, template text). No truncation here (the caller truncates/packs: vela_ray.data.examples).

    `chat_template` is a template string or file (see `chat_template_of`), None for the tokenizer's own.

    How assistant tokens are found, for any template: the assistant turn i occupies the
    characters between ``render(messages[:i], add_generation_prompt=True)`` (everything the
    model reads before it answers, the assistant header included) and ``render(messages[:i+1])``
    (the turn with whatever the template closes it with: EOS / end-of-turn marker, newline),
    so the model also learns to end its turn. Both must be prefixes of the full rendering,
    else the template is refused as not prefix-stable. The full text is then tokenised once
    with character offsets, and a token is labelled iff its span starts inside an assistant
    span. Tokenising the pieces separately and concatenating would not give the ids the
    model sees at inference: BPE merges differently across the piece boundaries, and a
    tokenizer would add its BOS to every piece.

    BOS/EOS: the template decides. If the rendered text begins with the tokenizer's BOS
    string (most templates write ``{{ bos_token }}``), it is tokenised without the tokenizer's
    special tokens, so the BOS is not doubled; otherwise with them, so a BOS the tokenizer
    adds is not missing. Tokens the tokenizer adds have empty character spans and are never
    labelled; an EOS the template writes inside an assistant turn is.

    Needs a fast tokenizer (character offsets). Rendering and tokenising are batched
    (a few template calls and two tokenizer calls for the whole list), so thousands of
    conversations take seconds. Special-token strings inside message text (e.g. a literal
    ``</s>``) are tokenised as those special tokens, as `apply_chat_template` itself does.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{source}: chat data needs a fast tokenizer (character offsets locate the assistant "
                         f"turns); {type(tokenizer).__name__} is not one; load it with "
                         "AutoTokenizer.from_pretrained(..., use_fast=True)")
    for n, conversation in enumerate(conversations):
        if not conversation:
            raise ValueError(f"{source}: conversation {n} is empty: nothing to learn")
        _check_conversation(conversation, f"{source}: conversation {n}")
    template = chat_template_of(tokenizer, chat_template)
    texts, spans = _assistant_spans(tokenizer, conversations, template, source)

    bos = tokenizer.bos_token
    has_bos = [bool(bos) and text.startswith(bos) for text in texts]
    encoded: list[tuple[list[int], list[tuple[int, int]]] | None] = [None] * len(texts)
    for add_special_tokens in (False, True):
        rows = [n for n, starts in enumerate(has_bos) if starts != add_special_tokens]
        if not rows:
            continue
        batch = tokenizer([texts[n] for n in rows], add_special_tokens=add_special_tokens,
                          return_offsets_mapping=True)
        for n, ids, offsets in zip(rows, batch["input_ids"], batch["offset_mapping"]):
            encoded[n] = (ids, offsets)

    import numpy as np  # here, not at module level: importing this module stays cheap

    examples: list[Example] = []
    supervised = total = 0
    for n, ((ids, offsets), turn_spans) in enumerate(zip(encoded, spans)):
        ids_T = np.asarray(ids, dtype=np.int64)
        offsets_T2 = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        spans_K2 = np.asarray(turn_spans or [(0, 0)], dtype=np.int64).reshape(-1, 2)  # (0, 0) holds nothing
        begin_T, end_T = offsets_T2[:, 0], offsets_T2[:, 1]
        # the last assistant span starting at or before each token's first character, if any
        span_T = np.searchsorted(spans_K2[:, 0], begin_T, side="right") - 1
        inside_T = (end_T > begin_T) & (span_T >= 0) & (begin_T < spans_K2[np.maximum(span_T, 0), 1])
        labels = np.where(inside_T, ids_T, IGNORE_INDEX).tolist()
        learned = int(inside_T.sum())
        if not learned:
            raise ValueError(f"{source}: conversation {n}: the chat template renders no text for its assistant "
                             "turns: nothing to learn")
        supervised, total = supervised + learned, total + len(ids)
        examples.append(Example(list(ids), labels))
    log.info("%s: %d conversations, %d tokens, %.1f%% of them in assistant turns", source, len(examples), total,
             100.0 * supervised / max(total, 1))
    return examples
