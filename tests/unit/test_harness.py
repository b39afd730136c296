"""benchmarks/_harness.py: results files name no directory of the machine that wrote them."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks._harness import write_results  # noqa: E402


def test_results_json_and_markdown_name_temporary_and_repository_directories_portably(tmp_path):
    scratch = Path(tempfile.gettempdir()) / "run-7"
    out = tmp_path / "results.json"
    command = f"python benchmarks/x.py --out {scratch} --model {ROOT / 'benchmarks' / 'results'}"
    write_results(out, {"command": command}, f"`{command}`")
    for text in (json.loads(out.read_text())["command"], out.with_suffix(".md").read_text()):
        assert "$TMPDIR/run-7" in text and "benchmarks/results" in text, text
        assert tempfile.gettempdir() + "/" not in text and str(ROOT) not in text, text
