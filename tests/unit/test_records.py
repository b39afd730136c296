"""`vela_ray.data.records.load_records`: every supported layout reads to the same records, and every bad file
gets one line that names it and says what to fix.

The files are real: the first records of the shipped GSM8K Alpaca set, written in each format. Each test
gives `datasets` its own cache under tmp_path, so no test reuses another's Arrow copy.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from vela_ray.data.records import RECORD_FORMATS, load_records
from vela_ray.paths import data_dir

GSM8K = data_dir() / "instruct" / "gsm8k_alpaca.json"
N = 50


@pytest.fixture(scope="module")
def gsm8k() -> list[dict]:
    return json.loads(GSM8K.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def source(gsm8k) -> list[dict]:
    return gsm8k[:N]


def _load(path: Path, tmp_path: Path, **kwargs) -> list[dict]:
    return load_records(path, cache_dir=tmp_path / "hf-cache", **kwargs)


def _write(path: Path, records: list[dict]) -> Path:
    """`records` written in the layout `path`'s suffix names (a directory: `Dataset.save_to_disk`)."""
    import datasets

    if path.suffix == ".json":
        path.write_text(json.dumps(records, indent=1), encoding="utf-8")
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(records).to_parquet(str(path))
    elif path.suffix == ".csv":
        with path.open("w", encoding="utf-8", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    else:
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


def _error(path: Path, tmp_path: Path, match: str, **kwargs) -> str:
    with pytest.raises(ValueError, match=match) as caught:
        _load(path, tmp_path, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- every layout reads to the same records ------------------------------------------------------


@pytest.mark.parametrize("name", ["records.json", "records.jsonl", "records.parquet", "records.csv", "saved"])
def test_every_layout_reads_to_the_source_records(tmp_path, source, name):
    assert _load(_write(tmp_path / name, source), tmp_path) == source


def test_the_suffixes_map_to_their_builders():
    assert RECORD_FORMATS == {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def test_a_saved_dataset_dict_reads_its_train_split(tmp_path, source):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(source[:5]),
                          "test": datasets.Dataset.from_list(source[5:7])}).save_to_disk(str(tmp_path / "dd"))
    assert _load(tmp_path / "dd", tmp_path) == source[:5]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_nested_columns_survive(tmp_path, suffix):
    dialogs = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
                "instances": [{"input": "", "output": str(i)}]} for i in range(3)]
    assert _load(_write(tmp_path / f"chat{suffix}", dialogs), tmp_path) == dialogs


def test_the_whole_shipped_set_reads(tmp_path, gsm8k):
    records = _load(GSM8K, tmp_path)
    assert len(records) == 7473
    assert records[0] == gsm8k[0] and records[-1] == gsm8k[-1]


def test_csv_fields_stay_text(tmp_path):
    path = tmp_path / "text.csv"
    path.write_text('instruction,output\n"What is 6*7?",42\nSay nothing,\nWhat is NA?,NA\n', encoding="utf-8")
    assert _load(path, tmp_path) == [{"instruction": "What is 6*7?", "output": "42"},
                                     {"instruction": "Say nothing", "output": ""},
                                     {"instruction": "What is NA?", "output": "NA"}]


def test_files_without_records_read_as_none(tmp_path):
    import datasets

    (tmp_path / "none.json").write_text("[]\n")
    (tmp_path / "none.csv").write_text("instruction,output\n")
    datasets.Dataset.from_dict({"a": []}, features=datasets.Features({"a": datasets.Value("string")})) \
        .to_parquet(str(tmp_path / "none.parquet"))
    for name in ("none.json", "none.csv", "none.parquet"):
        assert _load(tmp_path / name, tmp_path) == [], name


def test_an_edited_file_is_read_again(tmp_path):
    path = tmp_path / "edited.jsonl"
    path.write_text('{"a": "old"}\n')
    assert _load(path, tmp_path) == [{"a": "old"}]
    path.write_text('{"a": "new"}\n')
    later = path.stat().st_mtime + 10
    os.utime(path, (later, later))  # the cache is keyed by modification time: make sure it moves
    assert _load(path, tmp_path) == [{"a": "new"}]


# --- columns and limit ---------------------------------------------------------------------------------


def test_mapped_columns_take_their_canonical_names(tmp_path, source):
    renamed = [{"question": r["instruction"], "input": r["input"], "answer": r["output"]} for r in source]
    path = _write(tmp_path / "qa.jsonl", renamed)
    records = _load(path, tmp_path, columns={"instruction": "question", "output": "answer"})
    assert records == [{"instruction": r["instruction"], "input": r["input"], "output": r["output"]}
                       for r in source]


def test_a_missing_mapped_column_is_named(tmp_path):
    path = tmp_path / "ab.jsonl"
    path.write_text('{"a": "1", "b": "2"}\n')
    message = _error(path, tmp_path, "no column", columns={"instruction": "question"})
    assert message == f"{path}: no column 'question' (data.columns.instruction); its columns are ['a', 'b']"


def test_a_mapping_onto_an_existing_column_is_refused(tmp_path):
    path = tmp_path / "both.jsonl"
    path.write_text('{"instruction": "1", "question": "2"}\n')
    _error(path, tmp_path, "already has a column 'instruction'", columns={"instruction": "question"})
    _error(path, tmp_path, "maps two fields to one column", columns={"instruction": "question", "input": "question"})


