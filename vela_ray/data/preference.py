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

Unpaired preference (KTO, `vela_ray.data.unpaired`) reads and tokenises its examples with the same pieces:
`answer_of` and `alpaca_prompt` read a record's answer and Alpaca prompt, `tokenize_answers` renders and tokenises
a prompt with its answers, and `keep_start_rows`, `keep_start_stats` and `report_rows` lay them into rows and count
them; a pair is two sequences sharing a prompt, a KTO example one (`PromptAnswers`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

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


class PromptAnswers:
    """One example as TRL's preference trainers tokenise it, before truncation: `sequences`, the token ids of
    prompt + each answer (one row each), the first `prompt_len` of every one being the prompt. `EncodedPair` and
    `unpaired.EncodedCompletion` are its two shapes; `keep_start_rows` lays either out."""

    prompt_len: int

    @property
    def sequences(self) -> tuple[list[int], ...]:
        raise NotImplementedError

    @property
    def longest(self) -> int:
        return max(len(ids) for ids in self.sequences)

    def answer_tokens(self, seq_len: int | None = None) -> int:
        """Answer tokens of every sequence, of their first `seq_len` tokens if given."""
        return sum(max(0, min(len(ids), seq_len or len(ids)) - self.prompt_len) for ids in self.sequences)


@dataclass(frozen=True)
class EncodedPair(PromptAnswers):
    """One pair as TRL's DPOTrainer tokenises it, before truncation: the token ids of prompt + chosen and of
    prompt + rejected, the first `prompt_len` of each being the prompt."""

    chosen_ids: list[int]
    rejected_ids: list[int]
    prompt_len: int

    @property
    def sequences(self) -> tuple[list[int], ...]:
        return self.chosen_ids, self.rejected_ids


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


def refuse_text_prompt(record: dict, where: str) -> None:
    """TRL's standard (not conversational) layout, a `prompt` string, is refused in one line naming the fix."""
    if isinstance(record.get("prompt"), str):
        raise ValueError(f"{where}: field 'prompt' is text (TRL's standard layout, tokenised without a chat "
                         "template); vela-ray renders preference data with the chat template: write the prompt as "
                         "messages [{role: user, content: ...}], or map it with data.columns: {instruction: prompt}")


def _prompt_and_answers(record: dict, where: str,
                        tags: dict[str, str] | None) -> tuple[list[Message], list[Message], list[Message]]:
    refuse_text_prompt(record, where)
    if any(record.get(name) is not None for name in PROMPT_FIELDS):
        prompt = prompt_of(record, where, tags)
    elif record.get("instruction") is not None:
        prompt = alpaca_prompt(record, where)
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
        raise ValueError(f"{where}: field {field!r} is empty: there is no answer; write it or drop the record")
    if answer[0]["role"] != "assistant":
        raise ValueError(f"{where}: field {field!r} starts with a {answer[0]['role']} turn; it holds the "
                         "assistant's answer to the prompt (the prompt turns go in 'conversations' or 'messages')")
    return answer


def alpaca_prompt(record: dict, where: str) -> list[Message]:
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


def tokenize_answers(tokenizer: PreTrainedTokenizerBase, prompts: list[list[Message]],
                     answers: Mapping[str, list[list[Message]]], tools: list[list[dict] | None],
                     chat_template: str | None, source: str, unit: str) -> list[tuple[tuple[list[int], ...], int]]:
    """Per example (a `unit`: pair, example), the token ids of its prompt + each of its answers (`answers`: the
    answers of every example by name, e.g. chosen and rejected) and its prompt length, as TRL's DPOTrainer and
    KTOTrainer compute them: the prompt rendered with the chat template (`chat_template`: data.chat_template, None
    for the tokenizer's own) and its generation prompt, prompt + answer without, each tokenised without added
    special tokens; the prompt length the shortest common prefix of the prompt's ids with a sequence's. Batched:
    one template pass for the prompts and one per answer, one tokenizer call."""
    template = chat_template_of(tokenizer, chat_template)
    numbers, count = list(range(len(prompts))), len(prompts)
    texts = render_chats(tokenizer, prompts, template, True, source, numbers, tools)
    for side in answers.values():
        texts += render_chats(tokenizer, [p + a for p, a in zip(prompts, side)], template, False, source, numbers,
                              tools)
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    encoded, diverged = [], 0
    for n in range(count):
        prompt = ids[n]
        sequences = tuple(list(ids[(k + 1) * count + n]) for k in range(len(answers)))
        prompt_len = min(common_prefix_length(prompt, full) for full in sequences)
        empty = next((name for name, full in zip(answers, sequences) if prompt_len == len(full)), None)
        if empty is not None:
            raise ValueError(f"{source}: {unit} {n}: the chat template renders no token for its {empty}; use a "
                             "template that renders assistant turns (data.chat_template)")
        diverged += prompt_len < len(prompt)
        encoded.append((sequences, prompt_len))
    if diverged:
        log.warning("%s: for %d of %d %ss the tokenised prompt is not a prefix of prompt + answer (the chat "
                    "template renders the prompt alone differently, or tokens merge across the boundary); as TRL "
                    "does, each answer starts where they diverge", source, diverged, count, unit)
    return encoded


def encode_pairs(tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair], chat_template: str | None,
                 source: str) -> list[EncodedPair]:
    """Each pair's token ids as TRL's DPOTrainer computes them (`tokenize_answers`; the module docstring)."""
    answers = {"chosen answer": [p.chosen for p in pairs], "rejected answer": [p.rejected for p in pairs]}
    encoded = tokenize_answers(tokenizer, [p.prompt for p in pairs], answers, [p.tools for p in pairs],
                               chat_template, source, "pair")
    return [EncodedPair(chosen, rejected, prompt_len) for (chosen, rejected), prompt_len in encoded]


