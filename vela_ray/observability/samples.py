"""The report's Samples: what `samples.json` in a run dir holds (written by `vela_ray.generate.add_samples`).

Plain data, no torch: the report reads it without loading a model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

SAMPLES_FILE = "samples.json"


@dataclass(frozen=True)
class Sample:
    prompt: str
    base: str
    tuned: str


@dataclass(frozen=True)
class SamplesRecord:
    """What `samples.json` holds: greedy generations of the base and the fine-tuned model per prompt."""

    samples: list[Sample] = field(default_factory=list)
    max_new_tokens: int = 0
    seconds: float = 0.0  # generating all of them (loading the base model excluded)
    skipped: str | None = None  # why there are none

    def write(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / SAMPLES_FILE
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @classmethod
    def read(cls, run_dir: str | Path | None) -> SamplesRecord | None:
        path = Path(run_dir) / SAMPLES_FILE if run_dir is not None else None
        if path is None or not path.is_file():
            return None
        raw = json.loads(path.read_text())
        return cls([Sample(**s) for s in raw.get("samples", [])], raw.get("max_new_tokens", 0),
                   raw.get("seconds", 0.0), raw.get("skipped"))