@pytest.mark.parametrize("name", ["records.json", "saved"])
def test_limit_keeps_the_first_records(tmp_path, source, name):
    path = _write(tmp_path / name, source)
    assert _load(path, tmp_path, limit=3) == source[:3]
    assert _load(path, tmp_path, limit=0) == []
    assert _load(path, tmp_path, limit=10 * N) == source
    _error(path, tmp_path, "limit must be >= 0", limit=-1)


# --- bad input: one line naming the file ---------------------------------------------------------


def test_a_missing_path_or_unknown_type_says_what_is_accepted(tmp_path):
    accepted = r"expected a data file \(\.json, \.jsonl, \.parquet, \.csv\) or a directory written by"
    _error(tmp_path / "absent.json", tmp_path, f"absent.json: no such file or directory; {accepted}")
    (tmp_path / "notes.txt").write_text("hello")
    _error(tmp_path / "notes.txt", tmp_path, f"notes.txt: unknown data file type '.txt'; {accepted}")
    (tmp_path / "plain").mkdir()
    _error(tmp_path / "plain", tmp_path, f"plain: a directory without state.json or dataset_dict.json.*{accepted}")


def test_a_dataset_dict_without_train_lists_its_splits(tmp_path, source):
    import datasets

    datasets.DatasetDict({"test": datasets.Dataset.from_list(source[:2])}).save_to_disk(str(tmp_path / "dd"))
    _error(tmp_path / "dd", tmp_path, r"no 'train' split \(its splits are \['test'\]\)")


@pytest.mark.parametrize("name, text, expected", [
    ("empty.json", "", "a JSON list of records"),
    ("blank.json", " \n\n", "a JSON list of records"),
    ("empty.jsonl", "", "one JSON record per line"),
    ("blank.jsonl", "\n \n", "one JSON record per line"),
    ("empty.parquet", "", "a Parquet table of records"),
    ("empty.csv", "", "a header line of column names"),
    ("blank.csv", "\n  \n", "a header line of column names"),
])
def test_an_empty_file_says_what_it_should_hold(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    _error(path, tmp_path, f"^{re.escape(str(path))}: the file is empty; expected {expected}")


def test_broken_json_names_line_and_column(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[{"instruction": "a", "output": "b"},\n {"instruction": "c", "output": "d",}]\n')
    _error(path, tmp_path, rf"^{re.escape(str(path))}: line 2 column \d+: not valid JSON \(.+\)$")


def test_broken_jsonl_names_line_and_record(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2\n{"a": 3}\n')
    _error(path, tmp_path, rf"^{re.escape(str(path))}: line 3: record 1 is not valid JSON \(.+\)$")


def test_json_must_be_a_list_of_objects(tmp_path):
    path = tmp_path / "dict.json"
    path.write_text('{"instruction": "a", "output": "b"}')
    message = _error(path, tmp_path, "expected a JSON list")
    assert message == f"{path}: expected a JSON list of records [{{...}}, ...], got a dict"
    path = tmp_path / "strings.json"
    path.write_text('[{"a": "x"}, "y"]')
    assert _error(path, tmp_path, "record 1") == f"{path}: record 1: expected a JSON object, got str"
    path = tmp_path / "strings.jsonl"
    path.write_text('"y"\n')
    assert _error(path, tmp_path, "record 0") == f"{path}: record 0: expected a JSON object, got str"


def test_a_corrupt_parquet_file_is_one_line_without_a_chain(tmp_path):
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: cannot read as parquet \(.+\)$") as caught:
        _load(path, tmp_path)
    assert "\n" not in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_what_only_datasets_rejects_is_one_line_naming_the_builder(tmp_path):
    path = tmp_path / "twice.jsonl"
    path.write_text('{"a": 1, "a": 2}\n')  # valid for the json module, not for pyarrow
    _error(path, tmp_path, rf"^{re.escape(str(path))}: cannot read as json \(JSON parse error: .+\)$")


def test_csv_rows_must_match_the_header(tmp_path):
    path = tmp_path / "ragged.csv"
    path.write_text("instruction,output\na,b\nc,d,e\n")
    _error(path, tmp_path, rf"^{re.escape(str(path))}: line 3: record 1 has 3 fields, the header has 2; quote fields")
    path.write_text("output,output\na,b\n")
    _error(path, tmp_path, rf"^{re.escape(str(path))}: line 1: the header names column 'output' twice")


def test_non_utf8_text_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"a": "café"}\n'.encode("latin-1"))
    _error(path, tmp_path, rf"^{re.escape(str(path))}: byte 10 is not UTF-8 .*; save the file as UTF-8$")


# --- quiet and cheap ---------------------------------------------------------------------------------


def test_loading_prints_and_warns_nothing(tmp_path, source, capfd):
    path = _write(tmp_path / "records.jsonl", source)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _load(path, tmp_path)
        (tmp_path / "twice.jsonl").write_text('{"a": 1, "a": 2}\n')  # datasets' own error path: it logs
        with pytest.raises(ValueError):
            _load(tmp_path / "twice.jsonl", tmp_path)
    assert [str(w.message) for w in caught] == []
    assert capfd.readouterr() == ("", "")


def test_importing_the_module_does_not_import_datasets():
    code = "import sys, vela_ray.data.records; print('datasets' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "False"
