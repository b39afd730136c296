"""Fine-tuning data: packed plain-text corpora, Alpaca-style instructions, chat conversations, preference
pairs and unpaired preference examples.

Five kinds of data set, all tokenised with any Hugging Face tokenizer into a
`TokenizedDataset` of fixed-length rows (N = rows, S = `seq_len`):

* ``text``: one text file or a directory of ``.txt`` files, or records with a ``text`` field
  (JSON, JSONL, Parquet, ...), tokenised and packed into consecutive blocks of S tokens (files
  and records are separated by the EOS token; the tail that does not fill a block is dropped);
  ``labels = input_ids``.
* ``instruct``: records with ``instruction``, optional ``input`` and ``output`` (or
  the Alpaca seed-task layout, where each record holds ``instances: [{input,
  output}]``), rendered with the fixed `ALPACA_PROMPT` template; prompt tokens are
  masked out of the loss (label -100). LLaMA-Factory's optional ``system`` replaces the
  Alpaca preamble, and its ``history`` of earlier [instruction, response] turns comes
  first, each response closed by EOS as its alpaca template does; every response is a label.
* ``chat``: conversations (`vela_ray.data.chat`: OpenAI ``messages``, ShareGPT
  ``conversations`` with LLaMA-Factory's tool turns and tags, or Alpaca records with their
  system and history as turns) rendered with the tokenizer's chat template; only assistant
  turns (tool calls included) are labels.
* ``preference``: DPO pairs, a prompt with a ``chosen`` and a ``rejected`` answer
  (`vela_ray.data.preference`), tokenised as TRL's DPOTrainer does; two rows per pair
  (`TokenizedDataset.group`), labels on the answers only.
* ``unpaired_preference``: KTO examples, a prompt and one completion with a boolean ``label``
  (LLaMA-Factory's ``kto_tag``; `vela_ray.data.unpaired`), tokenised as TRL's KTOTrainer does;
  one row per example, labels on the completion only, each row's label in
  `TokenizedDataset.desirable` (batches carry it as ``desirable`` [B] bool). Data whose examples
  all carry one label is refused.

Records of every kind are read through the `datasets` library from JSON, JSONL, Parquet or
CSV files or a `save_to_disk` directory (`vela_ray.data.records`), with `DataConfig.columns`
mapping other field names, or named by a LLaMA-Factory ``dataset_info.json`` entry
(`vela_ray.data.dataset_info`). Fields vela-ray would not train on (images; KTO tags outside
kind unpaired_preference, preference pairs outside kind preference) are refused; a bad record refuses the file or, with
``data.on_bad_record: skip``, is left out and counted (`build_data` returns the count).
Their examples become rows one per row, right-padded, or packed several per row
(`DataConfig.packing`; see `vela_ray.data.examples` for both layouts and the
truncation policy).

Batches are dicts of ``input_ids``, ``labels`` and ``attention_mask`` (padded rows)
or ``position_ids`` (packed rows) LongTensors [B, S]: the model's keyword arguments (KTO
batches add ``desirable``, a BoolTensor [B], for the loss).
Training order is a pure function of ``(seed, step)`` so a run can resume from any
step: `batch_at` gives one batch, `iterate_batches` a stream from a start step;
`sequential_batches` walks the rows once in order (for profiling and evaluation).
Batch sizes count examples: a batch of B preference pairs is their 2B rows, each pair's
chosen row then its rejected row, never parted.
Usage::

    dataset = build_dataset(DataConfig(kind="text", path=Path("input.txt"), seq_len=128), tokenizer)
    train, held_out = dataset.split(eval_fraction=0.05, seed=0)
    for batch in iterate_batches(train, batch_size=8, seed=0, start_step=100, num_steps=200):
        ...
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from vela_ray.data.chat import (AlpacaExample, Message, alpaca_history, alpaca_to_messages, conversation_of,
                                encode_chat, tools_of)
from vela_ray.data.config import DataConfig
from vela_ray.data.examples import IGNORE_INDEX, Example, InstructExample, Truncation, packed_rows, padded_rows
from vela_ray.data.preference import encode_pairs, preference_rows, read_preference_pairs
from vela_ray.data.records import (RECORD_FORMATS, SAVED_DATASET_FILES, RecordCount, as_object, is_glob,
                                   load_records, shard_files, parse_each, refuse_unreadable_fields, warn_placeholders)
from vela_ray.data.tokenized import Batch, TokenizedDataset
from vela_ray.data.unpaired import encode_unpaired, read_unpaired_examples, refuse_one_label, unpaired_rows

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".text", ".raw", ".tokens")

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


# --- batching ------------------------------------------------------------------


def _check_batch_size(dataset: TokenizedDataset, batch_size: int) -> int:
    """Full batches of `batch_size` examples (preference pairs: pairs) in one epoch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    batches_per_epoch = dataset.num_examples // batch_size
    if batches_per_epoch == 0:
        what = f"{len(dataset)} rows" if dataset.group == 1 else \
            f"{dataset.num_examples} examples ({dataset.group} rows each)"
        raise ValueError(
            f"{dataset.source}: {what} cannot fill one batch of {batch_size}; "
            "lower batch_size or use more data"
        )
    return batches_per_epoch


