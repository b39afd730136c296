"""LLaMA-Factory's ``dataset_info.json``: one named entry read into what `DataConfig` says itself.

A LLaMA-Factory ``data/`` directory holds the data files and a ``dataset_info.json`` that
names each data set::

    "glaive_toolcall_en_demo": {
      "file_name": "glaive_toolcall_en_demo.json",
      "formatting": "sharegpt",
      "columns": {"messages": "conversations", "tools": "tools"},
      "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"}
    }

`read_entry(dataset_info, name)` turns one entry into a `DatasetEntry`: the data file
(``file_name`` resolved relative to the ``dataset_info.json``), the kind its
``formatting`` reads as (``alpaca`` -> instruct, ``sharegpt`` -> chat; ``alpaca`` also
reads as text, its ``prompt`` column being the text, as LLaMA-Factory's pre-training
entries are written; an entry with ``ranking: true`` holds preference pairs and reads as
preference; one whose columns map a ``kto_tag`` holds KTO examples, each labelled desirable
or not, and reads as unpaired_preference), and LLaMA-Factory's ``columns`` and ``tags`` in
vela-ray's names (``prompt``/``query``/``response`` -> ``instruction``/``input``/``output``,
``messages`` -> ``conversations``, ``kto_tag`` -> ``label``; ``chosen``/``rejected`` keep
theirs, and a ranking entry must map both, as LLaMA-Factory reads no default for them). What
vela-ray cannot read is refused in one line naming the entry: downloads (``hf_hub_url``,
``ms_hub_url``, ``script_url``, ``cloud_file_name``), chosen/rejected columns outside a
ranking entry, a KTO tag in a ranking entry, and images, videos or audio. Pure standard
library: `vela_ray.data.config` reads entries while validating.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vela_ray.data.records import PAIR_FIELDS, SAVED_DATASET_FILES, UNREADABLE_FIELDS

FORMATTING_KINDS = {"alpaca": ("instruct", "chat", "text"), "sharegpt": ("chat",)}
"""LLaMA-Factory formatting -> the data.kind values that read it (the first is the default); a ranking entry,
either formatting, reads as preference only, an entry with a kto_tag column as unpaired_preference only."""
RANKING_KINDS = ("preference",)
UNPAIRED_KINDS = ("unpaired_preference",)
KTO_TAG = "kto_tag"
"""LLaMA-Factory's column of a KTO example's label (true: desirable), vela-ray's field ``label``."""

COLUMN_NAMES = {  # formatting -> {LLaMA-Factory column name: vela-ray field}
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output", "history": "history",
               "system": "system", "tools": "tools"},
    "sharegpt": {"messages": "conversations", "system": "system", "tools": "tools"},
}
RANKING_COLUMN_NAMES = {  # a ranking entry's: the prompt's, then the two answers (an alpaca response is neither)
    formatting: {**{lf: field_ for lf, field_ in names.items() if field_ != "output"},
                 **{name: name for name in PAIR_FIELDS}}
    for formatting, names in COLUMN_NAMES.items()
}
UNPAIRED_COLUMN_NAMES = {  # a KTO entry's: its formatting's, and the label
    formatting: {**names, KTO_TAG: "label"} for formatting, names in COLUMN_NAMES.items()
}
DEFAULT_COLUMNS = {  # what LLaMA-Factory reads when an entry maps nothing
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output"},
    "sharegpt": {"messages": "conversations"},
}
TAG_NAMES = ("role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag",
             "system_tag")
"""LLaMA-Factory's ShareGPT `tags`: the role and content keys of a message and each role's value."""

DOWNLOADS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


