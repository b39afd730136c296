"""Unpaired preference examples (``data.kind: unpaired_preference``): a prompt and one completion marked
desirable or not, for KTO, read as LLaMA-Factory and TRL ship them and tokenised exactly as TRL's `KTOTrainer`
does, one row per example.

A record holds its completion and its prompt in one of these layouts, and a boolean ``label`` (LLaMA-Factory's
``kto_tag``; true: desirable, false: undesirable):

* ShareGPT (LLaMA-Factory's ``kto_en_demo.json``): ``messages`` or ``conversations`` of role/content or
  from/value turns (``data.tags`` name other keys and roles), the last turn the assistant's completion and the
  turns before it the prompt;
* TRL: ``prompt`` and ``completion``, each a list of messages (the completion may also be one message object or a
  string);
* Alpaca: ``instruction``, optional ``input``, ``system`` and ``history``, and ``output``, the completion; the
  prompt is the user turn kind chat renders from the same fields (`chat.alpaca_to_messages`).

A top-level ``system`` string goes first and ``tools`` reach the template, as for kind chat. A record is bad (one
line naming it; ``data.on_bad_record: skip`` leaves it out) when it has no label or a label that is not a boolean
(``true``/``false``; a CSV file's text ``"true"``/``"false"`` reads as them), when its completion is missing or
empty, or when its prompt does not end on the user turn (or a tool's answer) the completion replies to. A
``chosen``/``rejected`` pair is refused (data.kind preference reads those). Data whose examples all carry the same
label is refused as a whole (`refuse_one_label`): KTO weighs desirable against undesirable examples.

Tokenisation is TRL 1.16's conversational path (`KTOTrainer._prepare_dataset`), with the pieces DPO's uses
(`vela_ray.data.preference.tokenize_answers`): the prompt rendered with the chat template and its generation
prompt, prompt + completion without it, each tokenised without added special tokens; the prompt length is their
common prefix, the completion what follows it. Rows (`unpaired_rows`), as TRL's `DataCollatorForUnpairedPreference`
with ``max_length = data.seq_len`` (keep_start): example i is row i, its first seq_len tokens right-padded; labels
are the completion's tokens (TRL's completion mask) and IGNORE_INDEX on the prompt and the padding; an example
whose prompt alone has seq_len tokens or more is dropped, as TRL drops it. `TokenizedDataset.desirable` holds each
row's label, and batches carry it as ``desirable`` [B] bool. TRL's KL sequences (each prompt with another
example's completion) are the objective's to build from a batch's rows, not rows of their own here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from vela_ray.data.chat import PROMPT_FIELDS, Message, check_prompt, prompt_of, record_messages, tools_of
from vela_ray.data.preference import (PromptAnswers, alpaca_prompt, answer_of, keep_start_rows, keep_start_stats,
                                      refuse_text_prompt, report_rows, tokenize_answers)
from vela_ray.data.records import (LABEL_FIELDS, PAIR_FIELDS, RecordCount, as_object, load_records, parse_each,
                                   refuse_unreadable_fields, warn_placeholders)
from vela_ray.data.tokenized import TokenizedDataset

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ANSWERS = "the completion answers"
"""What answers a KTO prompt, in `chat.check_prompt`'s error."""
WHAT = "a KTO record"
LABEL_TEXT = {"true": True, "false": False}
"""A label written as text (CSV columns are read as text): its boolean."""
CONVERSATION_FIELDS = ("messages", "conversations")
"""The fields of a ShareGPT / OpenAI record: the prompt turns, then the completion."""


@dataclass(frozen=True)
class UnpairedExample:
    """One KTO record: the prompt turns, the completion to them (a list of messages, TRL's conversational
    completion: usually one assistant message) and whether it is desirable."""

    prompt: list[Message]
    completion: list[Message]
    desirable: bool
    tools: list[dict] | None = None


@dataclass(frozen=True)
class EncodedCompletion(PromptAnswers):
    """One example as TRL's KTOTrainer tokenises it, before truncation: the token ids of prompt + completion, the
    first `prompt_len` being the prompt, and its label."""

    ids: list[int]
    prompt_len: int
    desirable: bool

    @property
    def sequences(self) -> tuple[list[int], ...]:
        return (self.ids,)


# --- records -> examples ---------------------------------------------------------------------------------------