def _epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def batch_rows(dataset: TokenizedDataset, step: int, batch_size: int, seed: int) -> np.ndarray:
    """The row indices of global `step`'s batch (0-based): full batches of `batch_size` examples of a fresh
    seeded shuffle per epoch, each example's rows adjacent (a preference pair: chosen, then rejected), so
    `batch_size * dataset.group` rows."""
    batches_per_epoch = _check_batch_size(dataset, batch_size)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    epoch, within = divmod(step, batches_per_epoch)
    order = _epoch_order(dataset.num_examples, seed, epoch)
    return dataset.example_rows(order[within * batch_size:(within + 1) * batch_size])


def batch_at(dataset: TokenizedDataset, step: int, batch_size: int, seed: int) -> Batch:
    """The training batch of global `step` (see `batch_rows`)."""
    return dataset.rows(batch_rows(dataset, step, batch_size, seed))


def iterate_batches(dataset: TokenizedDataset, batch_size: int, seed: int, start_step: int = 0,
                    num_steps: int | None = None) -> Iterator[Batch]:
    """Training batches for steps `start_step`, `start_step + 1`, ... (forever if `num_steps` is None).

    Step t yields exactly `batch_at(dataset, t, batch_size, seed)`, so resuming
    at `start_step` continues the same stream.
    """
    batches_per_epoch = _check_batch_size(dataset, batch_size)
    step, order_epoch, order = start_step, -1, None
    while num_steps is None or step < start_step + num_steps:
        epoch, within = divmod(step, batches_per_epoch)
        if epoch != order_epoch:
            order, order_epoch = _epoch_order(dataset.num_examples, seed, epoch), epoch
        yield dataset.rows(dataset.example_rows(order[within * batch_size:(within + 1) * batch_size]))
        step += 1


def sequential_batches(dataset: TokenizedDataset, batch_size: int, max_batches: int | None = None,
                       token_mask: bool = False) -> Iterator[Batch]:
    """The examples in order, once, in batches of `batch_size` examples (the last may be smaller; a preference
    pair's two rows adjacent); `token_mask` as in `TokenizedDataset.rows`."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    starts = range(0, dataset.num_examples, batch_size)
    for count, start in enumerate(starts):
        if max_batches is not None and count >= max_batches:
            return
        examples = list(range(start, min(start + batch_size, dataset.num_examples)))
        yield dataset.rows(dataset.example_rows(examples).tolist(), token_mask)


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """`batch` cut into consecutive micro-batches of `size` rows (the last may be smaller)."""
    rows = next(iter(batch.values())).shape[0]
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, rows, size)]


def on_device(batch: Batch, device: torch.device) -> Batch:
    """`batch` copied to `device` without waiting for the copy (the forward that reads it is queued after)."""
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


# --- plain text ------------------------------------------------------------------


def text_files(path: Path) -> list[Path]:
    """`path` itself if it is a text file, else the sorted ``.txt``-like files under the directory."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"{path}: directory holds no text files ({', '.join(TEXT_SUFFIXES)})")
        return files
    if not path.is_file():
        raise ValueError(f"{path}: no such file or directory")
    if path.suffix not in TEXT_SUFFIXES:
        raise ValueError(f"{path}: unknown text file type {path.suffix!r}; expected one of {TEXT_SUFFIXES}")
    return [path]


