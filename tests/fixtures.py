"""Small local checkpoints for runtime tests: a debug-size MoE model plus a BPE tokenizer, saved HF-style."""

from __future__ import annotations

from pathlib import Path

import yaml

from vela_ray.model.families import debug_model
from vela_ray.paths import data_dir
from vela_ray.training.tiny_model import train_tokenizer

VOCAB = 256


def make_checkpoint(out_dir: Path, family: str = "mixtral", seed: int = 0) -> Path:
    """A random `family` model with a 256-token BPE tokenizer trained on Tiny Shakespeare."""
    out_dir = Path(out_dir)
    text = (data_dir() / "tinyshakespeare" / "input.txt").read_text()[:200_000]
    tokenizer = train_tokenizer(text, VOCAB)
    model = debug_model(family, seed=seed, vocab_size=len(tokenizer))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def job_dict(model_dir: Path, out_dir: Path, steps: int = 3, **sections) -> dict:
    job = {
        "model": {"path": str(model_dir)},
        "data": {"kind": "text", "path": str(data_dir() / "tinyshakespeare" / "input.txt"), "seq_len": 32,
                 "limit": 200},
        "cluster": {"num_workers": 3, "num_cpus_per_worker": 0.25},
        "placement": {"solver": "improved", "profile": "measure", "profile_batches": 2},
        "training": {"steps": steps, "batch_size": 4, "micro_batch_size": 2},
        "output": {"dir": str(out_dir)},
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def write_job(path: Path, job: dict) -> Path:
    path.write_text(yaml.safe_dump(job))
    return path
