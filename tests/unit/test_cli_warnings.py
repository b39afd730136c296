"""The commands print no warning vela-ray knows to be harmless (`vela_ray.quiet`): here `vela export`, whose
peft skeletons read transformers' deprecated `is_gradient_checkpointing` (issue 49)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import init_adapter, make_checkpoint

BIN_DIR = Path(sys.executable).parent


@pytest.mark.parametrize("fmt", ["per-expert"])  # its skeletons read the deprecated alias
def test_vela_export_prints_no_known_warning(tmp_path, fmt):
    model = make_checkpoint(tmp_path / "model")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {"path": str(model)}, "lora": {"r": 4, "alpha": 8}}))
    init_adapter(model, run / "adapter")
    done = subprocess.run([str(BIN_DIR / "vela"), "export", str(run), "--format", fmt, "--out", str(tmp_path / "out")],
                          env={**os.environ, "PYTHONWARNINGS": "default"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[-3000:]
