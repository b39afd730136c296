"""Fine-tuning data: packed plain-text corpora, Alpaca-style instructions and chat conversations.

Three kinds of data set, all tokenised with any Hugging Face tokenizer into a
`TokenizedDataset` of fixed-length rows (N = rows, S = `seq_len`):

* ``text``: one text file or a directory of ``.txt`` files, tokenised and packed
  into consecutive blocks of S tokens (files are separated by the EOS token;
  the tail that does not fill a block is dropped); ``labels = input_ids``.
* ``instruct``: records with ``instruction``, optional ``input`` and ``output`` (or
  the Alpaca seed-task layout, where each record holds ``instances: [{input,
  output}]``), rendered with the fixed `ALPACA_PROMPT` template; prompt tokens are
  masked out of the loss (label -100).
* ``chat``: conversations (`vela_ray.data.chat`) rendered with the tokenizer's chat
  template; only assistant turns are labels.

Records of instruct and chat data are read through the `datasets` library from
JSON, JSONL, Parquet or CSV files or a `save_to_disk` directory
(`vela_ray.data.records`), with `DataConfig.columns` mapping other field names.
Their examples become rows one per row, right-padded, or packed several per row
(`DataConfig.packing`; see `vela_ray.data.examples` for both layouts and the
truncation policy).

Batches are dicts of ``input_ids``, ``labels`` and ``attention_mask`` (padded rows)
or ``position_ids`` (packed rows) LongTensors [B, S]: the model's keyword arguments.
Training order is a pure function of ``(seed, step)`` so a run can resume from any
step: `batch_at` gives one batch, `iterate_batches` a stream from a start step;
`sequential_batches` walks the rows once in order (for profiling and evaluation).
Usage::

    dataset = build_dataset(DataConfig(kind="text", path=Path("input.txt"), seq_len=128), tokenizer)
    train, held_out = dataset.split(eval_fraction=0.05, seed=0)
    for batch in iterate_batches(train, batch_size=8, seed=0, start_step=100, num_steps=200):
        ...
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from vela_ray.data.chat import conversation_of, encode_chat
from vela_ray.data.config import DataConfig
from vela_ray.data.examples import IGNORE_INDEX, Example, InstructExample, packed_rows, padded_rows
from vela_ray.data.records import as_object, load_records
from vela_ray.data.tokenized import Batch, TokenizedDataset

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
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    batches_per_epoch = len(dataset) // batch_size
    if batches_per_epoch == 0:
        raise ValueError(
            f"{dataset.source}: {len(dataset)} rows cannot fill one batch of {batch_size}; "
            "lower batch_size or use more data"
        )
    return batches_per_epoch


def _epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def batch_rows(dataset: TokenizedDataset, step: int, batch_size: int, seed: int) -> np.ndarray:
    """The row indices of global `step`'s batch (0-based): full batches of a fresh seeded shuffle per epoch."""
    batches_per_epoch = _check_batch_size(dataset, batch_size)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    epoch, within = divmod(step, batches_per_epoch)
    order = _epoch_order(len(dataset), seed, epoch)
    return order[within * batch_size:(within + 1) * batch_size]


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
            order, order_epoch = _epoch_order(len(dataset), seed, epoch), epoch
        yield dataset.rows(order[within * batch_size:(within + 1) * batch_size])
        step += 1


