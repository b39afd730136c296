"""Raw training records from local files: the one place vela-ray reads instruction and chat data.

`load_records` turns a ``.json`` list, a ``.jsonl`` file, a ``.parquet`` or ``.csv``
table, or a directory written by ``datasets.Dataset.save_to_disk`` into plain Python
dicts, one per record in file order, with nested fields (``messages: [{role, content}]``,
``instances: [{input, output}]``) kept as lists and dicts. Files go through Hugging Face
``datasets``, which converts each one to Arrow once and reuses that cache while the file
is unchanged (its cache key is the file's path and modification time).

What a user must be able to fix in an editor is checked here, before ``datasets`` sees
the file, because its own errors are unhelpful or absent: JSON is parsed with the
standard library first (``datasets`` silently accepts trailing commas, a top-level
object and non-object records, and names no line when it does fail), and CSV rows
are counted against the header (pandas shifts the columns of a row with one field
too many). Every error is one ``ValueError`` line that names the file and says what
was expected; anything else ``datasets`` or pyarrow raises is reported as
``{path}: cannot read as {builder} (...)``.

CSV has no types, so every CSV column is read as text: an answer ``42`` stays the
string ``"42"`` and an empty field stays ``""`` (pandas would make them an int and None).
Records of one file share one schema, so a key that only some records have reads as
None in the others.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, TypeVar

from vela_ray.errors import first_line

if TYPE_CHECKING:  # datasets loads inside the functions: `vela_ray.config` imports this package and must
    from datasets import Dataset  # stay cheap to import (datasets itself takes ~1 s)

log = logging.getLogger(__name__)

RECORD_FORMATS: dict[str, str] = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""Data file suffix -> the `datasets` builder that reads it."""

ACCEPTED = f"a data file ({', '.join(RECORD_FORMATS)}) or a directory written by Dataset.save_to_disk"
EXPECTED = {  # what an empty file of each type should have held
    ".json": "a JSON list of records",
    ".jsonl": "one JSON record per line",
    ".parquet": "a Parquet table of records (write one with Dataset.to_parquet or DataFrame.to_parquet)",
    ".csv": "a header line of column names, then one record per line",
}
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")  # what save_to_disk writes for a Dataset / DatasetDict

BuildOptions = dict[str, Any]


def load_records(path: Path, columns: Mapping[str, str] | None = None, limit: int | None = None,
                 cache_dir: Path | None = None) -> list[dict]:
    """The records of a local data file or a `Dataset.save_to_disk` directory, as plain Python dicts (one per
    record, in file order).

    `columns` maps the canonical field name the caller reads to the file's own column name (e.g.
    ``{"instruction": "question"}``); the records carry the canonical names and keep their other columns.
    `limit` keeps the first records only. `cache_dir` is where `datasets` keeps its Arrow copy of a file
    (default: its own cache, shared by every run, so an unchanged file is converted once).
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if hasattr(path, "iter_batches"):  # a ray.data.Dataset (`DataConfig.with_records`)
        return ray_records(path, columns, limit)
    path = Path(path)
    shards = shard_files(path)
    if shards is not None:
        if _ray_attached():
            return ray_records(read_shards(shards), columns, limit)
        records = [r for shard in shards for r in load_records(shard, columns, None, cache_dir)]
        return records if limit is None else records[:limit]
    _quiet_datasets()
    dataset = _load_saved(path) if path.is_dir() else _load_file(path, cache_dir)
    if dataset is None:  # a file that holds no records: datasets cannot build an empty split from it
        return []
    if limit is not None and limit < len(dataset):
        dataset = dataset.select(range(limit))  # an index over the memory-mapped table: nothing else is read
    records = _renamed(dataset, columns or {}, path).to_list()
    log.debug("%s: %d records", path, len(records))
    return records


SHARD_SUFFIXES = (".jsonl", ".parquet")  # what a directory or glob of shards may hold, one kind per data set


def is_glob(path: Path | str) -> bool:
    """Whether a data path is a glob pattern (`shards/*.jsonl`) rather than one file or directory."""
    return any(c in str(path) for c in "*?[")


def shard_files(path: Path) -> list[Path] | None:
    """The shards a glob (`shards/*.jsonl`) or a directory (not a `save_to_disk` one) names, in name order;
    None for a single file or a saved dataset."""
    if is_glob(path):
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
    elif path.is_dir() and not any((path / name).is_file() for name in SAVED_DATASET_FILES):
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        if not any(p.suffix.lower() in SHARD_SUFFIXES for p in files):
            return None  # not shards: read (and refused) as a saved dataset
    else:
        return None
    suffixes = sorted({p.suffix.lower() for p in files})
    if not files or len(suffixes) != 1 or suffixes[0] not in SHARD_SUFFIXES:
        raise ValueError(f"{path}: expected shards of one kind ({' or '.join(SHARD_SUFFIXES)}), found "
                         f"{suffixes or 'no files'}; or give {ACCEPTED}")
    return files


def _ray_attached() -> bool:
    """Whether this process is connected to a Ray cluster (then shards are read by Ray Data, on the cluster)."""
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def read_shards(files: list[Path]):
    """The shards as one `ray.data.Dataset`, in file order."""
    import ray.data

    paths = [str(f) for f in files]
    return ray.data.read_parquet(paths) if files[0].suffix.lower() == ".parquet" else ray.data.read_json(paths)


def ray_records(dataset, columns: Mapping[str, str] | None, limit: int | None) -> list[dict]:
    """The records of a `ray.data.Dataset`, in its order, as plain dicts (Arrow's own conversion, as `datasets`
    gives them for a file), renamed by `columns` like a file's. Read batch by batch from the cluster."""
    # records in the dataset's order, as from a file (the dataset runs under the context it was made with)
    dataset.context.execution_options.preserve_order = True
    if limit is not None:
        dataset = dataset.limit(limit)
    records: list[dict] = []
    for batch in dataset.iter_batches(batch_format="pyarrow", batch_size=4096):
        records.extend(batch.to_pylist())
    for canonical, own in (columns or {}).items():
        for record in records:
            if own in record:
                record[canonical] = record.pop(own)
    return records


