"""Low-bit wire formats (`vela_ray.model.wire`, ZO-Offloading §5.4): opt-in and LOSSY.

The codec is checked against its error bound and byte counts; whole jobs in one process with rows in
bf16 and fp8 move exactly the predicted fraction of the exact run's bytes, train to nearby (not equal)
losses and say they were lossy; a tiered worker's low-bit uploads move fewer bytes and compute close
to the exact weights. The collective and Ray transports carry the wire forms in
tests/ray/test_transport_conformance.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.fixtures import job_dict, make_checkpoint, run_in_process
from vela_ray.config import JobConfig
from vela_ray.model import wire
from vela_ray.observability.report import summary_text
from vela_ray.training.summary import RunSummary
from vela_ray.training.tiers import ExpertTiersConfig


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- the codec ---------------------------------------------------------------------------------------------


def test_float8_keeps_every_value_within_a_sixteenth_of_its_rows_maximum_in_a_quarter_of_the_bytes():
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)[:, None]
    x[5] = 0.0  # an all-zero row decodes to zeros, not NaN
    encoded = wire.encode(x, "float8")
    assert encoded.dtype == torch.uint8 and encoded.shape == (64, 32 + 4)
    decoded = wire.decode(encoded, torch.float32)
    bound = x.abs().amax(dim=1, keepdim=True) / 16  # e4m3: 3 mantissa bits, half an ulp is 2^-4 relative
    assert torch.all((decoded - x).abs() <= bound) and torch.all(decoded[5] == 0)
    assert not torch.equal(decoded, x)  # it is lossy
    assert wire.bytes_ratio("float8", torch.float32, 32) == encoded.numel() / (x.numel() * 4)


def test_bfloat16_halves_fp32_and_exact_is_the_tensor_itself():
    x = torch.randn(3, 8)
    assert wire.encode(x, "exact") is x and wire.decode(x, torch.float32) is x
    half = wire.encode(x, "bfloat16")
    assert half.dtype == torch.bfloat16 and wire.bytes_ratio("bfloat16", torch.float32, 8) == 0.5
    torch.testing.assert_close(wire.decode(half, torch.float32), x, rtol=2**-8, atol=0)


def test_a_reply_travels_in_its_requests_format_and_any_leading_shape_works():
    assert wire.reply_format(torch.zeros(2, 6, dtype=torch.uint8), torch.float32) == "float8"
    assert wire.reply_format(torch.zeros(2, 4, dtype=torch.bfloat16), torch.float32) == "bfloat16"
    assert wire.reply_format(torch.zeros(2, 4, dtype=torch.bfloat16), torch.bfloat16) == "exact"
    assert wire.reply_format(torch.zeros(2, 4), torch.float32) == "exact"
    weights = torch.randn(4, 16, 8)  # an expert stack [E, out, in]: one scale per innermost row
    torch.testing.assert_close(wire.decode(wire.encode(weights, "float8"), torch.float32), weights,
                               rtol=2**-4, atol=1e-3)


@pytest.mark.parametrize("fields, message", [
    ({"mode": "expert_parallel", "data_plane": {"row_format": "float8"}},
     "mode: expert_parallel and a vela-only setting"),
    ({"model": {"dtype": "bfloat16"}, "data_plane": {"row_format": "bfloat16"}},
     "data_plane.row_format: bfloat16 with"),
    ({"model": {"dtype": "bfloat16"}, "expert_tiers": {"enabled": True, "upload_format": "bfloat16"}},
     "expert_tiers.upload_format: bfloat16 with"),
    ({"data_plane": {"row_format": "int4"}}, "data_plane.row_format"),
])
def test_a_low_bit_format_that_cannot_apply_is_refused_naming_the_field(tmp_path, fields, message):
    job = job_dict(tmp_path / "model", tmp_path / "out")
    for name, values in fields.items():
        job[name] = {**job.get(name, {}), **values} if isinstance(values, dict) else values
    with pytest.raises(ValueError, match=message):
        JobConfig.from_dict(job)


# --- whole jobs in one process ---------------------------------------------------------------------------

HIDDEN = 32  # the debug Mixtral's hidden size (float32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("model") / "mixtral")


def _run(model_dir: Path, out: Path, **data_plane) -> RunSummary:
    job = job_dict(model_dir, out, steps=3, placement={"solver": "sequential", "profile": "uniform"},
                   cluster={"num_workers": 3}, data_plane=data_plane,
                   training={"eval_batches": 1, "optimizer": {"lr": 5e-3, "warmup_steps": 1}})
    return run_in_process(JobConfig.from_dict(job))


@pytest.fixture(scope="module")
def exact(model_dir, tmp_path_factory) -> RunSummary:
    return _run(model_dir, tmp_path_factory.mktemp("exact") / "out")


@pytest.mark.job
def test_rows_are_exact_by_default(exact):
    assert exact.row_format == "exact" and "rows travelled in" not in summary_text(exact)


@pytest.mark.job
@pytest.mark.parametrize("row_format, tolerance", [("bfloat16", 1e-2), ("float8", 5e-2)])
def test_low_bit_rows_move_the_predicted_bytes_and_train_close_to_the_exact_run(
        model_dir, exact, tmp_path, row_format, tolerance):
    lossy = _run(model_dir, tmp_path / "out", row_format=row_format)
    assert lossy.row_format == row_format
    # every token has top-k rows wherever it is routed, so only the bytes per row differ, in every direction
    ratio = wire.bytes_ratio(row_format, torch.float32, HIDDEN)
    assert sum(lossy.traffic_bytes_by_tier.values()) == ratio * sum(exact.traffic_bytes_by_tier.values())
    assert lossy.losses != exact.losses  # lossy from the first forward ...
    torch.testing.assert_close(torch.tensor(lossy.losses), torch.tensor(exact.losses), rtol=tolerance, atol=0)
    assert math.isfinite(lossy.eval_loss)  # ... and close, and said so
    line = f"rows travelled in {row_format} (LOSSY, data_plane.row_format)"
    assert line in summary_text(tmp_path / "out") and line in (tmp_path / "out" / "report.html").read_text()


# --- low-bit uploads into a tiered worker's device cache -------------------------------------------------------


@pytest.mark.parametrize("upload_format", ["bfloat16", "float8"])
def test_low_bit_uploads_move_fewer_bytes_and_compute_close_to_the_exact_weights(upload_format):
    from tests.unit.test_tiers import ALL_TO_DEVICE, make_manager, run_both_layers
    from vela_ray.training.tiny_model import tiny_model_path

    model = tiny_model_path()  # built on first use, as test_tiers' fixture
    runs = {}
    for fmt in ("exact", upload_format):
        manager = make_manager(model, ExpertTiersConfig(enabled=True, cache_experts=16, upload_format=fmt))
        manager.tiers.use_speeds(ALL_TO_DEVICE)  # every expert computes on the (CPU-backed) device tier
        runs[fmt] = run_both_layers(manager), manager.report().tiers
    (outs, grads, _), stats = runs[upload_format]
    (want_outs, want_grads, _), exact_stats = runs["exact"]
    assert stats.uploads == exact_stats.uploads > 0
    expected_ratio = {"bfloat16": 0.5, "float8": 0.25}[upload_format]
    assert stats.upload_bytes < exact_stats.upload_bytes * (expected_ratio + 0.02)
    for got, want in zip(outs + grads, want_outs + want_grads):
        assert not torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=0, atol=0.1 * want.abs().max().item())
