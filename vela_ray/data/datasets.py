"""Fine-tuning data: packed plain-text corpora and Alpaca-style instruction sets.

Two kinds of data set, both tokenised with any Hugging Face tokenizer into a
`TokenizedDataset` of fixed-length rows (N = rows, S = `seq_len`):

* ``text``: one text file or a directory of ``.txt`` files, tokenised and packed
  into consecutive blocks of S tokens (files are separated by the EOS token;
  the tail that does not fill a block is dropped); ``labels = input_ids``.
* ``instruct``: a JSON list or JSONL file of records with ``instruction``,
  optional ``input`` and ``output`` (or the Alpaca seed-task layout, where each
  record holds ``instances: [{input, output}]``). Each example is rendered with
  the fixed `ALPACA_PROMPT` template, prompt tokens are masked out of the loss
  (label -100), and rows are truncated or right-padded to S with padding masked
  out of both the loss and the attention.

Batches are dicts of ``input_ids``, ``labels``, ``attention_mask`` LongTensors
[B, S]. Training order is a pure function of ``(seed, step)`` so a run can resume
from any step: `batch_at` gives one batch, `iterate_batches` a stream from a
start step; `sequential_batches` walks the rows once in order (for profiling
and evaluation). Usage::

    dataset = DataConfig(kind="text", path=Path("input.txt"), seq_len=128).build(tokenizer)
    train, held_out = dataset.split(eval_fraction=0.05, seed=0)
    for batch in iterate_batches(train, batch_size=8, seed=0, start_step=100, num_steps=200):
        ...
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:  # torch and transformers load inside the functions: `vela_ray.config` imports
    import torch   # DataConfig, and a config typo must be reported without paying their import
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

Batch = dict[str, "torch.Tensor"]
IGNORE_INDEX = -100
TEXT_SUFFIXES = (".txt", ".text", ".raw", ".tokens")
INSTRUCT_SUFFIXES = (".json", ".jsonl")

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


# --- the tokenised data set ----------------------------------------------------


@dataclass(frozen=True)
class TokenizedDataset:
    """N fixed-length rows: `input_ids`, `labels`, `attention_mask`, each a LongTensor [N, S]."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    source: str

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens in the whole data set."""
        return int(self.attention_mask.sum())

    def rows(self, index: torch.Tensor | np.ndarray | list[int]) -> Batch:
        import torch

        index = torch.as_tensor(index, dtype=torch.long)
        return {"input_ids": self.input_ids[index], "labels": self.labels[index],
                "attention_mask": self.attention_mask[index]}

    def subset(self, index: torch.Tensor | np.ndarray | list[int], source: str) -> TokenizedDataset:
        return TokenizedDataset(**self.rows(index), source=source)

    def split(self, eval_fraction: float, seed: int) -> tuple[TokenizedDataset, TokenizedDataset]:
        """(train, eval): a seeded random `eval_fraction` of the rows is held out; both must be non-empty."""
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        num_eval = int(round(len(self) * eval_fraction))
        if num_eval == 0 or num_eval == len(self):
            raise ValueError(
                f"{self.source}: eval_fraction {eval_fraction} of {len(self)} rows leaves an empty "
                "train or eval set; use more data or another fraction"
            )
        order = np.random.default_rng([seed, 0xE7A1]).permutation(len(self))
        eval_rows, train_rows = np.sort(order[:num_eval]), np.sort(order[num_eval:])
        return (self.subset(train_rows, f"{self.source} [train]"),
                self.subset(eval_rows, f"{self.source} [eval]"))


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


def batch_at(dataset: TokenizedDataset, step: int, batch_size: int, seed: int) -> Batch:
    """The training batch of global `step` (0-based): full batches of a fresh seeded shuffle per epoch."""
    batches_per_epoch = _check_batch_size(dataset, batch_size)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    epoch, within = divmod(step, batches_per_epoch)
    order = _epoch_order(len(dataset), seed, epoch)
    return dataset.rows(order[within * batch_size:(within + 1) * batch_size])


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


def sequential_batches(dataset: TokenizedDataset, batch_size: int,
                       max_batches: int | None = None) -> Iterator[Batch]:
    """The rows in order, once, in batches of `batch_size` (the last may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    starts = range(0, len(dataset), batch_size)
    for count, start in enumerate(starts):
        if max_batches is not None and count >= max_batches:
            return
        yield dataset.rows(list(range(start, min(start + batch_size, len(dataset)))))


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
    import torch

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


@dataclass(frozen=True)
class InstructExample:
    """One instruction-following example (Alpaca fields)."""

    instruction: str
    input: str
    output: str


def _as_object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


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
        instance = _as_object(instance, f"{where} instance {i}")
        examples.append(InstructExample(instruction, _string_field(instance, "input", f"{where} instance {i}", False),
                                        _string_field(instance, "output", f"{where} instance {i}", True)))
    return examples


def _parse_record(record: object, where: str) -> list[InstructExample]:
    record = _as_object(record, where)
    instruction = _string_field(record, "instruction", where, required=True)
    if not instruction.strip():
        raise ValueError(f"{where}: field 'instruction' is empty")
    if "instances" in record and "output" not in record:
        return _parse_instances(record, instruction, where)
    return [InstructExample(instruction, _string_field(record, "input", where, False),
                            _string_field(record, "output", where, True))]


def _raw_records(path: Path) -> list[object]:
    """The file's records, unparsed; errors name the file and the line, as a user fixes it in an editor."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if path.suffix not in INSTRUCT_SUFFIXES:
        raise ValueError(f"{path}: unknown instruction file type {path.suffix!r}; expected one of "
                         f"{INSTRUCT_SUFFIXES}")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{path}: the file is empty; expected "
                         + ("a JSON list of records" if path.suffix == ".json" else "one JSON record per line"))
    return _json_list(path, text) if path.suffix == ".json" else _jsonl_records(path, text)


def _json_list(path: Path, text: str) -> list[object]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: line {err.lineno} column {err.colno}: not valid JSON ({err.msg})") from None
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of records [{{...}}, ...], got a {type(records).__name__}")
    return records


def _jsonl_records(path: Path, text: str) -> list[object]:
    records = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {line_no}: record {len(records)} is not valid JSON "
                                 f"({err.msg})") from None
    return records


def load_instruct_examples(path: Path, limit: int | None = None) -> list[InstructExample]:
    """Examples from an Alpaca JSON list / JSONL file (seed-task `instances` are expanded in order)."""
    examples: list[InstructExample] = []
    for index, record in enumerate(_raw_records(path)):
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


def encode_instruct(tokenizer: PreTrainedTokenizerBase, examples: list[InstructExample], seq_len: int,
                    source: str) -> TokenizedDataset:
    """[BOS] prompt response [EOS], truncated / right-padded to `seq_len`; prompt and pad labels are -100."""
    import torch

    prompts = tokenizer([render_prompt(e) for e in examples], add_special_tokens=False)["input_ids"]
    responses = tokenizer([e.output for e in examples], add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    shape = (len(examples), seq_len)
    input_ids = torch.full(shape, _pad_id(tokenizer), dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        prompt, response = (bos + prompt)[:seq_len], (response + eos)[:max(seq_len - len(bos) - len(prompt), 0)]
        length = len(prompt) + len(response)
        input_ids[row, :length] = torch.tensor(prompt + response, dtype=torch.long)
        labels[row, len(prompt):length] = torch.tensor(response, dtype=torch.long)
        attention_mask[row, :length] = 1
    unsupervised = int((labels == IGNORE_INDEX).all(dim=1).sum())
    if unsupervised:
        log.warning("%s: %d of %d examples have no response token left within seq_len=%d",
                    source, unsupervised, len(examples), seq_len)
    return TokenizedDataset(input_ids, labels, attention_mask, source=source)


def load_instruct(tokenizer: PreTrainedTokenizerBase, path: Path, seq_len: int,
                  limit: int | None = None) -> TokenizedDataset:
    """Tokenised instruction data set from an Alpaca JSON / JSONL file."""
    return encode_instruct(tokenizer, load_instruct_examples(path, limit), seq_len, source=str(path))


# --- config ------------------------------------------------------------------------------


class DataConfig(BaseModel):
    """Which data set to fine-tune or profile on, and how to cut it into rows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["text", "instruct"]
    """``text``: packed LM corpus; ``instruct``: Alpaca-style instruction records."""
    path: Path
    """A text file or directory of ``.txt`` files (text), or a ``.json`` / ``.jsonl`` file (instruct)."""
    seq_len: int = Field(default=256, ge=2)
    """Tokens per row."""
    limit: int | None = Field(default=None, ge=1)
    """Keep at most this many rows (text blocks or instruction examples), in file order."""

    @field_validator("path")
    @classmethod
    def _path_exists(cls, path: Path) -> Path:
        if not path.exists():
            raise ValueError(f"data path {path} does not exist")
        return path

    def build(self, tokenizer: PreTrainedTokenizerBase) -> TokenizedDataset:
        """Tokenise the data set with `tokenizer`."""
        if self.kind == "instruct":
            return load_instruct(tokenizer, self.path, self.seq_len, self.limit)
        return pack_text(tokenizer, self.path, self.seq_len, max_blocks=self.limit)
