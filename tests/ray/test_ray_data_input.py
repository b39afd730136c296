"""Ray Data as a job's input: shards read through `ray.data.read_json` / `read_parquet`, and a
`ray.data.Dataset` handed to the job in Python, train to the same losses as the same records from one file.

The jobs run in this process (`run_in_process`) while this process is attached to Ray, as a master actor is:
the records are read by Ray Data on the cluster and streamed to the job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.data

from tests.fixtures import job_dict, make_checkpoint, run_in_process
from vela_ray.config import JobConfig
from vela_ray.data.records import load_records
from vela_ray.paths import data_dir

pytestmark = pytest.mark.job

RECORDS = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    """The first RECORDS GSM8K records in Alpaca form: one JSONL file, 3 JSONL shards and 3 Parquet shards."""
    records = json.loads((data_dir() / "instruct" / "gsm8k_alpaca.json").read_text())[:RECORDS]
    root = tmp_path_factory.mktemp("data")
    whole = root / "all.jsonl"
    whole.write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "jsonl").mkdir()
    (root / "parquet").mkdir()
    for i in range(3):
        part = records[i * RECORDS // 3:(i + 1) * RECORDS // 3]
        (root / "jsonl" / f"part-{i:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        pq.write_table(pa.Table.from_pylist(part), root / "parquet" / f"part-{i:03d}.parquet")
    return {"whole": whole, "jsonl": root / "jsonl", "parquet": root / "parquet"}


def _job(model_dir: Path, out: Path, path: Path | str | None) -> JobConfig:
    job = job_dict(model_dir, out, steps=3)
    job["data"] = {"kind": "instruct", "path": None if path is None else str(path), "seq_len": 64,
                   "truncation": "keep_answer"}
    return JobConfig.from_dict(job)


def test_shards_and_a_ray_dataset_train_as_the_records_from_one_file(ray_session, model_dir, shards, tmp_path):
    records = load_records(shards["whole"])
    assert load_records(Path(f"{shards['jsonl']}/part-*.jsonl")) == records  # read by Ray Data: attached
    assert load_records(shards["parquet"]) == records

    direct = run_in_process(_job(model_dir, tmp_path / "direct", shards["whole"]).preflight().config)
    from_glob = run_in_process(_job(model_dir, tmp_path / "glob", f"{shards['jsonl']}/part-*.jsonl")
                               .preflight().config)
    dataset = ray.data.read_parquet(sorted(str(p) for p in shards["parquet"].iterdir()))
    from_dataset = run_in_process(_job(model_dir, tmp_path / "dataset", None).with_dataset(dataset)
                                  .preflight().config)
    for summary in (from_glob, from_dataset):
        assert summary.losses == pytest.approx(direct.losses, rel=1e-5)
        assert summary.data.examples == direct.data.examples


def test_a_job_without_data_path_or_dataset_is_refused_in_one_line(model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"^data: data.path is missing; give a data file, directory or glob"):
        _job(model_dir, tmp_path / "out", None).preflight()


def test_shards_of_mixed_kinds_are_refused_naming_the_directory(model_dir, shards, tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text(shards["whole"].read_text())
    (mixed / "b.parquet").write_bytes((shards["parquet"] / "part-000.parquet").read_bytes())
    with pytest.raises(ValueError, match=r"mixed: expected shards of one kind \(.jsonl or .parquet\), found "
                                         r"\['.jsonl', '.parquet'\]"):
        _job(model_dir, tmp_path / "out", mixed).preflight()
