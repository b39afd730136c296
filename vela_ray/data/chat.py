"""Chat data: conversations rendered with a chat template, loss on the assistant turns only.

A chat record holds one conversation, in either of the two common layouts:

* OpenAI ``messages``: ``[{"role": "system"|"user"|"assistant", "content": "..."}, ...]``;
* ShareGPT ``conversations``: ``[{"from": "system"|"human"|"user"|"gpt"|"assistant", "value": "..."}, ...]``,
  with LLaMA-Factory's tool turns ``function_call`` (a JSON call) and ``observation`` (its result),
  and its ``tags`` for other key and role names;

optionally with a top-level ``system`` string that becomes the first (system) message and a
``tools`` list of function schemas passed to the template (`tools_of`). OpenAI content given
as a list of parts is read for its text parts.
`conversation_of` validates one record into a list of ``{role, content}`` messages (errors
name the record and field in one line), `chat_template_of` picks the Jinja template
(``data.chat_template`` or the tokenizer's own) and `encode_chat` renders and tokenises
the conversations into `Example`s whose labels are the tokens of the assistant turns.
Preference records (`vela_ray.data.preference`, and KTO's `vela_ray.data.unpaired`) read their
prompt turns with `prompt_of` (or `record_messages` and `check_prompt`), their answers with
`messages_in` / `message_in`, and render with `render_chats`: the same keys, roles, tags and
template as a conversation.
Message numbers in errors count from 0, in the record's own list, like record numbers.

Usage::

    conversations = [conversation_of(r, f"{path}: record {i}") for i, r in enumerate(records)]
    examples = encode_chat(tokenizer, conversations, chat_template_of(tokenizer, None), source=str(path))

This module imports no torch or transformers (only for type checking), so a config error
is reported without paying their import.
"""

from __future__ import annotations

import logging
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vela_ray.data.examples import IGNORE_INDEX, Example, InstructExample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


log = logging.getLogger(__name__)

FUNCTION_CALL = "function_call"  # a parsed turn's role until it becomes an assistant turn with tool_calls

Message = dict[str, Any]  # {"role": "system"|"user"|"assistant"|"tool", "content": str[, "tool_calls": [...]]}

ROLES = ("system", "user", "assistant", "tool")
OPENAI_ROLES = {role: role for role in ROLES}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "observation": "tool", "function_call": FUNCTION_CALL}
"""ShareGPT `from` value -> role; a function_call turn is the assistant calling a tool (its value the JSON
call), an observation the tool's answer (LLaMA-Factory's names)."""
LLAMA_FACTORY_TAGS = {  # tag -> (its default, the role its value stands for); role_tag/content_tag name keys
    "user_tag": ("human", "user"), "assistant_tag": ("gpt", "assistant"), "observation_tag": ("observation", "tool"),
    "function_tag": ("function_call", FUNCTION_CALL), "system_tag": ("system", "system"),
}

