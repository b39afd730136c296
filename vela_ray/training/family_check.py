"""Which model families vela-ray may train here, and the check that lets in a family the suite never ran.

vela-ray trains a family only where its numbers are shown equal to plain transformers + peft:

- **verified by the test suite**: the family is in `verified_families.json`, the families
  tests/unit/test_every_family.py trained equal to peft at the pinned transformers and peft
  (constraints.txt), and those exact versions are installed here;
- **verified at preflight**: any other family (a newer transformers, a family registered by the
  user's own code) is checked before Ray starts on a debug-size copy of its own architecture
  (`families.debug_config_like`): a few steps of vela-ray against plain peft in one process, and
  the exported adapter reloaded by peft. Equal: the run goes on and its summary says how the family
  was verified. Not equal, or not buildable: refused in one line with the reason.

`make lock` rewrites `verified_families.json` with constraints.txt; tests/unit/test_family_checks.py
holds the two to the installed versions.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Iterator, Literal

import torch
from pydantic import BaseModel, ConfigDict
from transformers import PretrainedConfig

from vela_ray.errors import first_line

logger = logging.getLogger(__name__)

VERIFIED_FILE = Path(__file__).with_name("verified_families.json")
CHECK_STEPS = 3


class VerifiedFamilies(BaseModel):
    """The families the test suite verified, and the versions it verified them on."""

    model_config = ConfigDict(extra="forbid")

    transformers: str
    peft: str
    trained: list[str]
    refused: dict[str, str]

    def covers_installed(self) -> bool:
        """Whether the installed transformers and peft are the versions the suite ran on."""
        return (version("transformers"), version("peft")) == (self.transformers, self.peft)


@functools.cache
def _read_tested(path: Path) -> VerifiedFamilies:
    return VerifiedFamilies.model_validate_json(path.read_text())


def verified_families() -> VerifiedFamilies:
    return _read_tested(VERIFIED_FILE)


class FamilyCheck(BaseModel):
    """How a model's family was verified equal to peft (what the run summary records)."""

    model_config = ConfigDict(extra="forbid")

    model_type: str
    verified_by: Literal["test suite", "preflight"]
    detail: str

    def describe(self) -> str:
        return f"{self.model_type}: verified by the {self.verified_by} ({self.detail})"


def suite_verified(model_type: str) -> bool:
    """True when the test suite trained `model_type` equal to peft on the transformers and peft installed."""
    tested = verified_families()
    return tested.covers_installed() and model_type in tested.trained


def check_family(config: PretrainedConfig, steps: int = CHECK_STEPS) -> FamilyCheck:
    """The family of `config` verified (by the suite, else now on a debug-size copy), or ValueError
    naming the family and why vela-ray will not train it."""
    model_type = config.model_type
    tested = verified_families()
    if suite_verified(model_type):
        return FamilyCheck(model_type=model_type, verified_by="test suite",
                           detail=f"transformers {tested.transformers}, peft {tested.peft}")
    why = (f"not in the tested set of transformers {tested.transformers}" if tested.covers_installed()
           else f"transformers {version('transformers')}, peft {version('peft')} here; the suite ran "
                f"transformers {tested.transformers}, peft {tested.peft}")
    logger.info("family %s (%s): checking a debug-size copy against peft", model_type, why)
    detail = verify_against_peft(config, steps)
    return FamilyCheck(model_type=model_type, verified_by="preflight", detail=f"{why}; {detail}")


def verify_against_peft(config: PretrainedConfig, steps: int = CHECK_STEPS) -> str:
    """Train a debug-size copy of `config`'s architecture with vela-ray and with plain peft for `steps`
    steps and reload vela-ray's exported adapter in peft. Returns what was shown; ValueError (one line,
    the family and the first difference) when the two differ or the copy cannot be built."""
    with _quiet_debug_copy():
        pair, make_model, vocab = _build_pair_like(config)
        _compare_training(config.model_type, pair, steps, vocab)
        _compare_export(config.model_type, pair, make_model, vocab)
    return f"{steps} steps on a debug-size copy equal to peft, exported adapter reloads"


