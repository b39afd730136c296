"""output.dir on object storage, against a real S3 API: moto's S3 server on 127.0.0.1, started here.

A job with `output.dir: s3://bucket/run` writes its checkpoints (manifest last), summary, report and adapter
there; a master SIGKILLed in the middle of a checkpoint leaves the previous one latest and verifiable;
`--resume latest` from the bucket ends at the uninterrupted run's loss; the credentials are in no file the
run writes; a bucket that does not exist is refused by preflight in one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import job_dict, make_checkpoint, run_in_process
from vela_ray.config import JobConfig
from vela_ray.observability.report import summary_text
from vela_ray.storage import Remote, local_mirror, push_outputs
from vela_ray.training import checkpoint

pytestmark = pytest.mark.job

SECRET = "vela-test-secret-4c1f9e"  # the storage credential no file may contain
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3():
    """A local S3 server and a bucket; the credentials in the environment, as a job gets them."""
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "vela-test-key", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    boto3.client("s3").create_bucket(Bucket="bucket")
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VELA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _job(model_dir: Path, uri: str, steps: int, asynchronous: bool = False) -> dict:
    return job_dict(model_dir, uri, steps=steps, checkpoint={"every": 2, "keep": 2, "asynchronous": asynchronous},
                    training={"optimizer": {"lr": 5e-3}})


def _checked(job: dict) -> JobConfig:
    return JobConfig.from_dict(job).preflight().config


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_job_writes_its_outputs_and_checkpoints_to_the_bucket(s3, model_dir, cache, asynchronous):
    uri = f"s3://bucket/whole-{asynchronous}"
    summary = run_in_process(_checked(_job(model_dir, uri, steps=6, asynchronous=asynchronous)))
    remote = Remote(uri)
    files = remote.files()
    for name in ("run.json", "config.json", "summary.json", "report.html", "placement.json",
                 "adapter/adapter_config.json", "adapter/adapter_model.safetensors"):
        assert name in files, name
    assert json.loads(remote.read_bytes("summary.json"))["losses"] == pytest.approx(summary.losses)
    # the closing lines name the bucket's files, not the local mirror's
    closing = summary_text(summary)
    assert f"adapter: {uri}/adapter\n" in closing and f"report: {uri}/report.html\n" in closing
    assert str(local_mirror(uri)) not in closing
    # keep: 2 -> steps 4 and 6, each published by its manifest, the workers' parts listed with their sha256
    steps = checkpoint.step_dirs(f"{uri}/checkpoints")
    assert [s.rsplit("/", 1)[1] for s in steps] == ["step-000004", "step-000006"]
    manifest = checkpoint.verify(steps[-1])  # downloads and checks every sha256
    parts = [name for name in manifest["files"] if name.startswith("experts/part-")]
    assert len(parts) == 3 and manifest["experts"]
    assert checkpoint.latest(f"{uri}/checkpoints") == steps[-1]
    # the credentials reach no file: not on the bucket, not in the local mirror
    for name in files:
        assert SECRET.encode() not in remote.read_bytes(name), name
    for path in local_mirror(uri).rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


_KILLED_MID_CHECKPOINT = """
import os, signal, sys
from vela_ray.config import JobConfig
from vela_ray.training import checkpoint
from tests.fixtures import run_in_process

upload = checkpoint.Remote.upload
def upload_then_die(self, local, rel, **kw):  # step 4's first file reaches the bucket, then the master dies
    digest = upload(self, local, rel, **kw)
    if "step-000004" in self.uri:
        os.kill(os.getpid(), signal.SIGKILL)
    return digest