def _encode_text(tokenizer: PreTrainedTokenizerBase, text: str, max_tokens: int | None = None,
                 lines_per_call: int = 2000) -> list[int]:
    # line by line: fast tokenizers batch the lines in parallel, no call exceeds model_max_length,
    # and a `max_tokens` limit stops early
    lines = text.splitlines(keepends=True)
    ids: list[int] = []
    for start in range(0, len(lines), lines_per_call):
        for line_ids in tokenizer(lines[start:start + lines_per_call], add_special_tokens=False)["input_ids"]:
            ids.extend(line_ids)
        if max_tokens is not None and len(ids) >= max_tokens:
            return ids[:max_tokens]
    return ids


def pack_tokens(stream: list[int], seq_len: int, source: str, announce: bool = True) -> TokenizedDataset:
    """Cut a token stream into [N, seq_len] blocks (labels = input_ids); the short tail is dropped. `announce`:
    False logs the count at DEBUG (a second build of data the driver has already announced)."""
    if not stream:
        raise ValueError(f"{source}: 0 tokens: the file is empty; give it some text")
    num_blocks = len(stream) // seq_len
    if num_blocks == 0:
        raise ValueError(
            f"{source}: {len(stream)} tokens cannot fill one block of seq_len={seq_len}; "
            "use more text or a shorter seq_len"
        )
    ids = torch.tensor(stream[:num_blocks * seq_len], dtype=torch.long).view(num_blocks, seq_len)
    log.log(logging.INFO if announce else logging.DEBUG, "%s: %d tokens packed into %d blocks of %d", source,
            len(stream), num_blocks, seq_len)
    return TokenizedDataset(ids, ids.clone(), torch.ones_like(ids), source=source)


def pack_string(tokenizer: PreTrainedTokenizerBase, text: str, seq_len: int, source: str,
                max_blocks: int | None = None) -> TokenizedDataset:
    """Tokenise `text` and pack it into [N, seq_len] blocks (at most `max_blocks`)."""
    max_tokens = None if max_blocks is None else max_blocks * seq_len
    return pack_tokens(_encode_text(tokenizer, text, max_tokens), seq_len, source)


def pack_text(tokenizer: PreTrainedTokenizerBase, path: Path, seq_len: int,
              max_blocks: int | None = None, announce: bool = True) -> TokenizedDataset:
    """Tokenise the text file(s) at `path` (EOS between files) into [N, seq_len] blocks (at most `max_blocks`)."""
    max_tokens = None if max_blocks is None else max_blocks * seq_len
    stream: list[int] = []
    for file in text_files(path):
        if stream and tokenizer.eos_token_id is not None:
            stream.append(tokenizer.eos_token_id)
        remaining = None if max_tokens is None else max_tokens - len(stream)
        stream.extend(_encode_text(tokenizer, file.read_text(encoding="utf-8"), remaining))
        if max_tokens is not None and len(stream) >= max_tokens:
            break
    return pack_tokens(stream, seq_len, source=str(path), announce=announce)


# --- instruction data ----------------------------------------------------------------


def _string_field(record: dict, name: str, where: str, required: bool) -> str:
    value = record.get(name)
    if value is None:
        if required:
            raise ValueError(f"{where}: missing field {name!r}; every record needs 'instruction' and 'output' "
                             "(optional 'input')")
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {name!r} must be a string, got {type(value).__name__} {value!r:.60}")
    return value


def _parse_instances(record: dict, instruction: str, where: str) -> list[InstructExample]:
    instances = record["instances"]
    if not isinstance(instances, list) or not instances:
        raise ValueError(f"{where}: field 'instances' must be a non-empty list, got {instances!r:.60}")
    examples = []
    for i, instance in enumerate(instances):
        instance = as_object(instance, f"{where} instance {i}")
        examples.append(InstructExample(instruction, _string_field(instance, "input", f"{where} instance {i}", False),
                                        _string_field(instance, "output", f"{where} instance {i}", True)))
    return examples


def _parse_record(record: object, where: str) -> list[InstructExample]:
    """One Alpaca record's examples (`AlpacaExample` when it has a system prompt or history)."""
    record = as_object(record, where)
    instruction = _string_field(record, "instruction", where, required=True)
    if not instruction.strip():
        raise ValueError(f"{where}: field 'instruction' is empty")
    if record.get("instances") is not None and record.get("output") is None:  # datasets fills absent fields
        return _parse_instances(record, instruction, where)
    system, history = _string_field(record, "system", where, False), alpaca_history(record, where)
    example = InstructExample(instruction, _string_field(record, "input", where, False),
                              _string_field(record, "output", where, True))
    if system or history:
        example = AlpacaExample(example.instruction, example.input, example.output, system, history)
    return [example]