# --- token ids -> rows ----------------------------------------------------------------------------------------


def keep_start_rows(encoded: Sequence[PromptAnswers], seq_len: int, pad_id: int, source: str,
                    unit: str) -> tuple[list[PromptAnswers], TokenizedDataset]:
    """The examples kept (those whose prompt leaves room in `seq_len`) and their rows, each example's sequences
    in adjacent rows (`TokenizedDataset.group`), each sequence its first `seq_len` tokens right-padded with
    `pad_id`: labels on the answer tokens only, attention on the real ones (TRL's `DataCollatorForPreference` and
    `DataCollatorForUnpairedPreference`, keep_start). No stats yet (`keep_start_stats`); `unit` names an example
    in errors (pair, example)."""
    kept = [example for example in encoded if example.prompt_len < seq_len]
    if not kept:
        shortest = min((example.prompt_len for example in encoded), default=0)
        raise ValueError(f"{source}: every {unit}'s prompt fills seq_len={seq_len} ({len(encoded)} {unit}s, the "
                         f"shortest prompt has {shortest} tokens), leaving no answer token; raise data.seq_len")
    group = len(kept[0].sequences)
    shape = (group * len(kept), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    for k, example in enumerate(kept):
        for side, ids in enumerate(example.sequences):
            row, cut = group * k + side, torch.tensor(ids[:seq_len], dtype=torch.long)
            input_ids[row, :len(cut)] = cut
            labels[row, example.prompt_len:len(cut)] = cut[example.prompt_len:]
            attention_mask[row, :len(cut)] = 1
    return kept, TokenizedDataset(input_ids, labels, attention_mask, source, group=group)


def keep_start_stats(encoded: Sequence[PromptAnswers], kept: Sequence[PromptAnswers], seq_len: int,
                     skipped: Mapping[str, int] | None, rows: TokenizedDataset) -> DataStats:
    """What became of the examples `keep_start_rows` laid out: kept, truncated (any sequence longer than seq_len),
    dropped by reason (`skipped`: records left out before tokenisation; `PROMPT_FILLS`)."""
    dropped = {**(skipped or {}), **({PROMPT_FILLS: len(encoded) - len(kept)} if len(kept) < len(encoded) else {})}
    supervised = sum(example.answer_tokens() for example in encoded)
    lengths = sorted(example.longest for example in encoded)
    return DataStats(examples=len(encoded) + sum((skipped or {}).values()), kept=len(kept),
                     truncated=sum(example.longest > seq_len for example in kept), dropped=dropped,
                     supervised_tokens=supervised,
                     supervised_tokens_lost=supervised - sum(example.answer_tokens(seq_len) for example in kept),
                     longest=lengths[-1] if lengths else 0,
                     seq_len_p90=lengths[(9 * len(lengths) + 9) // 10 - 1] if lengths else 0, seq_len=seq_len,
                     truncation="right", rows=len(rows), padding_fraction=rows.padding_fraction,
                     pairs=rows.group == PAIR_ROWS, keep_start=True)


def report_rows(rows: TokenizedDataset, unit: str, warn: bool, held: str = "") -> TokenizedDataset:
    """`rows`, once their counts (`rows.stats`) are logged at INFO and `DataStats.warning` at WARNING (both at
    DEBUG if not `warn`: data the driver already built and reported). `held`: what the kept examples hold, said
    before the truncated count (KTO: "3 desirable, 2 undesirable; ")."""
    stats = rows.stats
    log.log(logging.INFO if warn else logging.DEBUG, "%s: %d %ss read, %d kept (%s%d truncated to seq_len=%d, "
            "keep_start), %d dropped; %d rows, %.1f%% padding", rows.source, stats.examples, unit, stats.kept, held,
            stats.truncated, stats.seq_len, stats.num_dropped, stats.rows, 100.0 * stats.padding_fraction)
    warning = stats.warning(rows.source)
    if warning is not None:
        log.log(logging.WARNING if warn else logging.DEBUG, warning)
    return rows


def preference_rows(pairs: list[EncodedPair], seq_len: int, pad_id: int, source: str, *, warn: bool = True,
                    skipped: Mapping[str, int] | None = None) -> TokenizedDataset:
    """Two rows per pair (chosen, then rejected), each its first `seq_len` tokens right-padded with `pad_id`:
    labels on the answer tokens only, attention on the real ones (TRL's `DataCollatorForPreference`, keep_start).
    A pair whose prompt fills `seq_len` is dropped. `skipped`: records left out before tokenisation, by reason;
    `warn`: False logs the counts and the warning at DEBUG (data the driver already built and reported)."""
    kept, rows = keep_start_rows(pairs, seq_len, pad_id, source, "pair")
    return report_rows(replace(rows, stats=keep_start_stats(pairs, kept, seq_len, skipped, rows)), "pair", warn)