def sequential_batches(dataset: TokenizedDataset, batch_size: int, max_batches: int | None = None,
                       token_mask: bool = False) -> Iterator[Batch]:
    """The rows in order, once, in batches of `batch_size` (the last may be smaller); `token_mask` as in
    `TokenizedDataset.rows`."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    starts = range(0, len(dataset), batch_size)
    for count, start in enumerate(starts):
        if max_batches is not None and count >= max_batches:
            return
        yield dataset.rows(list(range(start, min(start + batch_size, len(dataset)))), token_mask)


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """`batch` cut into consecutive micro-batches of `size` rows (the last may be smaller)."""
    rows = next(iter(batch.values())).shape[0]
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, rows, size)]


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


def pack_tokens(stream: list[int], seq_len: int, source: str) -> TokenizedDataset:
    """Cut a token stream into [N, seq_len] blocks (labels = input_ids); the short tail is dropped."""
    if not stream:
        raise ValueError(f"{source}: 0 tokens: the file is empty; give it some text")
    num_blocks = len(stream) // seq_len
    if num_blocks == 0:
        raise ValueError(
            f"{source}: {len(stream)} tokens cannot fill one block of seq_len={seq_len}; "
            "use more text or a shorter seq_len"
        )
    ids = torch.tensor(stream[:num_blocks * seq_len], dtype=torch.long).view(num_blocks, seq_len)
    log.info("%s: %d tokens packed into %d blocks of %d", source, len(stream), num_blocks, seq_len)
    return TokenizedDataset(ids, ids.clone(), torch.ones_like(ids), source=source)


def pack_string(tokenizer: PreTrainedTokenizerBase, text: str, seq_len: int, source: str,
                max_blocks: int | None = None) -> TokenizedDataset:
    """Tokenise `text` and pack it into [N, seq_len] blocks (at most `max_blocks`)."""
    max_tokens = None if max_blocks is None else max_blocks * seq_len
    return pack_tokens(_encode_text(tokenizer, text, max_tokens), seq_len, source)


def pack_text(tokenizer: PreTrainedTokenizerBase, path: Path, seq_len: int,
              max_blocks: int | None = None) -> TokenizedDataset:
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
    return pack_tokens(stream, seq_len, source=str(path))


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
    record = as_object(record, where)
    instruction = _string_field(record, "instruction", where, required=True)
    if not instruction.strip():
        raise ValueError(f"{where}: field 'instruction' is empty")
    if record.get("instances") is not None and record.get("output") is None:  # datasets fills absent fields
        return _parse_instances(record, instruction, where)
    return [InstructExample(instruction, _string_field(record, "input", where, False),
                            _string_field(record, "output", where, True))]


def load_instruct_examples(path: Path, limit: int | None = None,
                           columns: dict[str, str] | None = None) -> list[InstructExample]:
    """Examples from an Alpaca-style records file (`vela_ray.data.records` formats; seed-task `instances`
    are expanded in order). `columns` maps instruction/input/output to the file's own column names."""
    examples: list[InstructExample] = []
    for index, record in enumerate(load_records(path, columns, limit)):
        examples.extend(_parse_record(record, f"{path}: record {index}"))
        if limit is not None and len(examples) >= limit:
            return examples[:limit]
    if not examples:
        raise ValueError(f"{path}: holds no instruction records; add records with 'instruction' and 'output'")
    return examples


def render_prompt(example: InstructExample) -> str:
    """The fixed Alpaca prompt for `example` (everything the model reads before the response)."""
    if example.input.strip():
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=example.instruction, input=example.input)
    return ALPACA_PROMPT.format(instruction=example.instruction)


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"{type(tokenizer).__name__} has neither a pad nor an eos token; set tokenizer.pad_token")
    return pad


def instruct_examples(tokenizer: PreTrainedTokenizerBase, examples: list[InstructExample]) -> list[Example]:
    """[BOS] prompt response [EOS] token ids of each example; only the response and EOS are labels."""
    prompts = tokenizer([render_prompt(e) for e in examples], add_special_tokens=False)["input_ids"]
    responses = tokenizer([e.output for e in examples], add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [Example(bos + prompt + response + eos, [IGNORE_INDEX] * (len(bos) + len(prompt)) + response + eos)
            for prompt, response in zip(prompts, responses)]


def lay_out(tokenizer: PreTrainedTokenizerBase, examples: list[Example], seq_len: int, packing: bool,
            source: str) -> TokenizedDataset:
    """Rows of `seq_len` tokens: packed several to a row, or one per row padded (`vela_ray.data.examples`)."""
    rows = packed_rows if packing else padded_rows
    return rows(examples, seq_len, _pad_id(tokenizer), source)


def load_instruct(tokenizer: PreTrainedTokenizerBase, path: Path, seq_len: int,
                  limit: int | None = None, packing: bool = False) -> TokenizedDataset:
    """Tokenised instruction data set from an Alpaca-style records file."""
    examples = instruct_examples(tokenizer, load_instruct_examples(path, limit))
    return lay_out(tokenizer, examples, seq_len, packing, source=str(path))


# --- config ------------------------------------------------------------------------------


def build_dataset(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> TokenizedDataset:
    """The data set `config` names, tokenised with `tokenizer`."""
    if config.kind == "text":
        return pack_text(tokenizer, config.path, config.seq_len, max_blocks=config.limit)
    if config.kind == "instruct":
        examples = instruct_examples(tokenizer, load_instruct_examples(config.path, config.limit, config.columns))
    else:
        examples = _chat_examples(config, tokenizer)
    return lay_out(tokenizer, examples, config.seq_len, config.packing, source=str(config.path))


def _chat_examples(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> list[Example]:
    records = load_records(config.path, config.columns, config.limit)
    if not records:
        raise ValueError(f"{config.path}: holds no chat records; add records with 'messages' or 'conversations'")
    conversations = [conversation_of(r, f"{config.path}: record {i}") for i, r in enumerate(records)]
    return encode_chat(tokenizer, conversations, config.chat_template, source=str(config.path))