_KEYS = {"messages": ("role", "content"), "conversations": ("from", "value")}  # each field's usual keys
_UNKNOWN = {  # role key -> how an unknown role is reported, without data.tags
    "role": "unknown role {value!r}; use system, user or assistant (or tool for a tool's answer)",
    "from": "unknown 'from' value {value!r}; use system, human or gpt (or function_call and observation for a "
            "tool call and its answer)",
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


def conversation_of(record: dict, where: str, tags: dict[str, str] | None = None) -> list[Message]:
    """The conversation in one record: OpenAI-style `messages` [{role, content}], or ShareGPT
    `conversations` [{from, value}] (from: system/human/user/gpt/assistant/function_call/observation),
    with an optional top-level `system` string put first as a system message.

    Either field holds either layout: the keys of its messages decide (LLaMA-Factory reads
    ``conversations`` of role/content and vela-ray's ``data.columns: {messages: conversations}``
    gives ``messages`` of from/value). `tags` (data.tags, LLaMA-Factory's ShareGPT tags) name
    the keys and role values instead. Roles become system/user/assistant/tool: a ShareGPT
    ``function_call`` turn (a JSON ``{"name", "arguments"}`` or a list of them) is an assistant
    turn with ``tool_calls``, an ``observation`` a ``tool`` turn. A content that is a list of
    OpenAI parts is its text parts joined by newlines; any other part is refused by type.

    `where` names the record in errors (``"data.jsonl: record 12"``). An empty top-level
    ``system`` counts as absent (ShareGPT dumps often carry ``"system": ""``); a record with
    both layouts, or with both a top-level ``system`` and a system message, is refused
    rather than guessed at.
    """
    messages = record_messages(record, where, tags, tuple(_KEYS), "a chat record")
    _check_conversation(messages, where)
    return messages


def record_messages(record: dict, where: str, tags: dict[str, str] | None, fields: tuple[str, ...],
                    what: str) -> list[Message]:
    """The messages of the one field of `fields` the record holds (read as `conversation_of` reads them), its
    top-level `system` put first; `what` names the record in the error when it holds none (``a chat record``)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    present = [field for field in fields if record.get(field) is not None]  # datasets fills absent fields: None
    if not present:
        raise ValueError(f"{where}: no {' or '.join(map(repr, fields))} field; {what} needs one "
                         "(or map yours with data.columns)")
    if len(present) > 1:
        raise ValueError(f"{where}: both {present[0]!r} and {present[1]!r} fields; keep one")
    messages = messages_in(record[present[0]], present[0], where, tags)
    return with_system(record, messages, where)


def messages_in(raw: object, field: str, where: str, tags: dict[str, str] | None = None) -> list[Message]:
    """The list of messages `raw` (record field `field`) as {role, content} messages: role/content or from/value
    keys (or data.tags' own), roles read as `conversation_of` reads them."""
    role_key, content_key = _keys_of(field, raw, tags or {})
    if not isinstance(raw, list):
        raise ValueError(f"{where}: field {field!r} must be a list of {{{role_key}, {content_key}}} objects")
    roles, unknown = _roles_of(role_key, tags or {})
    messages: list[Message] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ValueError(f"{where}: field {field!r} must be a list of {{{role_key}, {content_key}}} objects; "
                             f"message {i} is a {type(item).__name__}")
        messages.append(_message(item, role_key, content_key, roles, unknown, f"{where}: message {i}"))
    return messages


def message_in(item: object, field: str, where: str, tags: dict[str, str] | None = None) -> Message:
    """One message object (a preference record's `chosen`, ShareGPT's {from: gpt, value}) read as `messages_in`
    reads the messages of a list."""
    role_key, content_key = _keys_of(field, [item], tags or {})
    if not isinstance(item, dict):
        raise ValueError(f"{where}: field {field!r} must be a string or a {{{role_key}, {content_key}}} object, "
                         f"got {type(item).__name__} {_one_line(repr(item)):.60}")
    roles, unknown = _roles_of(role_key, tags or {})
    return _message(item, role_key, content_key, roles, unknown, f"{where}: field {field!r}")


def with_system(record: dict, messages: list[Message], where: str) -> list[Message]:
    """`messages` with the record's top-level `system` string (if any, and not empty) first; a record with both it
    and a system message is refused rather than guessed at."""
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"{where}: field 'system' must be a string, got {type(system).__name__}")
    if system:
        clash = next((i for i, m in enumerate(messages) if m["role"] == "system"), None)
        if clash is not None:
            raise ValueError(f"{where}: both a top-level 'system' field and a system message (message {clash}); "
                             "keep one")
        messages.insert(0, {"role": "system", "content": system})
    return messages


PROMPT_FIELDS = ("messages", "conversations", "prompt")
"""Where a preference record's prompt turns may be: OpenAI messages, ShareGPT conversations, TRL's prompt."""


PAIR_ANSWERS = "chosen and rejected answer"
"""What answers a preference pair's prompt, in `check_prompt`'s error."""


def prompt_of(record: dict, where: str, tags: dict[str, str] | None = None, *, what: str = "a preference record",
              answered_by: str = PAIR_ANSWERS) -> list[Message]:
    """The prompt turns of a preference record (`PROMPT_FIELDS`, read as `conversation_of` reads a conversation,
    its top-level `system` first): a system turn only first, and the last a user turn (or a tool's answer), the
    turn the answers reply to. `what` and `answered_by` word the errors (`record_messages`, `check_prompt`)."""
    messages = record_messages(record, where, tags, PROMPT_FIELDS, what)
    check_prompt(messages, where, answered_by)
    return messages


def check_prompt(messages: list[Message], where: str, answered_by: str = PAIR_ANSWERS) -> None:
    """A preference prompt: a system turn only first, and it ends on the user turn (or a tool's answer) that the
    answers reply to (a template renders its generation prompt after it); `answered_by` says what answers it, for
    the error (``the completion answers``)."""
    for i, message in enumerate(messages):
        if message["role"] == "system" and i > 0:
            raise ValueError(f"{where}: message {i}: a system message must come first")
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        last = f"message {len(messages) - 1} ({messages[-1]['role']})" if messages else "no turn at all"
        raise ValueError(f"{where}: the prompt ends on {last}; it must end on the user turn that {answered_by}")


def _keys_of(field: str, raw: object, tags: dict[str, str]) -> tuple[str, str]:
    """The role and content keys of a conversation's messages: data.tags', else those its first message has."""
    if "role_tag" in tags or "content_tag" in tags:
        return tags.get("role_tag", "from"), tags.get("content_tag", "value")
    first = next((m for m in raw if isinstance(m, dict)), {}) if isinstance(raw, list) else {}
    for keys in _KEYS.values():
        others = [k for other in _KEYS.values() if other != keys for k in other]
        if any(first.get(k) is not None for k in keys) and all(first.get(k) is None for k in others):
            return keys
    return _KEYS.get(field, _KEYS["messages"])


def _roles_of(role_key: str, tags: dict[str, str]) -> tuple[dict[str, str], str]:
    """Role value -> role, and how an unknown value is reported."""
    if any(tag in tags for tag in LLAMA_FACTORY_TAGS):
        roles = {tags.get(tag, default): role for tag, (default, role) in LLAMA_FACTORY_TAGS.items()}
        return roles, f"unknown {role_key!r} value {{value!r}}; data.tags declare {', '.join(roles)}"
    roles = SHAREGPT_ROLES if role_key == "from" else OPENAI_ROLES
    return roles, _UNKNOWN.get(role_key, f"unknown {role_key!r} value {{value!r}}; use one of {', '.join(roles)}")


def _message(item: dict, role_key: str, content_key: str, roles: dict[str, str], unknown: str, where: str) -> Message:
    tool_calls = item.get("tool_calls")  # OpenAI's own tool-call turns
    for key in (role_key, content_key):
        if key not in item and not (key == content_key and tool_calls):
            raise ValueError(f"{where}: missing field {key!r} (its fields: {sorted(item)}); write messages as "
                             "{role, content} or {from, value}, or name your keys with data.tags role_tag and "
                             "content_tag")
    value, content = item[role_key], item.get(content_key)
    role = roles.get(value) if isinstance(value, str) else None
    if role is None:
        raise ValueError(f"{where}: {unknown.format(value=value)}")
    if role == FUNCTION_CALL:
        if not isinstance(content, str):
            raise ValueError(f"{where}: field {content_key!r} of a function call must be a JSON string "
                             '{"name": ..., "arguments": {...}}')
        return {"role": "assistant", "content": "", "tool_calls": _calls(_json(content, content_key, where), where)}
    if tool_calls:
        if role != "assistant":
            raise ValueError(f"{where}: a {value} message has tool_calls; only assistant messages call tools")
        calls = [c.get("function", c) if isinstance(c, dict) else c for c in tool_calls]
        return {"role": role, "content": _text(content or "", content_key, where), "tool_calls": _calls(calls, where)}
    return {"role": role, "content": _text(content, content_key, where)}


def _text(content: object, content_key: str, where: str) -> str:
    """A message's text: a string, or OpenAI's list of content parts with their text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(p, dict) for p in content):
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind == "text" and not isinstance(part.get("text"), str):
                keys = sorted(k for k in part if part[k] is not None)
                raise ValueError(f"{where}: content part {j} is a text part without a 'text' string (OpenAI's "
                                 f"{{type: text, text: ...}}); its keys are {keys}")
            if kind != "text":
                raise ValueError(f"{where}: content part {j} is of type {kind!r}; vela-ray fine-tunes text "
                                 f"models and reads text parts only ({{type: text, text: ...}}); drop the {kind} "
                                 "parts or the record")
        return "\n".join(part["text"] for part in content)
    raise ValueError(f"{where}: field {content_key!r} must be a string or a list of {{type: text, text}} parts, "
                     f"got {type(content).__name__} {_one_line(repr(content)):.60}")


def _json(text: str, key: str, where: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: field {key!r} is not valid JSON ({err.msg}): {_one_line(text):.60}") from None


def _calls(calls: object, where: str) -> list[dict]:
    """Tool calls as chat templates take them: [{type: function, function: {name, arguments: {...}}}]."""
    calls = calls if isinstance(calls, list) else [calls]
    out = []
    for call in calls:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]):
            raise ValueError(f"{where}: a tool call must be an object with a 'name' and 'arguments', got "
                             f"{_one_line(repr(call)):.60}")
        arguments = call.get("arguments")
        if isinstance(arguments, str):
            arguments = _json(arguments, "arguments", where) if arguments.strip() else {}
        out.append({"type": "function", "function": {"name": call["name"], "arguments": arguments or {}}})
    return out


def tools_of(record: dict, where: str) -> list[dict] | None:
    """The record's `tools` (LLaMA-Factory: a JSON string of function schemas; or a list of them), as chat
    templates take them ({type: function, function: schema}); None if it has none."""
    tools = record.get("tools")
    if isinstance(tools, str):
        tools = _json(tools, "tools", where) if tools.strip() else None
    if tools is None or tools == []:
        return None
    tools = tools if isinstance(tools, list) else [tools]
    if not all(isinstance(t, dict) and (t.get("name") or t.get("function")) for t in tools):
        raise ValueError(f"{where}: field 'tools' must be a list of function schemas {{name, description, "
                         f"parameters}}, got {_one_line(repr(tools)):.60}")
    return [t if t.get("type") else {"type": "function", "function": t} for t in tools]


def tool_names(tools: list[dict] | None) -> list[str]:
    return [t.get("function", t).get("name", "") for t in tools or []]


@dataclass(frozen=True)
class AlpacaExample(InstructExample):
    """An Alpaca record with LLaMA-Factory's optional columns: a system prompt and earlier turns."""

    system: str = ""
    history: tuple[tuple[str, str], ...] = ()
    """Earlier (instruction, response) turns, oldest first."""


def alpaca_history(record: dict, where: str) -> tuple[tuple[str, str], ...]:
    """LLaMA-Factory's Alpaca `history`: earlier [instruction, response] turns, oldest first."""
    history = record.get("history")
    if history is None:
        return ()
    turns = history if isinstance(history, list) else None
    if turns is None or not all(isinstance(t, (list, tuple)) and len(t) == 2 and all(isinstance(x, str) for x in t)
                                for t in turns):
        raise ValueError(f"{where}: field 'history' must be a list of [instruction, response] string pairs, got "
                         f"{history!r:.60}")
    return tuple((query, response) for query, response in turns)


def alpaca_to_messages(example: InstructExample, system: str | None = None) -> list[Message]:
    """An Alpaca example as a conversation: [system], the history's user/assistant turns, then user
    (instruction, plus a blank line and the input when there is one) and assistant (the output).
    `system` (or else the example's own) goes first."""
    history = example.history if isinstance(example, AlpacaExample) else ()
    system = system or (example.system if isinstance(example, AlpacaExample) else "")
    user = f"{example.instruction}\n\n{example.input}" if example.input.strip() else example.instruction
    messages = [{"role": "system", "content": system}] if system else []
    for query, response in history:
        messages += [{"role": "user", "content": query}, {"role": "assistant", "content": response}]
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


def render_chats(tokenizer: PreTrainedTokenizerBase, conversations: list[list[Message]], template: str,
                 generation_prompt: bool, source: str, numbers: list[int],
                 tools: list[list[dict] | None]) -> list[str]:
    """Each conversation rendered to text with `template` (`chat_template_of`) as `apply_chat_template(...,
    tokenize=False)` renders it, with its `tools` and the generation prompt if asked; a template error names the
    conversation by its `numbers` entry. Those without tools go in one template call (per-call overhead dominates
    short chats), those with tools one by one (`apply_chat_template` takes one `tools` list per call)."""
    plain = [k for k, t in enumerate(tools) if t is None]
    texts = dict(zip(plain, _render_batch(tokenizer, [conversations[k] for k in plain], template, generation_prompt,
                                          source, [numbers[k] for k in plain], None)))
    for k, t in enumerate(tools):
        if t is not None:
            [texts[k]] = _render_batch(tokenizer, [conversations[k]], template, generation_prompt, source,
                                       [numbers[k]], t)
    return [texts[k] for k in range(len(conversations))]


def _render_batch(tokenizer: PreTrainedTokenizerBase, conversations: list[list[Message]], template: str,
                  generation_prompt: bool, source: str, numbers: list[int], tools: list[dict] | None) -> list[str]:
    """One template call; if the template raises, find and name the conversation it failed on."""
    if not conversations:
        return []
    options = dict(chat_template=template, tokenize=False, add_generation_prompt=generation_prompt, tools=tools)
    try:
        return tokenizer.apply_chat_template(conversations, **options)
    except Exception as batch_error:  # jinja2 errors, raise_exception() in the template, ...
        for conversation, number in zip(conversations, numbers):
            try:
                tokenizer.apply_chat_template(conversation, **options)
            except Exception as err:
                raise ValueError(f"{source}: conversation {number}: the chat template failed: "
                                 f"{type(err).__name__}: {_one_line(err)}") from err
        raise ValueError(f"{source}: the chat template failed: {type(batch_error).__name__}: "
                         f"{_one_line(batch_error)}") from batch_error


def _assistant_spans(tokenizer: PreTrainedTokenizerBase, conversations: list[list[Message]], template: str,
                     source: str, tools: list[list[dict] | None]) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Each conversation's full rendering and the character spans of its assistant turns (tool calls
    included) in it."""
    numbers = list(range(len(conversations)))
    full = render_chats(tokenizer, conversations, template, False, source, numbers, tools)
    turns = [(n, i) for n, conversation in enumerate(conversations)
             for i, message in enumerate(conversation) if message["role"] == "assistant"]
    owners = [n for n, _ in turns]
    owner_tools = [tools[n] for n in owners]
    before = render_chats(tokenizer, [conversations[n][:i] for n, i in turns], template, True, source, owners,
                          owner_tools)
    through = render_chats(tokenizer, [conversations[n][:i + 1] for n, i in turns], template, False, source,
                           owners, owner_tools)
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
        calls = conversations[n][i].get("tool_calls") or []
        missing = [c["function"]["name"] for c in calls if c["function"]["name"] not in text[len(head):len(upto)]]
        if missing:
            raise ValueError(f"{source}: conversation {n}: message {i}: the chat template does not render tool "
                             f"calls (the call to {missing[0]!r} is not in its text), so they would not be learned; "
                             "use a template that renders tool_calls (data.chat_template)")
    for n, text in enumerate(full):
        missing = [name for name in tool_names(tools[n]) if name not in text]
        if missing:
            raise ValueError(f"{source}: conversation {n}: the chat template does not render the tools given to it "
                             f"(tool {missing[0]!r} is not in its text), so the model would call tools it was never "
                             "shown; use a template that renders `tools` (data.chat_template)")
    return full, spans


def encode_chat(tokenizer: PreTrainedTokenizerBase, conversations: list[list[Message]], chat_template: str | None,
                source: str, tools: list[list[dict] | None] | None = None) -> list[Example]:
    """Render each conversation with the chat template and tokenise it; labels are the tokens of
    assistant turns only (every assistant turn of a multi-turn conversation), IGNORE_INDEX elsewhere
    (system, user, template text). No truncation here (the caller truncates/packs: vela_ray.data.examples).

    `chat_template` is a template string or file (see `chat_template_of`), None for the tokenizer's own.
    `tools` (one list per conversation, or None) is passed to the template as `apply_chat_template`'s
    ``tools``; a template that leaves out a conversation's tools or an assistant turn's
    ``tool_calls`` is refused. Tool calls are assistant turns, so they are labels; tool results
    (role ``tool``) are not.

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
    tools = list(tools) if tools is not None else [None] * len(conversations)
    texts, spans = _assistant_spans(tokenizer, conversations, template, source, tools)

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