def read_unpaired_examples(path: Path, columns: Mapping[str, str] | None = None,
                           tags: dict[str, str] | None = None, limit: int | None = None, on_bad_record: str = "error",
                           warn: bool = True) -> tuple[list[UnpairedExample], RecordCount]:
    """The examples of a records file (`vela_ray.data.records` formats, or a `ray.data.Dataset`) and the count of
    records read and skipped (`on_bad_record`: data.on_bad_record). `columns` maps field names to the file's own
    (``kto_tag`` reads as ``label``), `tags` are data.tags; `warn`: False logs the warnings about skipped records
    and placeholders at DEBUG."""
    columns = {("label" if name == "kto_tag" else name): column for name, column in (columns or {}).items()}
    records = load_records(path, columns, limit)
    if not records:
        raise ValueError(f"{path}: holds no KTO records; add records with a prompt, a completion and a 'label'")
    _refuse_pairs(records, path)
    refuse_unreadable_fields(records, path, read=PAIR_FIELDS + LABEL_FIELDS)
    examples, count = parse_each(records, lambda record, where: unpaired_example_of(record, where, tags), path,
                                 on_bad_record, warn)
    warn_placeholders(records, path, warn)
    return examples, count


def _refuse_pairs(records: list[dict], path: Path) -> None:
    """A chosen/rejected pair is DPO's data: refused in one line naming the first record holding one."""
    for index, record in enumerate(records):
        field = next((name for name in PAIR_FIELDS if record.get(name) is not None), None)
        if field is not None:
            raise ValueError(f"{path}: record {index}: field {field!r} is a preference pair (chosen/rejected); "
                             "data.kind unpaired_preference reads one completion and its label per record; use "
                             "data.kind: preference (training.preference.objective: dpo), or write each answer as a "
                             "record of its own with label true or false")


def unpaired_example_of(record: object, where: str, tags: dict[str, str] | None = None) -> UnpairedExample:
    """The example in one record (any layout of the module docstring); `where` names the record in errors."""
    record = as_object(record, where)
    desirable = label_of(record, where)
    prompt, completion, name = _prompt_and_completion(record, where, tags)
    if not any(m["content"].strip() or m.get("tool_calls") for m in completion):
        raise ValueError(f"{where}: {name} is empty: there is no completion to mark desirable or not; write it or "
                         "drop the record")
    return UnpairedExample(prompt, completion, desirable, tools_of(record, where))


def label_of(record: dict, where: str) -> bool:
    """The record's ``label`` (or LLaMA-Factory's ``kto_tag``): a boolean, or the text ``true``/``false`` a CSV
    file holds."""
    present = [name for name in LABEL_FIELDS if record.get(name) is not None]
    if not present:
        raise ValueError(f"{where}: missing field 'label'; a KTO record marks its completion desirable (label: "
                         "true) or undesirable (label: false) (or map yours with data.columns: {label: COLUMN})")
    if len(present) > 1:
        raise ValueError(f"{where}: both {present[0]!r} and {present[1]!r} fields, each a label; keep one")
    name, value = present[0], record[present[0]]
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in LABEL_TEXT:
        return LABEL_TEXT[value.strip().lower()]
    raise ValueError(f"{where}: field {name!r} is {type(value).__name__} {value!r:.40}, not a boolean; write true "
                     "(desirable) or false (undesirable)")


