"""`DataConfig`: the `data:` section of a job, which data set and how to cut it into rows. Pure pydantic:
`vela_ray.config` reads it without torch or transformers; `datasets.build_dataset` builds what it names."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from vela_ray.data.dataset_info import KTO_TAG, TAG_NAMES, dataset_info_file, is_llama_factory_dir, read_entry
from vela_ray.data.records import UNREADABLE_FIELDS, is_glob
from vela_ray.paths import UserPath

COLUMNS = {  # data.kind -> the fields `data.columns` may map onto a file's own column names
    "text": ("text",),
    "instruct": ("instruction", "input", "output", "instances", "system", "history"),
    "chat": ("messages", "conversations", "system", "tools", "instruction", "input", "output", "history"),
    "preference": ("messages", "conversations", "prompt", "system", "tools", "instruction", "input", "history",
                   "chosen", "rejected"),
    "unpaired_preference": ("messages", "conversations", "prompt", "completion", "system", "tools", "instruction",
                            "input", "output", "history", "label", KTO_TAG),
}
TEMPLATED_KINDS = ("chat", "preference", "unpaired_preference")
"""The kinds rendered with a chat template: `data.chat_template` and `data.tags` apply to them."""
KEEP_START_KINDS = {"preference": "each pair is its chosen and its rejected sequence in two padded rows, as TRL's "
                                  "DPOTrainer lays them",
                    "unpaired_preference": "each example is its prompt + completion in one padded row, as TRL's "
                                           "KTOTrainer lays it"}
"""The kinds laid out as TRL's preference trainers lay them (`vela_ray.data.preference.keep_start_rows`): neither
data.packing nor data.truncation keep_answer applies; how each lays its rows out."""


class DataConfig(BaseModel):
    """Which data set to fine-tune or profile on, and how to cut it into rows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["text", "instruct", "chat", "preference", "unpaired_preference"]
    """``text``: packed LM corpus; ``instruct``: Alpaca-style instruction records; ``chat``: conversations
    (``messages`` of role/content, or ShareGPT ``conversations`` of from/value) rendered with the chat template;
    ``preference``: DPO pairs, a prompt (``messages``, ``conversations``, TRL's ``prompt``, or Alpaca
    ``instruction``/``input``) with a ``chosen`` and a ``rejected`` answer, rendered with the chat template and
    tokenised as TRL's DPOTrainer does, two rows per pair (`vela_ray.data.preference`); ``unpaired_preference``:
    KTO examples, a prompt and one completion (ShareGPT ``messages``/``conversations`` whose last turn is the
    assistant's completion, TRL's ``prompt`` + ``completion``, or Alpaca ``instruction``/``input`` + ``output``)
    with a boolean ``label`` (LLaMA-Factory's ``kto_tag``; true: desirable), tokenised as TRL's KTOTrainer does, one
    row per example (`vela_ray.data.unpaired`). Given `dataset_info`, it defaults to what the entry reads as
    (preference for a ``ranking: true`` entry, unpaired_preference for one with a ``kto_tag`` column)."""
    path: UserPath | None = None
    """A text file or directory of ``.txt`` files (text), or for any kind a ``.json``, ``.jsonl``, ``.parquet``
    or ``.csv`` file of records (text: a ``text`` column), a directory written by ``Dataset.save_to_disk``, or
    a directory or glob (``shards/*.jsonl``) of JSONL/Parquet shards, read through Ray Data when a Ray cluster
    is attached. Filled in from `dataset_info` when that is given. None only for a job given a
    ``ray.data.Dataset`` in Python (`with_records`)."""
    seq_len: int = Field(default=256, ge=2)
    """Tokens per row."""
    limit: int | None = Field(default=None, ge=1)
    """Keep at most this many rows (text blocks), examples (instruct, chat, unpaired_preference) or pairs
    (preference), in file order."""
    columns: dict[str, str] = Field(default_factory=dict)
    """The file's column for a field vela-ray reads, e.g. ``{instruction: question, output: answer}``,
    ``{messages: dialog}``, (text records) ``{text: content}`` or (unpaired_preference) ``{label: good}``
    (``kto_tag``, LLaMA-Factory's name, reads as ``label``)."""
    chat_template: str | None = None
    """chat, preference and unpaired_preference: a Jinja chat template, as a file path or the template itself
    (default: the tokenizer's own)."""
    dataset_info: UserPath | None = None
    """A LLaMA-Factory ``dataset_info.json`` (or the directory holding it): `name`'s entry sets `path`,
    `columns`, `tags` and, if not given, `kind` (`vela_ray.data.dataset_info`). A `path` that is a directory
    holding a LLaMA-Factory ``dataset_info.json`` reads the same way."""
    name: str | None = None
    """The `dataset_info` entry to read."""
    tags: dict[str, str] = Field(default_factory=dict)
    """chat, preference and unpaired_preference: LLaMA-Factory's ShareGPT tags (``role_tag``, ``content_tag``,
    ``user_tag``, ``assistant_tag``, ``observation_tag``, ``function_tag``, ``system_tag``): the message keys and
    role values of the file."""
    on_bad_record: Literal["error", "skip"] = "error"
    """Records (instruct, chat, preference, unpaired_preference, text records): ``error`` refuses the data at the
    first record that cannot be read; ``skip`` leaves such records out and names them in one warning
    (`datasets.build_data` counts them)."""
    packing: bool = False
    """instruct and chat: lay several examples end to end in each row instead of padding one per row; attention
    and loss stay within each example (refused for models where they would not, see `examples.check_packing`).
    Not for preference (each pair is two padded rows, as TRL's DPOTrainer pads them) nor unpaired_preference (one
    padded row per example, as TRL's KTOTrainer pads them)."""
    truncation: Literal["right", "keep_answer"] = "right"
    """instruct and chat: how an example longer than `seq_len` is cut (before packing). ``right``: its first
    `seq_len` tokens. ``keep_answer``: its answer (the last assistant turn: from the first label of the last run
    of labels to the end) whole, after the prompt cut in the middle to the B = seq_len - answer tokens left (the
    prompt's first ceil(B/2) and last floor(B/2) tokens: the task's head, and the assistant header before the
    answer); an answer longer than seq_len - min(prompt, seq_len // 2) tokens gets B = min(prompt, seq_len // 2)
    and is itself cut on the right. Either way an example left with no label is dropped; the run's summary counts
    both (`vela_ray.data.examples`). preference and unpaired_preference: ``right`` only, each sequence's first
    `seq_len` tokens (TRL's keep_start), a pair or example whose prompt alone fills `seq_len` dropped
    (`vela_ray.data.preference`)."""

    @model_validator(mode="before")
    @classmethod
    def _read_dataset_info(cls, data: object) -> object:
        """Fill `path`, `columns`, `tags` and `kind` from a LLaMA-Factory dataset_info.json entry."""
        if not isinstance(data, dict):
            return data
        info, path = data.get("dataset_info"), data.get("path")
        if info is None and path is not None and Path(path).is_dir() and is_llama_factory_dir(Path(path)):
            info, data = path, {**data, "dataset_info": path, "path": None}
            path = None
        if info is None:
            if data.get("name") is not None:
                raise ValueError("data.name names an entry of data.dataset_info; set data.dataset_info too")
            return data
        entry = read_entry(Path(info).expanduser(), data.get("name"))
        kind = data.get("kind") or entry.kind
        if kind not in entry.kinds:
            supervised = entry.unpaired and kind in ("text", "instruct", "chat")
            why = f"; {UNREADABLE_FIELDS[KTO_TAG][1]}" if supervised else ""
            raise ValueError(f"data.kind {kind} cannot read entry {entry.name!r} ({entry.layout}){why}; use data.kind "
                             f"{' or '.join(entry.kinds)}")
        filled = {"kind": kind, "path": entry.path, "columns": entry.columns_for(kind), "tags": entry.tags,
                  "dataset_info": dataset_info_file(Path(info).expanduser())}
        for key in ("path", "columns", "tags"):
            given = data.get(key)
            if given and (Path(given).expanduser() if key == "path" else given) != filled[key]:
                raise ValueError(f"data.{key} {given!r} differs from what entry {entry.name!r} of data.dataset_info "
                                 f"gives ({filled[key]!r}); set it in the dataset_info.json entry, not in data")
        return {**data, **filled}

    @field_validator("columns")
    @classmethod
    def _kto_tag_is_label(cls, columns: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        """unpaired_preference: ``kto_tag`` (LLaMA-Factory's name) maps the ``label`` column."""
        if info.data.get("kind") != "unpaired_preference" or KTO_TAG not in columns:
            return columns
        if "label" in columns:
            raise ValueError(f"data.columns maps both label ({columns['label']!r}) and kto_tag "
                             f"({columns[KTO_TAG]!r}), the same field; keep one")
        return {("label" if name == KTO_TAG else name): column for name, column in columns.items()}

    _records: object = PrivateAttr(None)  # a ray.data.Dataset the Python API gave (`with_records`)

    @field_validator("path")
    @classmethod
    def _path_exists(cls, path: Path | None) -> Path | None:
        if path is None:
            return None
        if is_glob(path):
            if not glob.glob(str(path)):
                raise ValueError(f"data path {path} matches no file")
        elif not path.exists():
            raise ValueError(f"data path {path} does not exist")
        return path

    def with_records(self, dataset: object) -> "DataConfig":
        """This data config reading its records from `dataset`, a `ray.data.Dataset` (text, instruct, chat,
        preference or unpaired preference records as `kind` says) instead of `path`. The dataset travels with the
        config to the master, which streams it from the cluster: the driver never holds the records."""
        copy = self.model_copy()
        copy._records = dataset
        return copy

    @property
    def records(self) -> object:
        """The `ray.data.Dataset` of `with_records`, else None."""
        return self._records

    @property
    def source(self) -> str:
        """What the records come from, for messages: the path, or the Ray dataset."""
        return "the ray.data.Dataset given to the job" if self._records is not None else str(self.path)

    @model_validator(mode="after")
    def _options_fit_the_kind(self) -> "DataConfig":
        if self.kind == "text" and self.truncation != "right":
            raise ValueError("data.truncation applies to instruct and chat data; text is cut into blocks of seq_len")
        if self.kind == "text" and self.packing:
            raise ValueError("data.packing applies to instruct and chat data; text is always packed as one "
                             "token stream")
        rows = KEEP_START_KINDS.get(self.kind)
        if rows is not None and self.packing:
            raise ValueError(f"data.packing does not apply to kind {self.kind}: {rows}; set data.packing: false")
        if rows is not None and self.truncation != "right":
            trainer, unit = ("DPOTrainer", "a pair") if self.kind == "preference" else ("KTOTrainer", "an example")
            raise ValueError(f"data.truncation {self.truncation} does not apply to kind {self.kind}: as TRL's "
                             f"{trainer} (keep_start), each sequence keeps its first seq_len tokens and {unit} "
                             "whose prompt fills seq_len is dropped; set data.truncation: right")
        if self.tags and self.kind not in TEMPLATED_KINDS:
            raise ValueError(f"data.tags applies to kind {', '.join(TEMPLATED_KINDS)} (ShareGPT records), not "
                             f"{self.kind}")
        unknown_tags = sorted(set(self.tags) - set(TAG_NAMES))
        if unknown_tags:
            raise ValueError(f"data.tags: unknown tags {unknown_tags}; LLaMA-Factory's are {list(TAG_NAMES)}")
        if self.chat_template is not None and self.kind not in TEMPLATED_KINDS:
            raise ValueError(f"data.chat_template applies to kind chat, preference and unpaired_preference, not "
                             f"{self.kind}")
        unknown = sorted(set(self.columns) - set(COLUMNS.get(self.kind, ())))
        if unknown:
            raise ValueError(f"data.columns: {unknown} are not {self.kind} fields; map any of "
                             f"{list(COLUMNS[self.kind])} to your file's column names")
        return self

