"""Imports go one way: placement <- model <- data <- training <- observability/baselines <- runtime
<- actors <- api/cli, and nothing on the model side loads Ray.

Two checks: a static one over every `import` in the tree (function-level ones included), and
a fresh process that imports every model-side module and then looks at `sys.modules`.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each package may import from the layers below it (and itself), never from above.
LAYERS: list[list[str]] = [
    ["placement"],
    ["vela_ray.errors", "vela_ray.paths", "vela_ray.quiet"],
    ["vela_ray.model"],
    ["vela_ray.data"],
    ["vela_ray.training"],
    ["vela_ray.config", "vela_ray.preflight"],
    ["vela_ray.observability", "vela_ray.baselines"],
    ["vela_ray.runtime"],
    ["actors"],
    ["vela_ray.api", "vela_ray.cli", "vela_ray.demo"],
]
MODEL_SIDE = ["placement", "vela_ray.model", "vela_ray.data", "vela_ray.training", "vela_ray.observability",
              "vela_ray.baselines", "vela_ray.runtime", "vela_ray.config"]


def _layer_of(module: str) -> int | None:
    if module == "vela_ray":  # the package itself: its __init__ holds only the version
        return 1
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return None


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _sources() -> list[Path]:
    return sorted(p for pkg in ("placement", "vela_ray", "actors") for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_from_a_layer_above_its_own(path):
    module = _module_name(path)
    own = _layer_of(module)
    assert own is not None, f"{module} belongs to no layer: add its package to LAYERS"
    upward = sorted(name for name in _imports(path) if (_layer_of(name) or 0) > own)
    assert not upward, f"{module} (layer {own}) imports {upward} from above"


def test_model_side_modules_load_neither_ray_nor_actors():
    modules = sorted(_module_name(p) for p in _sources() if any(
        _module_name(p) == m or _module_name(p).startswith(m + ".") for m in MODEL_SIDE))
    code = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'actors'))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
