"""Families verified where they are used: the tested set, and preflight's check of any other family.

A family the test suite did not verify at the installed transformers and peft (a newer release, or a
model class registered by the user's own code) is trained only after preflight showed a debug-size
copy of it equal to plain peft; one whose math vela-ray cannot reproduce is refused before Ray starts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

from tests.fixtures import KNOWN_FAILURES, REFUSED, job_dict, write_job
from vela_ray.api import VelaJob
from vela_ray.config import JobConfig
from vela_ray.model.families import mixtral_debug, seeded_model
from vela_ray.paths import data_dir
from vela_ray.training import family_check
from vela_ray.training.family_check import VerifiedFamilies, check_family, verified_families
from vela_ray.training.tiny_model import train_tokenizer

CONSTRAINTS = Path(__file__).resolve().parents[2] / "constraints.txt"


def _pinned(package: str) -> str:
    return re.search(rf"^{package}==(\S+)$", CONSTRAINTS.read_text(), re.M).group(1)


def test_the_tested_set_records_the_pinned_versions():
    tested = verified_families()
    assert (tested.transformers, tested.peft) == (_pinned("transformers"), _pinned("peft"))


def test_the_tested_set_is_what_the_suite_trains_at_the_pinned_versions():
    """`make lock` rewrites both files; this holds them together (at the pins, the suite's own install)."""
    from vela_ray.model.families import family_support

    if (version("transformers"), version("peft")) != (_pinned("transformers"), _pinned("peft")):
        pytest.skip("not the pinned transformers/peft (make test-latest): the tested set is the pins' own")
    support = family_support()
    assert set(verified_families().trained) == {f for f, why in support.items() if why is None} - set(KNOWN_FAILURES)
    assert set(verified_families().refused) == set(REFUSED)


# --- a family outside the tested set, from the user's own code --------------------------------------------


class RenamedMixtralConfig(MixtralConfig):
    """Mixtral under a name no transformers release has: a family the suite never saw, same math."""

    model_type = "mixtral_renamed"


class RenamedMixtral(MixtralForCausalLM):
    config_class = RenamedMixtralConfig


class RowCoupledMixtralConfig(MixtralConfig):
    model_type = "mixtral_row_coupled"


class RowCoupledSiLU(torch.nn.Module):
    """SiLU scaled by the mean over every row of the call: peft sees a layer's rows in one call, a vela-ray
    shard only the rows routed to its experts, so the two compute different numbers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x) * (1 + 0.5 * torch.tanh(x.mean(0, keepdim=True)))


class RowCoupledMixtral(MixtralForCausalLM):
    """A debug family whose experts' gate is injected with a change vela-ray cannot reproduce."""

    config_class = RowCoupledMixtralConfig

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.mlp.experts.act_fn = RowCoupledSiLU()


@pytest.fixture(scope="module", autouse=True)
def _user_families():
    for config_class, model_class in ((RenamedMixtralConfig, RenamedMixtral),
                                      (RowCoupledMixtralConfig, RowCoupledMixtral)):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)


def _user_config(config_class, **overrides) -> MixtralConfig:
    """The debug Mixtral's values under `config_class` (and its model_type)."""
    values = {k: v for k, v in mixtral_debug(**overrides).to_dict().items() if k != "model_type"}
    return config_class(**values)


def test_a_family_outside_the_tested_set_is_verified_at_preflight():
    check = check_family(_user_config(RenamedMixtralConfig))
    assert check.verified_by == "preflight"
    assert "not in the tested set" in check.detail and "equal to peft" in check.detail


def test_a_family_whose_math_differs_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"family mixtral_row_coupled: vela-ray's math differs from peft's on a "
                                         r"debug-size copy \(step 0 loss"):
        check_family(_user_config(RowCoupledMixtralConfig))


def test_a_tested_family_costs_no_check(monkeypatch):
    def no_check(*args, **kwargs):
        raise AssertionError("a family the suite verified was checked again")

    monkeypatch.setattr(family_check, "verify_against_peft", no_check)
    assert check_family(mixtral_debug()).verified_by == "test suite"


def test_another_transformers_than_the_suite_ran_checks_every_family(tmp_path, monkeypatch):
    record = verified_families().model_dump()
    record["transformers"] = "0.0.1"
    monkeypatch.setattr(family_check, "VERIFIED_FILE", _write(tmp_path / "tested.json", record))
    check = check_family(mixtral_debug())
    assert check.verified_by == "preflight"
    assert f"transformers {version('transformers')}" in check.detail and "transformers 0.0.1" in check.detail


