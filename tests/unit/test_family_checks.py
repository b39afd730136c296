"""Families verified where they are used: the tested set, and preflight's check of any other family.

A family the test suite did not verify at the installed transformers and peft (a newer release, or a
model class registered by the user's own code) is trained only after preflight showed a debug-size
copy of it equal to plain peft; one whose math vela-ray cannot reproduce is refused before Ray starts.
"""

from __future__ import annotations

import json
import re
from importlib.metadata import version
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

from tests.fixtures import KNOWN_FAILURES, REFUSED, job_dict
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
    assert not ray.is_initialized()
    with pytest.raises(ValueError, match=rf"^model.path {re.escape(str(model_dir))}: family mixtral_row_coupled: "
                                         r"vela-ray's math differs from peft's"):
        VelaJob(config)
    assert not ray.is_initialized()
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
