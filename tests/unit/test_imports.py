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
    ["vela_ray.errors", "vela_ray.paths", "vela_ray.progress", "vela_ray.quiet", "vela_ray.runs", "vela_ray.storage"],
    ["vela_ray.model"],
    ["vela_ray.data"],
    ["vela_ray.training"],
    ["vela_ray.config", "vela_ray.preflight"],
    ["vela_ray.observability", "vela_ray.baselines", "vela_ray.export", "vela_ray.generate"],
    ["vela_ray.runtime"],
    ["actors"],
    ["vela_ray.api", "vela_ray.cli", "vela_ray.demo", "vela_ray.local_ray"],
]
MODEL_SIDE = ["placement", "vela_ray.model", "vela_ray.data", "vela_ray.training", "vela_ray.observability",
              "vela_ray.baselines", "vela_ray.runtime", "vela_ray.config", "vela_ray.export", "vela_ray.generate"]


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


def _sources(packages: tuple[str, ...] = ("placement", "vela_ray", "actors")) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


# The circle finder also reads the scripts that import the library, which are in no layer: one benchmark
# that imports another is a module like any other, and a circle among them is read the same way.
SCRIPTS = ("benchmarks", "scripts", "deploy")


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_from_a_layer_above_its_own(path):
    module = _module_name(path)
    own = _layer_of(module)
    assert own is not None, f"{module} belongs to no layer: add its package to LAYERS"
    upward = sorted(name for name in _imports(path) if (_layer_of(name) or 0) > own)
    assert not upward, f"{module} (layer {own}) imports {upward} from above"


@pytest.mark.slow
def test_model_side_modules_load_neither_ray_nor_actors():
    modules = sorted(_module_name(p) for p in _sources() if any(
        _module_name(p) == m or _module_name(p).startswith(m + ".") for m in MODEL_SIDE))
    code = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'actors'))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


# The one circle left on purpose: `JobConfig.preflight()` hands the job to preflight, which reads the config.
ALLOWED_CIRCLES = [{"vela_ray.config", "vela_ray.preflight"}]


def _import_graph() -> dict[str, set[str]]:
    """{module: the modules of this tree it imports}, counting function-level and TYPE_CHECKING imports
    (a soft circle still means neither module can be read, or moved, without the other); the library's
    packages and `SCRIPTS`."""
    modules = {_module_name(p): p for p in _sources() + _sources(SCRIPTS)}

    def owner(name: str) -> str | None:  # `pkg.mod.Symbol` -> `pkg.mod`
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {o for o in map(owner, _imports(p)) if o and o != m} for m, p in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_but_config_and_preflight():
    circles = [c for c in _circles(_import_graph()) if c not in ALLOWED_CIRCLES]
    assert not circles, f"modules that import each other (move what both need into a module of its own): {circles}"


def test_the_import_graph_reads_the_benchmarks_imports():
    graph = _import_graph()
    assert "benchmarks._harness" in graph["benchmarks.vela_vs_ep"]
    assert "benchmarks.vela_vs_ep_report" in graph["benchmarks.vela_vs_ep"]  # `from benchmarks import module`
    assert "deploy.emulated_cluster" in graph["benchmarks.vela_vs_ep"]
    assert "benchmarks._harness" in graph["scripts.gpu_exactness"]


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
