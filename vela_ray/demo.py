"""The demo job: the tiny pre-trained Mixtral, Tiny Shakespeare, experts over 3 ExpertManagers.

`vela demo` builds (once, cached; a few minutes, showing its progress) the tiny model and
fine-tunes it on a fresh local Ray cluster; `demo_config()` is the same job as a JobConfig to
start from. What a finished run prints is `vela_ray.observability.report.summary_text`, the
same for every run.
"""

from __future__ import annotations

from pathlib import Path

from vela_ray.config import JobConfig
from vela_ray.paths import data_dir
from vela_ray.training.tiny_model import tiny_model_path


def demo_config(out_dir: str | Path = "runs/demo", steps: int = 30, model_dir: str | Path | None = None) -> JobConfig:
    model_dir = Path(model_dir) if model_dir else tiny_model_path()
    return JobConfig.from_dict({
        "model": {"path": str(model_dir)},
        "data": {"kind": "text", "path": str(data_dir() / "tinyshakespeare" / "input.txt"), "seq_len": 128,
                 "limit": 2000},
        "cluster": {"num_workers": 3, "num_cpus_per_worker": 0.5},
        "placement": {"solver": "improved", "profile": "measure", "profile_batches": 4},
        "training": {"steps": steps, "batch_size": 8, "micro_batch_size": 4, "eval_every": 10,
                     # LoRA at 1e-3: over 30 steps the loss falls ~0.5 (at 3e-4 by less than its batch-to-batch noise)
                     "optimizer": {"lr": 1e-3, "warmup_steps": 3}},
        "output": {"dir": str(out_dir), "overwrite": True},  # run again, the last demo moves aside
    }, source="demo config")