def read_instruct_examples(path: Path, limit: int | None = None, columns: dict[str, str] | None = None,
                           on_bad_record: str = "error",
                           warn: bool = True) -> tuple[list[InstructExample], RecordCount]:
    """Examples from an Alpaca-style records file (`vela_ray.data.records` formats; seed-task `instances`
    are expanded in order; LLaMA-Factory's `system` and `history` columns kept) and the count of records
    read and skipped (`on_bad_record`: data.on_bad_record). `columns` maps field names to the file's own;
    `warn`: False logs the warnings about skipped records and placeholders at INFO."""
    records = load_records(path, columns, limit)
    refuse_unreadable_fields(records, path)
    with_tools = next((i for i, r in enumerate(records) if r.get("tools") not in (None, "", [])), None)
    if with_tools is not None:
        raise ValueError(f"{path}: record {with_tools}: field 'tools': the Alpaca prompt of data.kind instruct "
                         "cannot show tools; read the records as data.kind chat (rendered with the chat template, "
                         "tools included)")
    per_record, count = parse_each(records, _parse_record, path, on_bad_record, warn)
    examples = [example for found in per_record for example in found]
    if not examples:
        raise ValueError(f"{path}: holds no instruction records; add records with 'instruction' and 'output'")
    warn_placeholders(records, path, warn)
    return examples[:limit] if limit is not None else examples, count


def load_instruct_examples(path: Path, limit: int | None = None,
                           columns: dict[str, str] | None = None) -> list[InstructExample]:
    """The examples of `read_instruct_examples`, a bad record refusing the file."""
    return read_instruct_examples(path, limit, columns)[0]


def _preamble(example: InstructExample) -> str:
    """What the prompt opens with: the system prompt, else the Alpaca preamble (which says whether an input
    follows)."""
    system = example.system if isinstance(example, AlpacaExample) else ""
    if system:
        return system + "\n\n"
    template = ALPACA_PROMPT_WITH_INPUT if example.input.strip() else ALPACA_PROMPT
    return template[:template.index("### Instruction:")]


def _turn(instruction: str, input: str = "") -> str:
    if input.strip():
        return f"### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    return f"### Instruction:\n{instruction}\n\n### Response:\n"


def render_prompt(example: InstructExample) -> str:
    """The fixed Alpaca prompt for `example`'s last turn (everything the model reads before the response
    when it has no history): the system prompt (else the Alpaca preamble), then the instruction and input."""
    return _preamble(example) + _turn(example.instruction, example.input)


def _pieces(example: InstructExample) -> list[tuple[str, str]]:
    """(prompt, response) per turn, as LLaMA-Factory's alpaca template lays history out: each earlier
    turn's response is closed by EOS and a blank line, then the next turn's instruction follows."""
    history = example.history if isinstance(example, AlpacaExample) else ()
    prompts = [_turn(query) for query, _ in history] + [_turn(example.instruction, example.input)]
    responses = [response for _, response in history] + [example.output]
    prompts = [_preamble(example) + prompts[0]] + ["\n\n" + prompt for prompt in prompts[1:]]
    return list(zip(prompts, responses))


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"{type(tokenizer).__name__} has neither a pad nor an eos token; set tokenizer.pad_token")
    return pad


def instruct_examples(tokenizer: PreTrainedTokenizerBase, examples: list[InstructExample]) -> list[Example]:
    """[BOS] prompt response [EOS] token ids of each example (with history: one prompt, response, EOS per
    turn); the responses and their EOS are the labels, every turn's as in LLaMA-Factory (prompts are not)."""
    turns = [_pieces(e) for e in examples]
    flat = [text for pieces in turns for piece in pieces for text in piece]
    ids = iter(tokenizer(flat, add_special_tokens=False)["input_ids"]) if flat else iter(())
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for pieces in turns:
        input_ids, labels = list(bos), [IGNORE_INDEX] * len(bos)
        for _ in pieces:
            prompt, response = next(ids), next(ids)
            input_ids += prompt + response + eos
            labels += [IGNORE_INDEX] * len(prompt) + response + eos
        out.append(Example(input_ids, labels))
    return out


