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


DEMO_STEPS = 60


def demo_config(out_dir: str | Path = "runs/demo", steps: int = DEMO_STEPS,
                model_dir: str | Path | None = None) -> JobConfig:
    model_dir = Path(model_dir) if model_dir else tiny_model_path()
    return JobConfig.from_dict({
        "model": {"path": str(model_dir)},
        "data": {"kind": "text", "path": str(data_dir() / "tinyshakespeare" / "input.txt"), "seq_len": 128,
                 "limit": 2000},
        "cluster": {"num_workers": 3, "num_cpus_per_worker": 0.5},
        "placement": {"solver": "improved", "profile": "measure", "profile_batches": 4},
        "training": {"steps": steps, "batch_size": 8, "micro_batch_size": 4, "eval_every": 10,
                     # LoRA at 1e-2 over 60 steps: eval loss 5.9 -> 4.8, and the Samples turn from WikiText's
                     # prose to speakers' names and "thee" (at 1e-3 over 30: 5.9 -> 5.4, still WikiText's; 2e-2
                     # is no better than 1e-2)
                     "optimizer": {"lr": 1e-2, "warmup_steps": 3}},
        "output": {"dir": str(out_dir), "overwrite": True},  # run again, the last demo moves aside
    }, source="demo config")