@dataclass(frozen=True)
class DatasetEntry:
    """One `dataset_info.json` entry in vela-ray's terms."""

    name: str
    path: Path
    """The data file, resolved relative to the dataset_info.json."""
    formatting: str
    """``alpaca`` or ``sharegpt``."""
    columns: dict[str, str] = field(default_factory=dict)
    """vela-ray field -> the file's column (only where the two differ)."""
    tags: dict[str, str] = field(default_factory=dict)
    """LLaMA-Factory tag name -> value (ShareGPT only)."""
    pretraining: bool = False
    """An alpaca entry whose columns map a prompt and no response: text to continue, not instructions."""
    ranking: bool = False
    """``ranking: true``: preference pairs (chosen/rejected), read as data.kind preference."""
    unpaired: bool = False
    """Columns that map a ``kto_tag``: KTO examples, each labelled desirable or not, read as data.kind
    unpaired_preference."""

    @property
    def kinds(self) -> tuple[str, ...]:
        """The data.kind values that read this entry."""
        if self.unpaired:
            return UNPAIRED_KINDS
        return RANKING_KINDS if self.ranking else FORMATTING_KINDS[self.formatting]

    @property
    def layout(self) -> str:
        """What the entry holds, for errors: ``formatting sharegpt``, and ``ranking: true`` or ``kto_tag``."""
        marks = ", ranking: true" if self.ranking else f", {KTO_TAG}: KTO examples" if self.unpaired else ""
        return f"formatting {self.formatting}{marks}"

    @property
    def kind(self) -> str:
        """The data.kind an entry reads as by default: preference for a ranking entry, unpaired_preference for one
        with a kto_tag, text for a text file or an alpaca entry that maps a prompt and no response (LLaMA-Factory's
        pre-training entries), else its formatting's kind."""
        if self.ranking or self.unpaired:
            return self.kinds[0]
        if self.formatting == "alpaca" and (self.path.suffix in (".txt", ".text") or self.pretraining):
            return "text"
        return FORMATTING_KINDS[self.formatting][0]

    def columns_for(self, kind: str) -> dict[str, str]:
        """The `data.columns` for reading this entry as `kind` (text: the alpaca ``prompt`` column)."""
        if kind == "text":
            return {"text": self.columns["instruction"]} if "instruction" in self.columns else {}
        return dict(self.columns)


def dataset_info_file(path: Path) -> Path:
    """`path` itself, or the ``dataset_info.json`` in the directory `path`."""
    return path / "dataset_info.json" if path.is_dir() else path


def is_llama_factory_dir(path: Path) -> bool:
    """A directory holding LLaMA-Factory's dataset_info.json (a `save_to_disk` directory holds one too, beside
    its state.json)."""
    return (path / "dataset_info.json").is_file() and not any((path / n).is_file() for n in SAVED_DATASET_FILES)


