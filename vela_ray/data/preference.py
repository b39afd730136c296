"""Preference pairs (``data.kind: preference``): a prompt with a chosen and a rejected answer, for DPO, read as
LLaMA-Factory and TRL ship them and tokenised exactly as TRL's `DPOTrainer` does, two rows per pair.

A record holds the prompt in one of these layouts, and its ``chosen`` and ``rejected`` answers:

* ShareGPT (LLaMA-Factory's ``dpo_en_demo.json``): ``conversations`` of from/value turns ending on a human
  turn (``data.tags`` name other keys and roles), each answer ONE message object ``{"from": "gpt", "value"}``;
* OpenAI: ``messages`` of role/content turns, each answer a message ``{role: assistant, content}`` or a string;
* TRL: ``prompt`` as a list of messages and each answer a list of messages (``[{role: assistant, content}]``),
  or no prompt at all and each answer the whole conversation, the prompt being the turns both share (TRL's
  `extract_prompt`);
* Alpaca: ``instruction``, optional ``input``, ``system`` and ``history``, the answers strings; the prompt is
  the user turn kind chat renders from the same fields (`chat.alpaca_to_messages`).

A top-level ``system`` string goes first and ``tools`` reach the template, as for kind chat. A record is bad
(one line naming it; ``data.on_bad_record: skip`` leaves it out) when it lacks an answer, when an answer is
empty or both are the same, or when its prompt does not end on the user turn (or a tool's answer) that the
answers reply to.

Tokenisation is TRL 1.16's conversational path (`DPOTrainer._prepare_dataset`): the prompt is rendered with
the chat template and its generation prompt, prompt + [chosen] and prompt + [rejected] without it, each text
tokenised without added special tokens (what ``apply_chat_template(tokenize=True)`` does); the prompt length is
the shorter of the prompt's common prefixes with the two full sequences, and each answer is what follows it.
Rows (`preference_rows`), as TRL's `DataCollatorForPreference` with ``max_length = data.seq_len`` and
``truncation_mode: keep_start``: pair i is rows 2i (prompt + chosen) and 2i + 1 (prompt + rejected), each its
first seq_len tokens, right-padded; labels are the answer's tokens (TRL's completion mask) and IGNORE_INDEX on
the prompt and the padding. A pair whose prompt alone has seq_len tokens or more is dropped, as TRL drops it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from vela_ray.data.chat import (PROMPT_FIELDS, AlpacaExample, Message, alpaca_history, alpaca_to_messages,
                                chat_template_of, check_prompt, message_in, messages_in, prompt_of, render_chats,
                                tools_of, with_system)
from vela_ray.data.examples import IGNORE_INDEX
from vela_ray.data.records import (PAIR_FIELDS, RecordCount, as_object, load_records, parse_each,
                                   refuse_unreadable_fields, warn_placeholders)
from vela_ray.data.tokenized import PROMPT_FILLS, DataStats, TokenizedDataset

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

PAIR_ROWS = 2
"""Rows per pair (`TokenizedDataset.group`): its chosen sequence, then its rejected one."""


@dataclass(frozen=True)
class PreferencePair:
    """One preference record: the prompt turns and the two answers to them (each a list of messages, TRL's
    conversational completion: usually one assistant message)."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    tools: list[dict] | None = None


@dataclass(frozen=True)
class EncodedPair:
    """One pair as TRL's DPOTrainer tokenises it, before truncation: the token ids of prompt + chosen and of
    prompt + rejected, the first `prompt_len` of each being the prompt."""

    chosen_ids: list[int]
    rejected_ids: list[int]
    prompt_len: int

    @property
    def longest(self) -> int:
        return max(len(self.chosen_ids), len(self.rejected_ids))

    def answer_tokens(self, seq_len: int | None = None) -> int:
        """Answer tokens of both sequences, of their first `seq_len` tokens if given."""
        return sum(max(0, min(len(ids), seq_len or len(ids)) - self.prompt_len)
                   for ids in (self.chosen_ids, self.rejected_ids))


# --- records -> pairs ------------------------------------------------------------------------------------------


def read_preference_pairs(path: Path, columns: Mapping[str, str] | None = None, tags: dict[str, str] | None = None,
                          limit: int | None = None, on_bad_record: str = "error",
                          warn: bool = True) -> tuple[list[PreferencePair], RecordCount]:
    """The pairs of a records file (`vela_ray.data.records` formats, or a `ray.data.Dataset`) and the count of
    records read and skipped (`on_bad_record`: data.on_bad_record). `columns` maps field names to the file's
    own, `tags` are data.tags; `warn`: False logs the warnings about skipped records and placeholders at DEBUG."""
    records = load_records(path, columns, limit)
    if not records:
        raise ValueError(f"{path}: holds no preference records; add records with a prompt, 'chosen' and 'rejected'")
    refuse_unreadable_fields(records, path, read=PAIR_FIELDS)
    pairs, count = parse_each(records, lambda record, where: pair_of(record, where, tags), path, on_bad_record, warn)
    warn_placeholders(records, path, warn)
    return pairs, count