checkpoint.Remote.upload = upload_then_die
run_in_process(JobConfig.model_validate_json(sys.argv[1]))
"""


def test_sigkill_mid_checkpoint_then_resume_latest_from_the_bucket_ends_at_the_same_loss(s3, model_dir, cache):
    straight = run_in_process(_checked(_job(model_dir, "s3://bucket/straight", steps=6)))

    uri = "s3://bucket/killed"
    config = _checked(_job(model_dir, uri, steps=6))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _KILLED_MID_CHECKPOINT, config.model_dump_json()], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    root = f"{uri}/checkpoints"
    # step 4 was begun (its files partly there) but never published: step 2 is still the latest, verifiable
    assert [s.rsplit("/", 1)[1] for s in checkpoint.step_dirs(root)] == ["step-000002", "step-000004"]
    assert not Remote(f"{root}/step-000004").exists("manifest.json")
    assert checkpoint.latest(root).endswith("step-000002")
    assert checkpoint.verify(checkpoint.latest(root))["step"] == 2

    resumed = run_in_process(_checked({**_job(model_dir, uri, steps=6), "checkpoint": {
        "every": 2, "keep": 2, "resume": "latest"}}))
    assert resumed.losses[-1] == pytest.approx(straight.losses[-1], rel=1e-5)
    assert resumed.resumes[0].checkpoint == f"{root}/step-000002"
    assert [s.rsplit("/", 1)[1] for s in checkpoint.step_dirs(root)] == ["step-000004", "step-000006"]
    for step in checkpoint.step_dirs(root):
        checkpoint.verify(step)
    # the killed segment never uploaded its outputs: the resumed run writes its profile from the checkpoint
    for name in ("profile.json", "profile.npy"):
        assert Remote(uri).read_bytes(name) == Remote("s3://bucket/straight").read_bytes(name), name


def test_a_bucket_that_does_not_exist_or_a_uri_with_credentials_is_refused_before_the_run(s3, model_dir, cache):
    with pytest.raises(ValueError, match=r"^output.dir s3://no-such-bucket/run: cannot write there \(.*\); check "
                                         r"the bucket and the credentials"):
        _checked(_job(model_dir, "s3://no-such-bucket/run", steps=2))
    with pytest.raises(ValueError, match="the URI carries credentials; give them in the environment"):
        _checked(_job(model_dir, f"s3://key:{SECRET}@bucket/run", steps=2))


def test_a_new_job_into_a_bucket_path_that_holds_a_run_is_refused(s3, model_dir, cache):
    uri = "s3://bucket/taken"
    run_in_process(_checked(_job(model_dir, uri, steps=2)))
    with pytest.raises(ValueError, match=r"^output.dir s3://bucket/taken holds run .*resume it with `--resume "
                                         r"latest` or choose another output.dir"):
        _checked(_job(model_dir, uri, steps=2))


def test_vela_report_and_export_read_a_run_and_a_checkpoint_on_the_bucket(s3, model_dir, cache, tmp_path, capsys):
    from safetensors.torch import load_file

    from vela_ray.cli import main

    uri = "s3://bucket/served"
    run_in_process(_checked(_job(model_dir, uri, steps=2)))
    assert main(["report", uri]) == 0
    assert f"report: {local_mirror(uri) / 'report.html'}" in capsys.readouterr().out
    assert main(["export", f"{uri}/checkpoints/step-000002", "--format", "peft", "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["export", uri, "--format", "peft", "--out", str(tmp_path / "run")]) == 0
    from_checkpoint = load_file(tmp_path / "ckpt" / "adapter_model.safetensors")
    from_run = load_file(tmp_path / "run" / "adapter_model.safetensors")
    assert from_checkpoint.keys() == from_run.keys()
    assert all(bool((from_checkpoint[k] == from_run[k]).all()) for k in from_run)
    assert main(["export", f"{uri}/checkpoints/step-000009", "--format", "peft", "--out", str(tmp_path / "x")]) == 2
    assert "step-000009: no manifest.json" in capsys.readouterr().err


def test_an_upload_error_is_raised_unless_the_run_is_failing_already(tmp_path, monkeypatch, caplog):
    """A failing run's own error is the one to see: its outputs' upload error is then a warning."""
    def unreachable(self, local, skip=()):
        raise ConnectionError("bucket unreachable")

    monkeypatch.setattr(Remote, "upload_tree", unreachable)
    uri = (tmp_path / "bucket").as_uri()
    with pytest.raises(ConnectionError, match="bucket unreachable"):
        push_outputs(uri, tmp_path)
    push_outputs(uri, tmp_path, failing=True)
    assert f"uploading the outputs to {uri} failed (bucket unreachable); they are in {tmp_path}" in caplog.text