def lay_out(tokenizer: PreTrainedTokenizerBase, examples: list[Example], seq_len: int, packing: bool,
            source: str, *, truncation: Truncation = "right", warn: bool = True,
            skipped: Mapping[str, int] | None = None) -> TokenizedDataset:
    """Rows of `seq_len` tokens: packed several to a row, or one per row padded, with the counts of what was
    kept, truncated and dropped (`vela_ray.data.examples`; `skipped`: records left out before tokenisation, by
    reason; `warn`: False where this data was built, and warned about, before)."""
    rows = packed_rows if packing else padded_rows
    return rows(examples, seq_len, _pad_id(tokenizer), source, truncation=truncation, warn=warn, skipped=skipped)


def load_instruct(tokenizer: PreTrainedTokenizerBase, path: Path, seq_len: int,
                  limit: int | None = None, packing: bool = False) -> TokenizedDataset:
    """Tokenised instruction data set from an Alpaca-style records file."""
    examples = instruct_examples(tokenizer, load_instruct_examples(path, limit))
    return lay_out(tokenizer, examples, seq_len, packing, source=str(path))


# --- config ------------------------------------------------------------------------------


BAD_RECORD = "bad record (data.on_bad_record: skip)"
"""The `DataStats.dropped` reason of the records `parse_each` skipped."""


@dataclass(frozen=True)
class BuiltData:
    """A data set and how many records it was read from (`RecordCount.skipped`: data.on_bad_record: skip)."""

    dataset: TokenizedDataset
    records: RecordCount


def build_data(config: DataConfig, tokenizer: PreTrainedTokenizerBase, *, warn: bool = True) -> BuiltData:
    """The data set `config` names, tokenised with `tokenizer`, with its record count. `warn`: False for a second
    build of the same data (the master's, after the driver's preflight warned): a warning about dropped or
    truncated examples is then logged at INFO, and the blocks a text corpus packed into at DEBUG."""
    if config.kind == "text":
        if config.records is None and not is_records_path(config.path):
            files = text_files(config.path)
            return BuiltData(pack_text(tokenizer, config.path, config.seq_len, max_blocks=config.limit,
                                       announce=warn), RecordCount(len(files)))
        return _text_records(config, tokenizer, warn)
    if config.kind == "preference":
        return _preference_data(config, tokenizer, warn)
    if config.kind == "unpaired_preference":
        return _unpaired_data(config, tokenizer, warn)
    if config.kind == "instruct":
        parsed, count = read_instruct_examples(_source(config), config.limit, config.columns,
                                               config.on_bad_record, warn)
        examples = instruct_examples(tokenizer, parsed)
    else:
        examples, count = _chat_examples(config, tokenizer, warn)
    skipped = {BAD_RECORD: count.skipped} if count.skipped else None
    return BuiltData(lay_out(tokenizer, examples, config.seq_len, config.packing, source=str(config.path),
                             truncation=config.truncation, warn=warn, skipped=skipped), count)


def _preference_data(config: DataConfig, tokenizer: PreTrainedTokenizerBase, warn: bool) -> BuiltData:
    """kind preference: two rows per pair (chosen, rejected; `TokenizedDataset.group` 2), tokenised as TRL's
    DPOTrainer tokenises them (`vela_ray.data.preference`)."""
    pairs, count = read_preference_pairs(_source(config), config.columns, config.tags, config.limit,
                                         config.on_bad_record, warn)
    encoded = encode_pairs(tokenizer, pairs, config.chat_template, source=str(config.path))
    skipped = {BAD_RECORD: count.skipped} if count.skipped else None
    return BuiltData(preference_rows(encoded, config.seq_len, _pad_id(tokenizer), str(config.path), warn=warn,
                                     skipped=skipped), count)


