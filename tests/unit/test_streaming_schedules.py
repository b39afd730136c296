"""`benchmarks/streaming_schedules.py` at toy size: every setup computes the same losses, and the micro-batches in
flight upload each block once per step where the serial streamed step uploads it once per micro-batch."""

from __future__ import annotations

import pytest

from benchmarks import streaming_schedules

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_schedules_compute_the_same_losses_and_gpipe_uploads_once_per_step(tmp_path):
    out = tmp_path / "schedules.json"
    payload = streaming_schedules.main(["--out", str(out), "--layers", "4", "--hidden", "64", "--seq", "16",
                                        "--steps", "2", "--activation-budget", "4096"])
    setups = payload["setups"]
    assert set(setups) == set(streaming_schedules.SETUPS) and out.is_file()
    losses = [s["last_loss"] for s in setups.values()]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    assert setups["prefetch_gpipe"]["uploads_per_step"] * 2 < setups["prefetch_serial"]["uploads_per_step"]
    assert setups["prefetch_gpipe_offload"]["offloaded_mib_total"] > 0
    assert setups["resident_serial"]["step_vs_resident_serial"] == 1.0
