"""`DataConfig`: the `data:` section of a job, which data set and how to cut it into rows. Pure pydantic:
`vela_ray.config` reads it without torch or transformers; `datasets.build_dataset` builds what it names."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

COLUMNS = {  # data.kind -> the fields `data.columns` may map onto a file's own column names
    "instruct": ("instruction", "input", "output", "instances"),
    "chat": ("messages", "conversations", "system"),
}


class DataConfig(BaseModel):
    """Which data set to fine-tune or profile on, and how to cut it into rows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["text", "instruct", "chat"]
    """``text``: packed LM corpus; ``instruct``: Alpaca-style instruction records; ``chat``: conversations
    (``messages`` of role/content, or ShareGPT ``conversations`` of from/value) rendered with the chat template."""
    path: Path
    """A text file or directory of ``.txt`` files (text); for instruct and chat a ``.json``, ``.jsonl``,
    ``.parquet`` or ``.csv`` file, or a directory written by ``datasets.Dataset.save_to_disk``."""
    seq_len: int = Field(default=256, ge=2)
    """Tokens per row."""
    limit: int | None = Field(default=None, ge=1)
    """Keep at most this many rows (text blocks) or examples (instruct, chat), in file order."""
    columns: dict[str, str] = Field(default_factory=dict)
    """instruct and chat: the file's column for a field vela-ray reads, e.g. ``{instruction: question, output:
    answer}`` or ``{messages: dialog}``."""
    chat_template: str | None = None
    """chat: a Jinja chat template, as a file path or the template itself (default: the tokenizer's own)."""
    packing: bool = False
    """instruct and chat: lay several examples end to end in each row instead of padding one per row; attention
    and loss stay within each example (refused for models where they would not, see `examples.check_packing`)."""

    @field_validator("path")
    @classmethod
    def _path_exists(cls, path: Path) -> Path:
        if not path.exists():
            raise ValueError(f"data path {path} does not exist")
        return path

    @model_validator(mode="after")
    def _options_fit_the_kind(self) -> "DataConfig":
        if self.kind == "text" and (self.packing or self.columns):
            field = "packing" if self.packing else "columns"
            raise ValueError(f"data.{field} applies to instruct and chat data; text is always packed as one "
                             "token stream")
        if self.chat_template is not None and self.kind != "chat":
            raise ValueError(f"data.chat_template applies to kind chat, not {self.kind}")
        unknown = sorted(set(self.columns) - set(COLUMNS.get(self.kind, ())))
        if unknown:
            raise ValueError(f"data.columns: {unknown} are not {self.kind} fields; map any of "
                             f"{list(COLUMNS[self.kind])} to your file's column names")
        return self