def _unpaired_data(config: DataConfig, tokenizer: PreTrainedTokenizerBase, warn: bool) -> BuiltData:
    """kind unpaired_preference: one row per example, tokenised as TRL's KTOTrainer tokenises it, each row's label
    in `TokenizedDataset.desirable` (`vela_ray.data.unpaired`); refused before tokenising when every example
    carries the same label."""
    examples, count = read_unpaired_examples(_source(config), config.columns, config.tags, config.limit,
                                             config.on_bad_record, warn)
    refuse_one_label([example.desirable for example in examples], config.source, config.limit)
    encoded = encode_unpaired(tokenizer, examples, config.chat_template, source=str(config.path))
    skipped = {BAD_RECORD: count.skipped} if count.skipped else None
    return BuiltData(unpaired_rows(encoded, config.seq_len, _pad_id(tokenizer), str(config.path), warn=warn,
                                   skipped=skipped), count)


def build_dataset(config: DataConfig, tokenizer: PreTrainedTokenizerBase, *, warn: bool = True) -> TokenizedDataset:
    """The data set `config` names, tokenised with `tokenizer` (`build_data` also counts its records; `warn` as
    it takes it)."""
    return build_data(config, tokenizer, warn=warn).dataset


def _source(config: DataConfig):
    """Where the records are read from: the job's `ray.data.Dataset`, else `data.path`."""
    if config.records is not None:
        return config.records
    if config.path is None:
        raise ValueError("data.path is missing; give a data file, directory or glob (or, in Python, a "
                         "ray.data.Dataset: JobConfig.with_dataset)")
    return config.path


def is_records_path(path: Path) -> bool:
    """A file, directory or glob of records (`vela_ray.data.records`) rather than plain text."""
    if path.is_dir() and any((path / name).is_file() for name in SAVED_DATASET_FILES):
        return True
    if is_glob(path) or path.is_dir():
        return shard_files(path) is not None  # a directory of .txt files is text
    return path.suffix.lower() in RECORD_FORMATS


def _text_records(config: DataConfig, tokenizer: PreTrainedTokenizerBase, warn: bool) -> BuiltData:
    """kind text from records: each record's `text` (data.columns.text maps another column), EOS between
    records, packed into blocks."""
    records = load_records(_source(config), config.columns)

    def text_of(record: dict, where: str) -> str:
        if record.get("text") is None:
            raise ValueError(f"{where}: missing field 'text'; text records need one (or map yours with "
                             "data.columns: {text: COLUMN})")
        if not isinstance(record["text"], str):
            raise ValueError(f"{where}: field 'text' must be a string, got {type(record['text']).__name__}")
        return record["text"]

    texts, count = parse_each(records, text_of, config.path, config.on_bad_record, warn)
    if not texts:
        raise ValueError(f"{config.path}: holds no records; add records with a 'text' field")
    max_tokens = None if config.limit is None else config.limit * config.seq_len
    stream: list[int] = []
    for text in texts:
        if stream and tokenizer.eos_token_id is not None:
            stream.append(tokenizer.eos_token_id)
        remaining = None if max_tokens is None else max_tokens - len(stream)
        stream.extend(_encode_text(tokenizer, text, remaining))
        if max_tokens is not None and len(stream) >= max_tokens:
            break
    return BuiltData(pack_tokens(stream, config.seq_len, source=str(config.path), announce=warn), count)


def _conversation(record: dict, where: str, tags: dict[str, str]) -> list[tuple[list[Message], list[dict] | None]]:
    """A chat record's conversations with their tools: its messages, or an Alpaca record's turns (system
    and history included) as user/assistant messages."""
    if all(record.get(field) is None for field in ("messages", "conversations")) and \
            record.get("instruction") is not None:
        return [(alpaca_to_messages(e), tools_of(record, where)) for e in _parse_record(record, where)]
    return [(conversation_of(record, where, tags), tools_of(record, where))]


def _chat_examples(config: DataConfig, tokenizer: PreTrainedTokenizerBase,
                   warn: bool) -> tuple[list[Example], RecordCount]:
    records = load_records(_source(config), config.columns, config.limit)
    if not records:
        raise ValueError(f"{config.path}: holds no chat records; add records with 'messages' or 'conversations'")
    refuse_unreadable_fields(records, config.path)
    parsed, count = parse_each(records, lambda r, where: _conversation(r, where, config.tags), config.path,
                               config.on_bad_record, warn)
    warn_placeholders(records, config.path, warn)
    pairs = [pair for found in parsed for pair in found]
    examples = encode_chat(tokenizer, [c for c, _ in pairs], config.chat_template, source=str(config.path),
                           tools=[t for _, t in pairs])
    return examples, count
