"""Bad job configs are refused before any actor starts, with the field named.

The one-line message and nothing-written checks of each bad input are in
test_bad_input.py; here: what a passing preflight returns (rows, the pinned
resume), the cluster-resource check, and that a config typo costs no heavy import.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.fixtures import job_dict, make_checkpoint, write_job
from vela_ray.config import ClusterSection, JobConfig
from vela_ray.data.datasets import build_dataset
from vela_ray.preflight import check_cluster_resources
from vela_ray.training.schedule import OptimizerConfig, lr_at
from vela_ray.training.tiers import ExpertTiersConfig
from vela_ray.training import checkpoint as ckpt


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _config(checkpoint, tmp_path, **sections) -> JobConfig:
    return JobConfig.from_dict(job_dict(checkpoint, tmp_path / "out", **sections))


def test_a_good_config_passes_preflight_and_counts_the_rows_the_master_trains_on(checkpoint, tmp_path):
    from transformers import AutoTokenizer

    config = _config(checkpoint, tmp_path)
    checked = config.preflight()
    # what MasterActor does with the same config
    train, _ = build_dataset(config.data, AutoTokenizer.from_pretrained(str(checkpoint))).split(
        config.training.eval_fraction, config.training.seed)
    assert checked.train_rows == len(train) == 190
    assert (checked.model.num_layers, checked.model.num_experts, checked.model.max_positions) == (2, 6, 128)
    assert checked.config.model_dump() == config.model_dump() and checked.resume is None
    assert checked.config.family_check == checked.family == "mixtral: verified by the test suite (transformers " \
        f"{version('transformers')}, peft {version('peft')})"
    assert not (tmp_path / "out").exists()  # the write probe is gone, and the dir preflight made for it


def _ckpt(root: Path, step: int, trainer: dict | None = None) -> Path:
    staging = ckpt.begin(root, step)
    ckpt.write_tensors(staging / "backbone.safetensors", {"w": torch.zeros(4)})
    if trainer is not None:
        (staging / "trainer.json").write_text(json.dumps(trainer))
    meta = {"model_type": "mixtral", "moe_layers": 2, "experts": 6, "hidden_size": 32, "lora_r": 8,
            "lora_alpha": 16.0}
    return ckpt.finalize(staging, step, meta)


def test_preflight_pins_resume_latest_to_the_newest_valid_checkpoint(checkpoint, tmp_path, caplog):
    good = _ckpt(tmp_path / "out" / "checkpoints", 1)
    bad = _ckpt(tmp_path / "out" / "checkpoints", 2)
    (bad / "backbone.safetensors").write_bytes(bytes(reversed((bad / "backbone.safetensors").read_bytes())))
    with caplog.at_level("WARNING"):
        checked = _config(checkpoint, tmp_path).with_resume("latest").preflight()
    assert checked.resume == good.resolve() and checked.resume_step == 1
    assert checked.config.checkpoint.resume == str(good.resolve())  # the master resolves this, not `latest`
    assert "skipping corrupt checkpoint" in caplog.text and "step-000002" in caplog.text


def test_resume_continues_when_training_steps_was_raised(checkpoint, tmp_path):
    done = _ckpt(tmp_path / "out" / "checkpoints", 3)
    with pytest.raises(ValueError, match="the run is complete at step 3"):
        _config(checkpoint, tmp_path, training={"steps": 3}).with_resume("latest").preflight()
    checked = _config(checkpoint, tmp_path, training={"steps": 5}).with_resume(str(done)).preflight()
    assert (checked.resume, checked.resume_step) == (done.resolve(), 3)


def test_raised_training_steps_on_resume_say_in_one_line_what_the_schedule_now_does(checkpoint, tmp_path, caplog):
    """The schedule is recomputed over the new total (cosine: 2.5e-4 at step 4 of 8 where the 4-step run was at
    its end): said once, before the run, with the fix; nothing said where the next lr is unchanged."""
    done = _ckpt(tmp_path / "out" / "checkpoints", 3, trainer={"step": 3, "total_steps": 4})
    optimizer = {"lr": 1e-3, "schedule": "cosine"}
    with caplog.at_level(logging.WARNING, logger="vela_ray.preflight"):
        _config(checkpoint, tmp_path, training={"steps": 8, "optimizer": optimizer}).with_resume(str(done)).preflight()
    cfg = OptimizerConfig(**optimizer)
    old, new = lr_at(cfg, 3, 4), lr_at(cfg, 3, 8)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"training.steps is 8, the checkpoint's run had 4: the cosine schedule now spans 8 steps, so step 4's "
        f"learning rate is {new:.3g} where the run's schedule gave {old:.3g} (x{new / old:.3g}); keep "
        f"training.steps 4 to finish the run as it was planned"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vela_ray.preflight"):
        _config(checkpoint, tmp_path, training={"steps": 8, "optimizer": {**optimizer, "schedule": "constant"}}
                ).with_resume(str(done)).preflight()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("cluster, available, message", [
    ({"num_workers": 3, "num_gpus_per_worker": 1}, {"CPU": 16.0},
     r"num_gpus_per_worker 1 x cluster.num_workers 3 needs 3 GPUs but the Ray cluster has 0; set "
     r"cluster.num_gpus_per_worker: 0"),
    ({"num_workers": 3, "num_gpus_per_worker": 1}, {"CPU": 16.0, "GPU": 2.0}, r"needs 3 GPUs .* has 2;"),
    ({"num_workers": 10, "num_cpus_per_worker": 0.5}, {"CPU": 2.0},
     r"cluster.num_workers 10 x cluster.num_cpus_per_worker 0.5 needs 5 CPUs but the Ray cluster has 2;"),
    ({"num_workers": 3, "num_cpus_per_worker": 0.5}, {"CPU": 1.5, "GPU": 0.0}, None),
    ({"num_workers": 2, "num_gpus_per_worker": 1, "num_cpus_per_worker": 1}, {"CPU": 8.0, "GPU": 2.0}, None),
    ({"num_workers": 10, "workers_on_master": 10}, {"CPU": 1.0}, None),  # no worker actors to place
    # two of three workers are actors with a GPU each; the third shares the master's
    ({"num_workers": 3, "workers_on_master": 1, "num_gpus_per_worker": 1}, {"CPU": 8.0, "GPU": 2.0}, None),
    ({"num_workers": 3, "workers_on_master": 1, "num_gpus_per_worker": 1}, {"CPU": 8.0, "GPU": 1.0},
     r"needs 2 GPUs .* has 1;"),
])
def test_cluster_resources_name_the_real_shortage(checkpoint, tmp_path, cluster, available, message):
    config = _config(checkpoint, tmp_path, cluster=cluster)
    if message is None:
        check_cluster_resources(config.cluster, available)
    else:
        with pytest.raises(ValueError, match=message):
            check_cluster_resources(config.cluster, available)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_job_a_local_ray_cannot_hold_is_refused_before_ray_starts(checkpoint, tmp_path):
    """`vela train` without an address on a CPU machine, asking for GPU workers: refused from what the machine
    has, not after a local Ray's 15-20 s start (none starts: its temp dir, RAY_TMPDIR, stays empty)."""
    job = write_job(tmp_path / "job.yaml", job_dict(checkpoint, tmp_path / "out",
                                                    cluster={"num_workers": 3, "num_gpus_per_worker": 1}))
    ray_tmp = tmp_path / "ray-tmp"
    ray_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([str(Path(sys.executable).parent / "vela"), "train", "--config", str(job)],
                          env={**env, "RAY_TMPDIR": str(ray_tmp)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "needs 3 GPUs but the Ray cluster has 0; set cluster.num_gpus_per_worker: 0" in done.stderr
    assert not list(ray_tmp.iterdir())


def test_missing_model_path_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"model.path .*no config.json"):
        _config(tmp_path / "nowhere", tmp_path).preflight()


def test_model_without_moe_layers_is_named(tmp_path):
    dense = tmp_path / "dense"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(dense)
    with pytest.raises(ValueError, match=r"model.path .*LlamaForCausalLM has no MoE block"):
        _config(dense, tmp_path).preflight()


def test_capacity_too_small_says_how_many_slots_are_missing(checkpoint, tmp_path):
    # 2 MoE layers x 6 experts = 12; 3 workers x 3 = 9 -> 3 short
    with pytest.raises(ValueError, match=r"need 3 more expert slots"):
        _config(checkpoint, tmp_path, placement={"capacity": 3}).preflight()


def test_unknown_solver_is_named(checkpoint, tmp_path):
    """vela-ray's line names the field; the refused value is checked in the pydantic error it wraps, not in
    pydantic's wording (which a pydantic release may change)."""
    with pytest.raises(ValueError, match=r"^config: placement\.solver: ") as caught:
        _config(checkpoint, tmp_path, placement={"solver": "magic"})
    [error] = caught.value.__context__.errors()
    assert (error["loc"], error["input"], error["type"]) == (("placement", "solver"), "magic", "literal_error")


def test_unreadable_data_is_named(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"data.path: .*does not exist"):
        _config(checkpoint, tmp_path, data={"path": str(tmp_path / "missing.txt")})


def test_micro_batch_must_divide_batch(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"micro_batch_size \(3\) must divide training.batch_size \(4\)"):
        _config(checkpoint, tmp_path, training={"micro_batch_size": 3})


def test_placement_file_solver_needs_a_file(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"placement.solver is 'file' but placement.file is not set"):
        _config(checkpoint, tmp_path, placement={"solver": "file"})


@pytest.mark.job
def test_cli_refuses_a_bad_config_without_starting_ray(checkpoint, tmp_path):
    # a fresh process: the Ray tests' session-wide Ray instance must not hide a start here
    job = write_job(tmp_path / "job.yaml", job_dict(checkpoint, tmp_path / "out", placement={"capacity": 1}))
    result = _run_fresh("from vela_ray.cli import main\n"
                        f"assert main(['train', '--config', {str(job)!r}]) == 2\n")
    assert result.returncode == 0, result.stderr
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and "need 9 more expert slots" in err[0]
    assert "ray" not in json.loads(result.stdout.strip().splitlines()[-1])
    assert not (tmp_path / "out").exists()


_HEAVY = ("torch", "transformers", "ray")
_TYPO_IN_A_FRESH_PROCESS = """
import json, sys
{call}
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _run_fresh(call: str) -> subprocess.CompletedProcess:
    code = _TYPO_IN_A_FRESH_PROCESS.format(call=call, heavy=_HEAVY)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])


def _typo_job(checkpoint: Path, tmp_path: Path) -> Path:
    return write_job(tmp_path / "typo.yaml", job_dict(checkpoint, tmp_path / "out", training={"stpes": 3}))


def test_a_config_typo_is_reported_without_importing_torch_transformers_or_ray(checkpoint, tmp_path):
    job = _typo_job(checkpoint, tmp_path)
    result = _run_fresh("from vela_ray.config import JobConfig\n"
                        "try:\n"
                        f"    JobConfig.from_yaml({str(job)!r})\n"
                        "except ValueError as err:\n"
                        "    print(err)\n")
    assert result.returncode == 0, result.stderr
    message, loaded = result.stdout.strip().splitlines()
    assert "training.stpes: unknown field (did you mean 'steps'?)" in message
    assert json.loads(loaded) == []


def test_vela_train_with_a_config_typo_imports_no_heavy_module(checkpoint, tmp_path):
    job = _typo_job(checkpoint, tmp_path)
    result = _run_fresh("from vela_ray.cli import main\n"
                        f"assert main(['train', '--config', {str(job)!r}]) == 2\n")
    assert result.returncode == 0, result.stderr
    assert "did you mean 'steps'" in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_the_master_gets_a_gpu_the_workers_leave_free(tmp_path):
    from vela_ray.preflight import master_gpus

    def cluster(**settings) -> ClusterSection:
        """The `cluster` section of a valid job with two workers and `settings`."""
        return JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out", cluster={"num_workers": 2, **settings})).cluster

    assert master_gpus(cluster(), {"CPU": 8}) == 0
    assert master_gpus(cluster(), {"CPU": 8, "GPU": 1}) == 1  # workers on CPUs: the GPU is the master's
    assert master_gpus(cluster(num_gpus_per_worker=1), {"CPU": 8, "GPU": 2}) == 0
    assert master_gpus(cluster(num_gpus_per_worker=1), {"CPU": 8, "GPU": 3}) == 1
    assert master_gpus(cluster(master_gpus=0), {"CPU": 8, "GPU": 3}) == 0
    assert master_gpus(cluster(), {"CPU": 8, "GPU": 1}, stages=2) == 0  # two stages, a GPU each, or none
    assert master_gpus(cluster(), {"CPU": 8, "GPU": 2}, stages=2) == 1
    with pytest.raises(ValueError, match="cluster.master_gpus 1 x masters.pipeline_stages 2 needs 2 GPUs"):
        master_gpus(cluster(master_gpus=1), {"CPU": 8, "GPU": 1}, stages=2)
    with pytest.raises(ValueError, match=r"cluster\.master_gpus 1 needs a GPU beyond the workers' 2, but the Ray "
                                         r"cluster has 2; set cluster\.master_gpus: 0"):
        master_gpus(cluster(num_gpus_per_worker=1, master_gpus=1), {"CPU": 8, "GPU": 2})
    # a tensor-parallel master: a GPU for each of its ranks, on the driver's node
    assert master_gpus(cluster(master_tp=2), {"CPU": 8, "GPU": 1}) == 0
    assert master_gpus(cluster(master_tp=2), {"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 2}) == 1
    with pytest.raises(ValueError, match=r"cluster\.master_gpus 1 x cluster\.master_tp 4 needs 4 GPUs beyond the "
                                         r"workers' 0, but the Ray cluster has 2"):
        master_gpus(cluster(master_tp=4, master_gpus=1), {"CPU": 8, "GPU": 2})
    with pytest.raises(ValueError, match=r"master_tp 2: the MasterActor is pinned to the driver's node n0, which has "
                                         r"1 GPUs and 8 CPUs, and asks for 2 GPU"):
        master_gpus(cluster(master_tp=2, master_gpus=1), {"CPU": 16, "GPU": 2}, {"CPU": 8, "GPU": 1}, "n0")


def test_rows_travel_the_collective_plane_by_default_with_any_number_of_master_processes(tmp_path):
    def transport(masters: int = 1, tp: int = 1, **data_plane) -> str:
        job = job_dict(tmp_path, tmp_path / "out", masters={"count": masters}, cluster={"master_tp": tp},
                       data_plane=data_plane)
        return JobConfig.from_dict(job).data_plane.transport

    assert JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out")).data_plane.transport == "collective"
    assert transport() == transport(masters=2) == transport(tp=2) == "collective"  # each forms planes of its own
    assert transport(masters=2, tp=2, transport="object_ref") == "object_ref"


# Each key issue 32 moved out of `cluster`, an old value for it, and where it now lives.
OLD_KEYS = [
    ("transport", "object_ref", ("data_plane", "transport")),
    ("inline_bytes", 1024, ("data_plane", "inline_bytes")),
    ("row_format", "float8", ("data_plane", "row_format")),
    ("zero_copy_tensors", False, ("data_plane", "zero_copy_tensors")),
    ("on_worker_loss", "recover", ("fault_tolerance", "on_worker_loss")),
    ("max_recoveries", 5, ("fault_tolerance", "max_recoveries")),
    ("num_masters", 2, ("masters", "count")),
    ("sequence_migration", False, ("masters", "sequence_migration")),
    ("sequence_migration_candidates", 2, ("masters", "sequence_migration_candidates")),
    ("expert_tiers", {"enabled": True, "cache_experts": 4}, ("expert_tiers",)),
]


def _at(config: JobConfig, path: tuple[str, ...]):
    value = config
    for name in path:
        value = getattr(value, name)
    return value.model_dump() if hasattr(value, "model_dump") else value


def test_the_moved_keys_table_is_the_one_this_test_checks():
    from vela_ray.config import MOVED

    assert MOVED == {("cluster", old): new for old, _, new in OLD_KEYS}


@pytest.mark.parametrize("old, value, new", OLD_KEYS, ids=[old for old, _, _ in OLD_KEYS])
def test_an_old_cluster_key_is_read_into_its_new_place_with_a_one_line_warning(tmp_path, caplog, old, value, new):
    job = job_dict(tmp_path, tmp_path / "out", cluster={old: value})
    with caplog.at_level(logging.WARNING, logger="vela_ray.config"):
        config = JobConfig.from_dict(job)
    expected = ExpertTiersConfig(**value).model_dump() if old == "expert_tiers" else value
    assert _at(config, new) == expected
    assert job["cluster"] == {"num_workers": 3, "num_cpus_per_worker": 0.25, old: value}  # the caller's dict
    new_name = ".".join(new)
    assert [r.getMessage() for r in caplog.records] == [
        f"cluster.{old} is now {new_name}; the old key is read until the next release"]


@pytest.mark.parametrize("old, value, new", OLD_KEYS, ids=[old for old, _, _ in OLD_KEYS])
def test_an_old_key_beside_its_new_one_is_refused_in_one_line(tmp_path, old, value, new):
    job = job_dict(tmp_path, tmp_path / "out", cluster={old: value})
    section = job.setdefault(new[0], {})
    if len(new) == 1:
        job[new[0]] = value
    else:
        section[new[1]] = value
    new_name = ".".join(new)
    with pytest.raises(ValueError, match=rf"cluster.{old} and {new_name} are both set, but cluster.{old} is the "
                                         rf"old name of {new_name}: keep only {new_name}$") as err:
        JobConfig.from_dict(job)
    assert "\n" not in str(err.value)


def test_old_keys_keep_the_defaults_and_checks_of_their_new_places(tmp_path, caplog):
    """The cross-section checks see the moved keys."""
    with caplog.at_level(logging.WARNING, logger="vela_ray.config"):
        config = JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out", cluster={"num_masters": 2}))
    assert config.masters.count == 2
    config = JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out", cluster={"num_masters": 2,
                                                                               "transport": "collective"}))
    assert (config.masters.count, config.data_plane.transport) == (2, "collective")
    with pytest.raises(ValueError, match=r"training.method: zo and several master processes .* do not combine"):
        JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out", cluster={"num_masters": 2},
                                     training={"method": "zo"}))
    with pytest.raises(ValueError, match=r"masters.sequence_migration moves sequences between masters: set "
                                         r"masters.count above 1"):
        JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out", cluster={"sequence_migration": True}))


def test_a_misspelt_old_key_is_pointed_to_its_new_place(tmp_path):
    with pytest.raises(ValueError, match=r"cluster.tranport: unknown field \(did you mean 'data_plane.transport'\?\)"):
        JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out", cluster={"tranport": "object_ref"}))


def test_config_strings_become_runtime_objects_through_one_translation_each(tmp_path):
    from vela_ray.model.dtypes import torch_dtype
    from vela_ray.model.experts import LoraSpec

    config = JobConfig.from_dict(job_dict(tmp_path, tmp_path / "out", model={"dtype": "bfloat16"},
                                          lora={"r": 4, "alpha": 8}))
    assert config.torch_dtype is torch_dtype("bfloat16") is torch.bfloat16
    assert config.lora_spec == LoraSpec(r=4, alpha=8.0)
    assert torch_dtype(torch.float16) is torch.float16  # a torch dtype (a checkpoint's config) passes through
    with pytest.raises(ValueError, match=r"dtype 'int4' is not one vela-ray knows: use one of float32, bfloat16"):
        torch_dtype("int4")


def test_every_refusal_is_declared_by_its_feature_and_listed_in_the_readme():
    """Combinations that do not work are declared by the section of the feature that cannot combine (`Refusal`),
    at most 8 of them, each in README's "What does not combine" with its reason."""
    from vela_ray.config import JobConfig, _Section

    def sections(cls):
        return [cls, *(s for sub in cls.__subclasses__() for s in sections(sub))]
    declared = [(cls.__name__, r) for cls in sections(_Section) for r in cls.refusals]
    assert 0 < len(declared) <= 8
    assert not JobConfig.__dict__.get("_tensor_parallel_where_it_runs")  # no central list left
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme[readme.index("### What does not combine"):]
    for owner, refusal in declared:
        assert refusal.settings in table and refusal.why in table, (owner, refusal.settings)