def _prompt_and_completion(record: dict, where: str,
                           tags: dict[str, str] | None) -> tuple[list[Message], list[Message], str]:
    """The prompt, the completion and how errors name the completion."""
    refuse_text_prompt(record, where)
    if record.get("completion") is not None:
        if any(record.get(name) is not None for name in PROMPT_FIELDS):
            prompt = prompt_of(record, where, tags, what=WHAT, answered_by=ANSWERS)
        elif record.get("instruction") is not None:
            prompt = alpaca_prompt(record, where)
        else:
            raise ValueError(f"{where}: no prompt for field 'completion'; give TRL's 'prompt' (a list of messages), "
                             "'messages' or 'conversations', or 'instruction' (or map yours with data.columns)")
        return prompt, answer_of(record["completion"], "completion", where, tags), "field 'completion'"
    if any(record.get(name) is not None for name in CONVERSATION_FIELDS):
        *prompt, last = record_messages(record, where, tags, CONVERSATION_FIELDS, WHAT) or [None]
        if last is None or last["role"] != "assistant":
            ends = f"a {last['role']} turn" if last is not None else "no turn at all"
            raise ValueError(f"{where}: the conversation ends on {ends}; a KTO record's last turn is the assistant's "
                             "completion, the answer its label marks")
        check_prompt(prompt, where, ANSWERS)
        return prompt, [last], "the completion (the last message)"
    if record.get("instruction") is not None:
        output = record.get("output")
        if output is None:
            raise ValueError(f"{where}: missing field 'output' (or 'completion'); an Alpaca KTO record needs the "
                             "answer its label marks")
        if not isinstance(output, str):
            raise ValueError(f"{where}: field 'output' must be a string, got {type(output).__name__} "
                             f"{output!r:.60}")
        return alpaca_prompt(record, where), answer_of(output, "output", where), "field 'output'"
    if record.get("prompt") is not None:
        raise ValueError(f"{where}: missing field 'completion'; TRL's unpaired layout is 'prompt', 'completion' "
                         "and 'label'")
    raise ValueError(f"{where}: no prompt and completion; a KTO record needs 'messages' or 'conversations' ending "
                     "on the assistant's completion, TRL's 'prompt' and 'completion', or 'instruction' and 'output', "
                     "beside its 'label' (or map yours with data.columns)")


def refuse_one_label(labels: list[bool], source: str, limit: int | None = None, dropped: int = 0,
                     seq_len: int | None = None) -> None:
    """KTO weighs desirable examples against undesirable ones: data whose examples all carry one label is refused
    in one line. `limit` (data.limit) is named when it may be what left the other label out; `dropped` examples
    (their prompt filled `seq_len`) when they were."""
    if not labels or any(labels) != all(labels):
        return
    held, missing = ("desirable", "false") if labels[0] else ("undesirable", "true")
    if dropped:
        raise ValueError(f"{source}: KTO needs desirable and undesirable examples: all {len(labels)} kept are {held} "
                         f"({dropped} dropped: the prompt alone fills seq_len={seq_len}); raise data.seq_len or add "
                         f"examples labelled {missing}")
    cut = f" (data.limit: {limit} keeps only the first records)" if limit is not None else ""
    raise ValueError(f"{source}: KTO needs desirable and undesirable examples: all {len(labels)} are {held}{cut}; "
                     f"add examples labelled {missing}")


# --- examples -> token ids -> rows ------------------------------------------------------------------------------


def encode_unpaired(tokenizer: PreTrainedTokenizerBase, examples: list[UnpairedExample], chat_template: str | None,
                    source: str) -> list[EncodedCompletion]:
    """Each example's token ids as TRL's KTOTrainer computes them (`preference.tokenize_answers`; the module
    docstring): two template passes and one tokenizer call."""
    completions = {"completion": [example.completion for example in examples]}
    encoded = tokenize_answers(tokenizer, [example.prompt for example in examples], completions,
                               [example.tools for example in examples], chat_template, source, "example")
    return [EncodedCompletion(ids, prompt_len, example.desirable)
            for ((ids,), prompt_len), example in zip(encoded, examples)]


def unpaired_rows(examples: list[EncodedCompletion], seq_len: int, pad_id: int, source: str, *, warn: bool = True,
                  skipped: Mapping[str, int] | None = None) -> TokenizedDataset:
    """One row per example, its first `seq_len` tokens right-padded with `pad_id`: labels on the completion's
    tokens only, attention on the real ones (TRL's `DataCollatorForUnpairedPreference`), and its label in
    `TokenizedDataset.desirable`. An example whose prompt fills `seq_len` is dropped; the kept must still hold both
    labels (`refuse_one_label`). `skipped`: records left out before tokenisation, by reason; `warn`: False logs the
    counts and the warning at DEBUG (data the driver already built and reported)."""
    kept, rows = keep_start_rows(examples, seq_len, pad_id, source, "example")
    labels = [example.desirable for example in kept]
    refuse_one_label(labels, source, dropped=len(examples) - len(kept), seq_len=seq_len)
    desirable = sum(labels)
    stats = replace(keep_start_stats(examples, kept, seq_len, skipped, rows), desirable=desirable,
                    undesirable=len(kept) - desirable)
    rows = replace(rows, stats=stats, desirable=torch.tensor(labels, dtype=torch.bool))
    return report_rows(rows, "example", warn, held=f"{desirable} desirable, {len(kept) - desirable} undesirable; ")
