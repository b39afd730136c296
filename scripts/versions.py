"""What `make test-latest` tests: the installed releases against the pins, and the families they bring.

    .venv-latest/bin/python scripts/versions.py

Prints each pinned package whose installed version differs from constraints.txt, then the MoE
families of the installed transformers that the pinned one did not have (or had and lost), and
which of them vela-ray trains (checked at preflight, since the suite never verified them) or refuses.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WATCHED = ("torch", "transformers", "peft", "ray", "datasets", "cvxpy", "highspy", "numpy", "pydantic",
           "safetensors", "accelerate", "tokenizers", "pytest")


def pins() -> dict[str, str]:
    text = (ROOT / "constraints.txt").read_text()
    return {name.lower(): pinned for name, pinned in re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", text, re.M)}


def main() -> int:
    pinned = pins()
    for package in WATCHED:
        try:
            installed = version(package).split("+")[0]
        except PackageNotFoundError:
            installed = "not installed"
        mark = "" if installed == pinned.get(package) else "   <- differs from the pin"
        print(f"{package:<13} pinned {pinned.get(package, '-'):<10} installed {installed}{mark}")

    sys.path.insert(0, str(ROOT))
    import transformers

    transformers.logging.set_verbosity_error()  # debug-size configs: their shrunk RoPE ranges are not news
    from vela_ray.model.families import family_support
    from vela_ray.training.family_check import verified_families

    recorded = verified_families()
    known = set(recorded.trained) | set(recorded.refused)
    support = family_support()
    for family in sorted(set(support) - known):
        why = support[family]
        print(f"new family {family}: " + ("trained after a preflight check" if why is None else f"refused: {why}"))
    for family in sorted(known - set(support)):
        print(f"family {family} (transformers {recorded.transformers}) is gone")
    for family in sorted(set(support) & known):
        if (support[family] is None) != (family in recorded.trained):
            print(f"family {family} changed: " + ("now trained" if support[family] is None
                                                  else f"now refused: {support[family]}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