def pair_of(record: object, where: str, tags: dict[str, str] | None = None) -> PreferencePair:
    """The pair in one record (any layout of the module docstring); `where` names the record in errors."""
    record = as_object(record, where)
    missing = next((name for name in PAIR_FIELDS if record.get(name) is None), None)
    if missing is not None:
        raise ValueError(f"{where}: missing field {missing!r}; a preference record needs 'chosen' and 'rejected' "
                         "beside its prompt (or map yours with data.columns)")
    prompt, chosen, rejected = _prompt_and_answers(record, where, tags)
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["content"].strip() or m.get("tool_calls") for m in answer):
            raise ValueError(f"{where}: field {name!r} is empty: there is no answer to compare; write it or drop "
                             "the record")
    if chosen == rejected:
        raise ValueError(f"{where}: chosen and rejected are the same answer, so the pair prefers nothing; fix one "
                         "or drop the record")
    return PreferencePair(prompt, chosen, rejected, tools_of(record, where))


def _prompt_and_answers(record: dict, where: str,
                        tags: dict[str, str] | None) -> tuple[list[Message], list[Message], list[Message]]:
    if isinstance(record.get("prompt"), str):
        raise ValueError(f"{where}: field 'prompt' is text (TRL's standard layout, tokenised without a chat "
                         "template); vela-ray renders pairs with the chat template: write the prompt as messages "
                         "[{role: user, content: ...}], or map it with data.columns: {instruction: prompt}")
    if any(record.get(name) is not None for name in PROMPT_FIELDS):
        prompt = prompt_of(record, where, tags)
    elif record.get("instruction") is not None:
        prompt = _alpaca_prompt(record, where)
    else:
        return _implicit_prompt(record, where, tags)
    return prompt, answer_of(record["chosen"], "chosen", where, tags), \
        answer_of(record["rejected"], "rejected", where, tags)


def answer_of(value: object, field: str, where: str, tags: dict[str, str] | None = None) -> list[Message]:
    """One answer: a string, a message object ({from: gpt, value} or {role: assistant, content}) or a list of
    messages (TRL's completion), as messages starting with the assistant's."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list):
        return _assistant_first(messages_in(value, field, where, tags), field, where)
    return _assistant_first([message_in(value, field, where, tags)], field, where)


def _assistant_first(answer: list[Message], field: str, where: str) -> list[Message]:
    if not answer:
        raise ValueError(f"{where}: field {field!r} is empty: there is no answer to compare; write it or drop the "
                         "record")
    if answer[0]["role"] != "assistant":
        raise ValueError(f"{where}: field {field!r} starts with a {answer[0]['role']} turn; it holds the "
                         "assistant's answer to the prompt (the prompt turns go in 'conversations' or 'messages')")
    return answer


def _alpaca_prompt(record: dict, where: str) -> list[Message]:
    """An Alpaca record's prompt: its system, history and user turn, as kind chat renders the record."""
    instruction = _text(record, "instruction", where)
    if not instruction.strip():
        raise ValueError(f"{where}: field 'instruction' is empty")
    example = AlpacaExample(instruction, _text(record, "input", where), "", _text(record, "system", where),
                            alpaca_history(record, where))
    return alpaca_to_messages(example)[:-1]  # all but the (empty) answer turn


def _text(record: dict, name: str, where: str) -> str:
    value = record.get(name)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: field {name!r} must be a string, got {type(value).__name__} {value!r:.60}")
    return value or ""


def _implicit_prompt(record: dict, where: str,
                     tags: dict[str, str] | None) -> tuple[list[Message], list[Message], list[Message]]:
    """TRL's implicit prompt: chosen and rejected are whole conversations, the prompt the turns they share
    (`trl.data_utils.extract_prompt`)."""
    if not all(isinstance(record[name], list) for name in PAIR_FIELDS):
        raise ValueError(f"{where}: no prompt; a preference record needs 'conversations' or 'messages' (or "
                         "'instruction', or TRL's 'prompt') beside 'chosen' and 'rejected' (or map yours with "
                         "data.columns)")
    chosen, rejected = (messages_in(record[name], name, where, tags) for name in PAIR_FIELDS)
    shared = next((i for i, (c, r) in enumerate(zip(chosen, rejected)) if c != r), min(len(chosen), len(rejected)))
    prompt = with_system(record, chosen[:shared], where)
    check_prompt(prompt, where)
    return prompt, _assistant_first(chosen[shared:], "chosen", where), \
        _assistant_first(rejected[shared:], "rejected", where)


# --- pairs -> token ids ----------------------------------------------------------------------------------------


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    """Leading tokens `ids` and `other` share (TRL's `common_prefix_length`)."""
    length = 0
    for token, other_token in zip(ids, other):
        if token != other_token:
            break
        length += 1
    return length