def _quiet_datasets() -> None:
    """Library code must not print: silence datasets' progress bars and logs. Its errors come back to the
    caller as our own one-line ValueError, so its error log would only repeat them. Nor reach the network:
    `load_dataset` of a local file otherwise sends the Hub a download-count request first (up to 3 s where the
    Hub cannot be reached)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False


# --- files ---------------------------------------------------------------------


def _load_file(path: Path, cache_dir: Path | None) -> Dataset | None:
    """The file's records through `datasets.load_dataset`, after the checks that name a line; None if it
    holds no records."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file or directory; expected {ACCEPTED}")
    suffix = path.suffix.lower()
    if suffix not in RECORD_FORMATS:
        raise ValueError(f"{path}: unknown data file type {path.suffix!r}; expected {ACCEPTED}")
    if path.stat().st_size == 0:
        _raise_empty(path)
    options = _PREFLIGHT[suffix](path)
    return None if options is None else _build(RECORD_FORMATS[suffix], path, cache_dir, options)


def _build(builder: str, path: Path, cache_dir: Path | None, options: BuildOptions) -> Dataset:
    import datasets

    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train",
                                     cache_dir=None if cache_dir is None else str(cache_dir), **options)
    except Exception as err:  # noqa: BLE001 - datasets, pyarrow and pandas raise many types; all mean the same
        raise ValueError(f"{path}: cannot read as {builder} ({first_line(err, innermost=True)})") from None


def _raise_empty(path: Path) -> NoReturn:
    raise ValueError(f"{path}: the file is empty; expected {EXPECTED[path.suffix.lower()]}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: byte {err.start} is not UTF-8 ({err.reason}); save the file as UTF-8") from None


# --- per-format checks: the load_dataset options for the file, or None when it holds no records --------------


def _check_json(path: Path) -> BuildOptions | None:
    text = _read_text(path)
    if not text.strip():
        _raise_empty(path)
    return _check_objects(path, _json_list(path, text))


def _check_jsonl(path: Path) -> BuildOptions | None:
    text = _read_text(path)
    if not text.strip():
        _raise_empty(path)
    return _check_objects(path, _jsonl_records(path, text))


def _check_objects(path: Path, records: list[object]) -> BuildOptions | None:
    for index, record in enumerate(records):
        as_object(record, f"{path}: record {index}")
    return {} if records else None


def as_object(value: object, where: str) -> dict:
    """`value` if it is a JSON object (dict); else one line naming `where`."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


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
    # split on "\n" only, as pyarrow does: str.splitlines would also split inside a string holding U+2028
    for line_no, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {line_no}: record {len(records)} is not valid JSON "
                                 f"({err.msg})") from None
    return records


def _check_parquet(path: Path) -> BuildOptions | None:
    import pyarrow.parquet as pq

    try:
        num_rows = pq.read_metadata(path).num_rows
    except Exception as err:  # noqa: BLE001 - pyarrow's errors for a file that is not Parquet
        raise ValueError(f"{path}: cannot read as parquet ({first_line(err, innermost=True)})") from None
    return {} if num_rows else None


def _check_csv(path: Path) -> BuildOptions | None:
    """Every row must have the header's number of fields; all columns are read as text (see the module doc)."""
    import datasets

    text = _read_text(path).removeprefix("\ufeff")  # pandas skips the byte-order mark spreadsheets write
    try:
        header, has_records = _csv_shape(path, csv.reader(io.StringIO(text, newline="")))
    except csv.Error as err:
        raise ValueError(f"{path}: cannot read as csv ({err})") from None
    if not has_records:
        return None
    as_text = datasets.Features({name: datasets.Value("string") for name in header})
    return {"features": as_text, "keep_default_na": False}


