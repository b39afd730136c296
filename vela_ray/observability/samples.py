"""The report's Samples: what `samples.json` in a run dir holds (written by `vela_ray.generate.add_samples`).

Plain data, no torch: the report reads it without loading a model.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

SAMPLES_FILE = "samples.json"


class Sample(BaseModel):
    model_config = ConfigDict(frozen=True)

    prompt: str
    base: str
    tuned: str


class SamplesRecord(BaseModel):
    """What `samples.json` holds: greedy generations of the base and the fine-tuned model per prompt."""

    samples: list[Sample] = Field(default_factory=list)
    max_new_tokens: int = 0
    repetition_penalty: float = 1.0  # the generations' (1: none, as in records written before it was kept)
    seconds: float = 0.0  # generating all of them (loading the base model excluded)
    skipped: str | None = None  # why there are none

    def write(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / SAMPLES_FILE
        path.write_text(self.model_dump_json(indent=1))
        return path

    @classmethod
    def read(cls, run_dir: str | Path | None) -> SamplesRecord | None:
        path = Path(run_dir) / SAMPLES_FILE if run_dir is not None else None
        if path is None or not path.is_file():
            return None
        return cls.model_validate_json(path.read_text())