def encode_pairs(tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair], chat_template: str | None,
                 source: str) -> list[EncodedPair]:
    """Each pair's token ids as TRL's DPOTrainer computes them (the module docstring): rendered with the chat
    template (`chat_template`: data.chat_template, None for the tokenizer's own), tokenised without added special
    tokens, the prompt length the shorter common prefix. Batched: three template passes and one tokenizer call."""
    template = chat_template_of(tokenizer, chat_template)
    numbers, tools = list(range(len(pairs))), [pair.tools for pair in pairs]
    texts = render_chats(tokenizer, [p.prompt for p in pairs], template, True, source, numbers, tools)
    for side in ("chosen", "rejected"):
        texts += render_chats(tokenizer, [p.prompt + getattr(p, side) for p in pairs], template, False, source,
                              numbers, tools)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    count, encoded, diverged = len(pairs), [], 0
    for n in range(count):
        prompt, chosen, rejected = ids[n], ids[count + n], ids[2 * count + n]
        prompt_len = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))
        if prompt_len in (len(chosen), len(rejected)):
            raise ValueError(f"{source}: pair {n}: the chat template renders no token for its "
                             f"{'chosen' if prompt_len == len(chosen) else 'rejected'} answer; use a template that "
                             "renders assistant turns (data.chat_template)")
        diverged += prompt_len < len(prompt)
        encoded.append(EncodedPair(list(chosen), list(rejected), prompt_len))
    if diverged:
        log.warning("%s: for %d of %d pairs the tokenised prompt is not a prefix of prompt + answer (the chat "
                    "template renders the prompt alone differently, or tokens merge across the boundary); as TRL "
                    "does, each answer starts where they diverge", source, diverged, count)
    return encoded


# --- token ids -> rows ----------------------------------------------------------------------------------------


def preference_rows(pairs: list[EncodedPair], seq_len: int, pad_id: int, source: str, *, warn: bool = True,
                    skipped: Mapping[str, int] | None = None) -> TokenizedDataset:
    """Two rows per pair (chosen, then rejected), each its first `seq_len` tokens right-padded with `pad_id`:
    labels on the answer tokens only, attention on the real ones (TRL's `DataCollatorForPreference`, keep_start).
    A pair whose prompt fills `seq_len` is dropped. `skipped`: records left out before tokenisation, by reason;
    `warn`: False logs the counts and the warning at DEBUG (data the driver already built and reported)."""
    kept = [pair for pair in pairs if pair.prompt_len < seq_len]
    if not kept:
        shortest = min((pair.prompt_len for pair in pairs), default=0)
        raise ValueError(f"{source}: every pair's prompt fills seq_len={seq_len} ({len(pairs)} pairs, the shortest "
                         f"prompt has {shortest} tokens), leaving no answer token; raise data.seq_len")
    shape = (PAIR_ROWS * len(kept), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    for k, pair in enumerate(kept):
        for side, ids in enumerate((pair.chosen_ids, pair.rejected_ids)):
            row, cut = PAIR_ROWS * k + side, torch.tensor(ids[:seq_len], dtype=torch.long)
            input_ids[row, :len(cut)] = cut
            labels[row, pair.prompt_len:len(cut)] = cut[pair.prompt_len:]
            attention_mask[row, :len(cut)] = 1
    rows = TokenizedDataset(input_ids, labels, attention_mask, source, group=PAIR_ROWS)
    rows = replace(rows, stats=_stats(pairs, kept, seq_len, skipped, rows))
    stats = rows.stats
    log.log(logging.INFO if warn else logging.DEBUG, "%s: %d pairs read, %d kept (%d truncated to seq_len=%d, "
            "keep_start), %d dropped; %d rows, %.1f%% padding", source, stats.examples, stats.kept, stats.truncated,
            seq_len, stats.num_dropped, stats.rows, 100.0 * stats.padding_fraction)
    warning = stats.warning(source)
    if warning is not None:
        log.log(logging.WARNING if warn else logging.DEBUG, warning)
    return rows


def _stats(pairs: list[EncodedPair], kept: list[EncodedPair], seq_len: int, skipped: Mapping[str, int] | None,
           rows: TokenizedDataset) -> DataStats:
    """What became of the pairs: kept, truncated (either sequence longer than seq_len), dropped by reason."""
    dropped = {**(skipped or {}), **({PROMPT_FILLS: len(pairs) - len(kept)} if len(kept) < len(pairs) else {})}
    supervised = sum(pair.answer_tokens() for pair in pairs)
    lengths = sorted(pair.longest for pair in pairs)
    return DataStats(examples=len(pairs) + sum((skipped or {}).values()), kept=len(kept),
                     truncated=sum(pair.longest > seq_len for pair in kept), dropped=dropped,
                     supervised_tokens=supervised,
                     supervised_tokens_lost=supervised - sum(pair.answer_tokens(seq_len) for pair in kept),
                     longest=lengths[-1] if lengths else 0,
                     seq_len_p90=lengths[(9 * len(lengths) + 9) // 10 - 1] if lengths else 0, seq_len=seq_len,
                     truncation="right", rows=len(rows), padding_fraction=rows.padding_fraction, pairs=True)