def _csv_shape(path: Path, reader: Any) -> tuple[list[str], bool]:
    """(header, whether any record follows it); raises on an empty file, a repeated column or a ragged row."""
    header = next((row for row in reader if any(cell.strip() for cell in row)), None)
    if header is None:
        _raise_empty(path)
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated:
        raise ValueError(f"{path}: line {reader.line_num}: the header names column {repeated[0]!r} twice; "
                         "give every column its own name")
    count = 0
    for row in reader:
        if row:  # pandas skips blank lines too
            if len(row) != len(header):
                raise ValueError(f"{path}: line {reader.line_num}: record {count} has {len(row)} fields, the "
                                 f"header has {len(header)}; quote fields that hold a comma")
            count += 1
    return header, count > 0


_PREFLIGHT: dict[str, Callable[[Path], BuildOptions | None]] = {
    ".json": _check_json, ".jsonl": _check_jsonl, ".parquet": _check_parquet, ".csv": _check_csv,
}


# --- save_to_disk directories ------------------------------------------------------------


def _load_saved(path: Path) -> Dataset:
    """A `save_to_disk` directory: the Dataset itself, or the 'train' split of a DatasetDict."""
    import datasets

    if not any((path / name).is_file() for name in SAVED_DATASET_FILES):
        raise ValueError(f"{path}: a directory without {' or '.join(SAVED_DATASET_FILES)}, so not one written "
                         f"by Dataset.save_to_disk; expected {ACCEPTED}")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001 - a damaged directory: missing or corrupt Arrow files
        raise ValueError(f"{path}: cannot read as a save_to_disk directory "
                         f"({first_line(err, innermost=True)})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"{path}: the saved DatasetDict has no 'train' split (its splits are "
                             f"{list(loaded)}); save the training records as its 'train' split")
        loaded = loaded["train"]
    return loaded


# --- column names -------------------------------------------------------------------------


def _renamed(dataset: Dataset, columns: Mapping[str, str], path: Path) -> Dataset:
    """`dataset` with each mapped file column renamed to its canonical name (`data.columns`)."""
    present = dataset.column_names
    for canonical, column in columns.items():
        if column not in present:
            raise ValueError(f"{path}: no column {column!r} (data.columns.{canonical}); its columns are {present}")
    if len(set(columns.values())) < len(columns):
        raise ValueError(f"{path}: data.columns {dict(columns)} maps two fields to one column; map each field "
                         "to its own column")
    renames = {column: canonical for canonical, column in columns.items() if column != canonical}
    for column, canonical in renames.items():
        if canonical in present and canonical not in renames:
            raise ValueError(f"{path}: cannot rename column {column!r} to {canonical!r} (data.columns."
                             f"{canonical}): the file already has a column {canonical!r}; map that one instead "
                             "or drop it from data.columns")
    return dataset.rename_columns(renames) if renames else dataset


# --- what records hold that vela-ray does not train on ----------------------------------------


UNREADABLE_FIELDS = {  # field -> (what it is, why it is refused, the fix); never read past in silence
    "kto_tag": ("a KTO desirable/undesirable tag", "supervised fine-tuning (data.kind instruct or chat) would train "
                "the undesirable answers as targets", "use data.kind: unpaired_preference with "
                "training.preference.objective: kto, or keep only the desirable records and drop the field"),
    "label": ("a KTO desirable/undesirable tag", "supervised fine-tuning (data.kind instruct or chat) would train "
              "the undesirable answers as targets", "use data.kind: unpaired_preference with "
              "training.preference.objective: kto, or keep only the records labelled true and drop the field"),
    "chosen": ("a preference pair (chosen/rejected)", "supervised fine-tuning (data.kind instruct or chat) has "
               "one answer to learn, not two to compare", "use data.kind: preference with "
               "training.preference.objective: dpo"),
    "rejected": ("a preference pair (chosen/rejected)", "supervised fine-tuning (data.kind instruct or chat) has "
                 "one answer to learn, not two to compare", "use data.kind: preference with "
                 "training.preference.objective: dpo"),
    "images": ("images", "vela-ray fine-tunes text models, which cannot read them",
               "drop the field (and the <image> markers) or use a vision fine-tuner"),
    "videos": ("videos", "vela-ray fine-tunes text models, which cannot read them",
               "drop the field (and the <video> markers) or use a vision fine-tuner"),
    "audios": ("audio", "vela-ray fine-tunes text models, which cannot read it",
               "drop the field (and the <audio> markers) or use an audio fine-tuner"),
}


PAIR_FIELDS = ("chosen", "rejected")
"""The fields of a preference pair: read by data.kind preference, refused by the supervised kinds."""
LABEL_FIELDS = ("label", "kto_tag")
"""A KTO example's desirability label (TRL's name, then LLaMA-Factory's): read by data.kind unpaired_preference,
refused by the supervised kinds."""


def refuse_unreadable_fields(records: list[dict], path: Path, read: tuple[str, ...] = ()) -> None:
    """One line naming the first record holding a field vela-ray would otherwise ignore (`UNREADABLE_FIELDS`
    but those the caller `read`s, e.g. `PAIR_FIELDS` or `LABEL_FIELDS`): training past a KTO tag, a preference
    pair or an image would learn something else than the data says. ``label`` counts only as a KTO tag
    (true/false); an empty list of images counts as none."""
    for name, (what, why, fix) in UNREADABLE_FIELDS.items():
        if name in read:
            continue
        for index, record in enumerate(records):
            value = record.get(name)
            if isinstance(value, bool) if name == "label" else value not in (None, [], ""):
                raise ValueError(f"{path}: record {index}: field {name!r} is {what}; {why}, so vela-ray refuses "
                                 f"it rather than ignore it; {fix}")


PLACEHOLDER = re.compile(r"\{\{\s*[A-Za-z_][\w.]*\s*\}\}")


def warn_placeholders(records: list[dict], path: Path, warn: bool = True) -> int:
    """Warn once if records hold unreplaced template placeholders such as LLaMA-Factory's identity.json
    ``{{name}}`` (they would be learned literally); the number of records holding one. `warn`: False logs at
    DEBUG (a second build of data already warned about)."""
    found = [(index, match) for index, record in enumerate(records) if (match := _placeholder(record))]
    if found:
        index, match = found[0]
        log.log(logging.WARNING if warn else logging.DEBUG, "%s: %d of %d records hold unreplaced {{placeholders}} "
                "(record %d: %r), which the model would learn literally; replace them with their values before "
                "training", path, len(found), len(records), index, match)
    return len(found)


def _placeholder(value: object) -> str | None:
    if isinstance(value, str):
        match = PLACEHOLDER.search(value)
        return match.group(0) if match else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((found for item in items if (found := _placeholder(item))), None)


# --- bad records -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordCount:
    """How many records a data set was read from, and which were left out (data.on_bad_record: skip)."""

    read: int
    """Records (text: files or records) read, the skipped ones included."""
    skipped: int = 0
    reasons: tuple[tuple[int, str], ...] = ()
    """(record index, why) of every skipped record."""

    @property
    def used(self) -> int:
        return self.read - self.skipped


T = TypeVar("T")
SKIPPED_NAMED = 3  # skipped records the warning names


def parse_each(records: list[dict], parse: Callable[[dict, str], T], path: Path, on_bad_record: str = "error",
               warn: bool = True) -> tuple[list[T], RecordCount]:
    """`parse(record, where)` of every record (`where` is ``"{path}: record {i}"``). A ValueError stops
    everything (``error``) or leaves the record out (``skip``): the skipped records are counted, and named
    with their reasons (the first few) in one warning (DEBUG if not `warn`); all of them bad is still an error."""
    parsed, reasons = [], []
    for index, record in enumerate(records):
        where = f"{path}: record {index}"
        try:
            parsed.append(parse(record, where))
        except ValueError as err:
            if on_bad_record != "skip":
                raise
            reasons.append((index, str(err).removeprefix(f"{where}: ")))
    count = RecordCount(len(records), len(reasons), tuple(reasons))
    if reasons:
        named = "; ".join(f"record {index}: {why}" for index, why in reasons[:SKIPPED_NAMED])
        more = f"; and {len(reasons) - SKIPPED_NAMED} more" if len(reasons) > SKIPPED_NAMED else ""
        if not parsed:
            raise ValueError(f"{path}: all {len(records)} records are bad (data.on_bad_record: skip): {named}{more}")
        log.log(logging.WARNING if warn else logging.DEBUG, "%s: skipped %d of %d records (data.on_bad_record: "
                "skip): %s%s", path, len(reasons), len(records), named, more)
    return parsed, count