def _build_pair_like(config: PretrainedConfig):
    """The equivalence pair of a debug-size copy of `config`; ValueError naming what stopped it."""
    from vela_ray.model.families import debug_config_like, seeded_model
    from vela_ray.training.equivalence import build_pair

    family = config.model_type
    try:
        debug = debug_config_like(config)
        make_model = functools.partial(seeded_model, debug)
        return build_pair(make_model), make_model, debug.get_text_config().vocab_size
    except ValueError as err:  # vela-ray's own refusal of the architecture, with its reason
        raise ValueError(f"family {family}: {first_line(err)}") from None
    except Exception as err:  # noqa: BLE001 - anything else: the copy cannot be checked, so it is not trained
        raise ValueError(f"family {family}: its debug-size copy cannot be built to check it against peft "
                         f"({type(err).__name__}: {first_line(err)}); vela-ray trains only families it has "
                         "shown equal to peft") from None


def _compare_training(family: str, pair, steps: int, vocab: int) -> None:
    from vela_ray.training.equivalence import LOSS_RTOL, run_both

    ref_losses, vela_losses = run_both(pair, steps, vocab)
    for step, (ref, vela) in enumerate(zip(ref_losses, vela_losses)):
        if not abs(vela - ref) <= LOSS_RTOL * abs(ref):
            raise ValueError(f"family {family}: vela-ray's math differs from peft's on a debug-size copy (step "
                             f"{step} loss {vela:.6g}, peft {ref:.6g}); vela-ray does not train a family "
                             "approximately")


def _compare_export(family: str, pair, make_model, vocab: int) -> None:
    from vela_ray.training.equivalence import LOSS_RTOL, held_out_loss, reloaded_export

    with tempfile.TemporaryDirectory(prefix="vela-check-") as out:
        want = float(held_out_loss(pair.master.peft_model, vocab))
        got = float(held_out_loss(reloaded_export(pair, make_model, out), vocab))
    if not abs(got - want) <= LOSS_RTOL * abs(want):
        raise ValueError(f"family {family}: vela-ray's exported adapter does not reproduce its model in peft "
                         f"(held-out loss {got:.6g} vs {want:.6g}); vela-ray would write a wrong adapter")


@contextlib.contextmanager
def _quiet_debug_copy() -> Iterator[None]:
    """Debug-size models: one intra-op thread is faster than several and leaves the machine alone. What the
    debug copy makes transformers and vela-ray log (shrunk RoPE ranges, layers left frozen) is not about
    the user's model, so it is held back; the real model logs its own when it loads."""
    import transformers

    threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    adapters_log = logging.getLogger("vela_ray.model.adapters")
    adapters_level = adapters_log.level
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    adapters_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        transformers.logging.set_verbosity(verbosity)
        adapters_log.setLevel(adapters_level)


def write_verified_families(path: Path = VERIFIED_FILE) -> VerifiedFamilies:
    """Record the installed transformers' families as vela-ray trains or refuses them (`make lock`)."""
    from vela_ray.model.families import family_support

    support = family_support()
    tested = VerifiedFamilies(transformers=version("transformers"), peft=version("peft"),
                            trained=sorted(f for f, reason in support.items() if reason is None),
                            refused={f: reason for f, reason in sorted(support.items()) if reason is not None})
    path.write_text(json.dumps(tested.model_dump(), indent=1) + "\n")
    _read_tested.cache_clear()
    return tested


if __name__ == "__main__":  # python -m vela_ray.training.family_check: rewrite verified_families.json
    import transformers

    logging.basicConfig(level=logging.INFO)
    transformers.logging.set_verbosity_error()  # debug-size configs: their shrunk RoPE ranges are not news
    written = write_verified_families()
    print(f"{VERIFIED_FILE}: {len(written.trained)} trained, {len(written.refused)} refused "
          f"(transformers {written.transformers}, peft {written.peft})")