def read_entry(dataset_info: Path, name: str | None) -> DatasetEntry:
    """Entry `name` of the LLaMA-Factory `dataset_info` file (or of the one in directory `dataset_info`)."""
    info_file = dataset_info_file(Path(dataset_info))
    where = f"data.dataset_info {info_file}"
    try:
        entries = json.loads(info_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{where}: cannot read ({type(err).__name__}: {' '.join(str(err).split())})") from None
    if not isinstance(entries, dict) or not all(isinstance(e, dict) for e in entries.values()):
        raise ValueError(f"{where}: expected LLaMA-Factory's layout, an object of named entries "
                         '{"NAME": {"file_name": ..., ...}}')
    if name is None:
        raise ValueError(f"{where}: set data.name to one of its entries: {_some(entries)}")
    if name not in entries:
        raise ValueError(f"{where}: no entry {name!r} (data.name); its entries are {_some(entries)}")
    entry = entries[name]
    where = f"{info_file}: entry {name!r}"
    download = next((key for key in DOWNLOADS if entry.get(key)), None)
    if download is not None:
        raise ValueError(f"{where}: {download} {entry[download]!r}: vela-ray reads local files only and downloads "
                         "nothing; download the data set and name it with file_name")
    if not entry.get("file_name"):
        raise ValueError(f"{where}: no file_name; give the data file's name, relative to {info_file.parent}")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in COLUMN_NAMES:
        raise ValueError(f"{where}: formatting {formatting!r} is not one vela-ray reads; use alpaca or sharegpt")
    path = info_file.parent / entry["file_name"]
    if not path.exists():
        raise ValueError(f"{where}: file_name {entry['file_name']!r}: {path} does not exist")
    columns, ranking = entry.get("columns") or {}, bool(entry.get("ranking"))
    unpaired = isinstance(columns, dict) and columns.get(KTO_TAG) is not None
    return DatasetEntry(name, path, formatting, _columns(columns, formatting, where, ranking),
                        _tags(entry.get("tags") or {}, formatting, where),
                        pretraining=not ranking and not unpaired and formatting == "alpaca" and "prompt" in columns
                        and "response" not in columns, ranking=ranking, unpaired=unpaired)


def _some(entries: dict, shown: int = 12) -> str:
    names = sorted(entries)
    return str(names) if len(names) <= shown else f"{names[:shown]} and {len(names) - shown} more"


def _columns(columns: dict, formatting: str, where: str, ranking: bool) -> dict[str, str]:
    if not isinstance(columns, dict):
        raise ValueError(f"{where}: columns must be an object of column names")
    unpaired = columns.get(KTO_TAG) is not None
    refused = next((c for c in columns if c in UNREADABLE_FIELDS and not (ranking and c in PAIR_FIELDS)
                    and not (c == KTO_TAG and not ranking)), None)
    if refused is not None:
        what, why, fix = UNREADABLE_FIELDS[refused]
        if refused in PAIR_FIELDS:
            why, fix = "the entry has no ranking: true", "mark the entry ranking: true (data.kind preference)"
        elif refused == KTO_TAG:
            why, fix = ("a ranking entry holds chosen/rejected pairs, not examples labelled one by one",
                        "drop ranking: true to read the entry as KTO examples (data.kind unpaired_preference), or "
                        "drop columns.kto_tag to read it as DPO pairs (data.kind preference)")
        elif refused == "label":
            why, fix = "LLaMA-Factory names that column kto_tag", "map it as columns.kto_tag instead"
        raise ValueError(f"{where}: columns.{refused} ({columns[refused]!r}) is {what}; {why}, so vela-ray refuses "
                         f"it rather than ignore it; {fix}")
    missing = [c for c in PAIR_FIELDS if ranking and c not in columns]
    if missing:
        raise ValueError(f"{where}: ranking: true marks a preference pair (chosen/rejected), but columns maps no "
                         f"{missing[0]!r}; name the file's chosen and rejected columns (LLaMA-Factory reads no "
                         'default for them): "columns": {"chosen": ..., "rejected": ...}')
    names = RANKING_COLUMN_NAMES[formatting] if ranking else UNPAIRED_COLUMN_NAMES[formatting] if unpaired else \
        COLUMN_NAMES[formatting]
    unknown = sorted(set(columns) - set(names))
    if unknown:
        raise ValueError(f"{where}: columns {unknown} are not {formatting} columns vela-ray reads; it reads "
                         f"{sorted(names)}")
    defaults = {lf: column for lf, column in DEFAULT_COLUMNS[formatting].items() if lf in names}
    mapped = {names[lf]: column for lf, column in {**defaults, **columns}.items()}
    return {field_: column for field_, column in mapped.items() if field_ != column}


def _tags(tags: dict, formatting: str, where: str) -> dict[str, str]:
    if not isinstance(tags, dict) or not all(isinstance(v, str) for v in tags.values()):
        raise ValueError(f"{where}: tags must be an object of strings")
    if tags and formatting != "sharegpt":
        raise ValueError(f"{where}: tags apply to sharegpt formatting, not {formatting}")
    unknown = sorted(set(tags) - set(TAG_NAMES))
    if unknown:
        raise ValueError(f"{where}: unknown tags {unknown}; LLaMA-Factory's are {list(TAG_NAMES)}")
    return dict(tags)