def _write(path: Path, record: dict) -> Path:
    path.write_text(json.dumps(VerifiedFamilies(**record).model_dump()))
    return path


def _user_checkpoint(model_class, config_class, out: Path) -> Path:
    text = (data_dir() / "tinyshakespeare" / "input.txt").read_text()[:100_000]
    tokenizer = train_tokenizer(text, 256)
    model = seeded_model(_user_config(config_class, vocab_size=len(tokenizer)))
    assert type(model) is model_class
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_a_job_on_a_family_whose_math_differs_is_refused_before_ray_starts(tmp_path):
    model_dir = _user_checkpoint(RowCoupledMixtral, RowCoupledMixtralConfig, tmp_path / "model")
    config = JobConfig.from_dict(job_dict(model_dir, tmp_path / "out"))
    with pytest.raises(ValueError, match=rf"^model.path {re.escape(str(model_dir))}: family mixtral_row_coupled: "
                                         r"vela-ray's math differs from peft's"):
        VelaJob(config)  # preflight, in the constructor: Ray starts only in run()
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_preflight_records_how_the_family_was_verified(tmp_path):
    model_dir = _user_checkpoint(RenamedMixtral, RenamedMixtralConfig, tmp_path / "model")
    checked = JobConfig.from_dict(job_dict(model_dir, tmp_path / "out")).preflight()
    assert checked.family.startswith("mixtral_renamed: verified by the preflight (not in the tested set")
    assert checked.config.family_check == checked.family
    pinned = checked.config.model_copy(update={"cluster": checked.config.cluster})  # what the driver does
    assert pinned.family_check == checked.family
    assert JobConfig.from_dict(checked.config.model_dump(mode="json")).family_check is None  # not a YAML field


def test_vela_families_says_how_each_family_is_verified(capsys):
    from vela_ray.cli import main

    assert main(["families"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    for family in verified_families().trained:
        assert any(line.split()[0] == family and "verified by the test suite" in line for line in lines), family


# --- a model that comes with its own code (config.json's auto_map) -----------------------------------------

REMOTE_CONFIG = '''from transformers import MixtralConfig


class RemoteMixtralConfig(MixtralConfig):
    model_type = "mixtral_remote"
'''
REMOTE_MODELING = '''from transformers import MixtralForCausalLM

from .configuration_mixtral_remote import RemoteMixtralConfig


class RemoteMixtralForCausalLM(MixtralForCausalLM):
    config_class = RemoteMixtralConfig
'''


def remote_code_checkpoint(out: Path) -> Path:
    """A debug Mixtral saved with its own configuration and modeling files, as hub models with custom code
    are: config.json names them in auto_map, and only `trust_remote_code` runs them."""
    from tests.fixtures import make_checkpoint

    make_checkpoint(out, "mixtral")
    # its own code has no transformers conversion mapping: its weights are stored under the model's own names
    state = AutoModelForCausalLM.from_pretrained(out).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "configuration_mixtral_remote.py").write_text(REMOTE_CONFIG)
    (out / "modeling_mixtral_remote.py").write_text(REMOTE_MODELING)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="mixtral_remote", architectures=["RemoteMixtralForCausalLM"], auto_map={
        "AutoConfig": "configuration_mixtral_remote.RemoteMixtralConfig",
        "AutoModelForCausalLM": "modeling_mixtral_remote.RemoteMixtralForCausalLM"})
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.job
def test_a_model_with_its_own_code_needs_trust_remote_code_said_in_one_line(tmp_path):
    """`vela train` in a fresh process (this one may have registered the code already, as a trusting job
    does): one line naming the field, before Ray starts."""
    model_dir = remote_code_checkpoint(tmp_path / "model")
    job = write_job(tmp_path / "job.yaml", job_dict(model_dir, tmp_path / "out"))
    result = subprocess.run([sys.executable, "-m", "vela_ray.cli", "train", "--config", str(job)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert re.fullmatch(r"vela train: error: model.path .*: the model comes with its own code \(config.json's auto_map\); set "
                        r"model.trust_remote_code: true to run it .*\n", result.stderr), result.stderr
    assert "Started a local Ray instance" not in result.stderr + result.stdout


def test_a_model_with_its_own_code_is_checked_at_preflight(tmp_path):
    model_dir = remote_code_checkpoint(tmp_path / "model")
    job = job_dict(model_dir, tmp_path / "out", model={"trust_remote_code": True})
    checked = JobConfig.from_dict(job).preflight()
    assert checked.family.startswith("mixtral_remote: verified by the preflight (not in the tested set")
    assert checked.model.num_experts == 6
