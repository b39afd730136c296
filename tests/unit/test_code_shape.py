"""The code keeps the shape issue 32 gave it: a short runner over stage objects, classes about one thing,
state set where it is declared, and protocols instead of duck typing. Read with `ast`, not imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER_MAX_LINES = 250
# An actor's class too (`ExpertManager`): Ray calls it by method name, so its remote surface stays small by
# one call per concept, with the work behind the calls in the delegates it holds.
PUBLIC_METHODS_MAX = 20
STATE_PACKAGES = ["vela_ray/runtime", "vela_ray/training", "vela_ray/model"]
RECORDS = {"state"}  # run-state records that the stages fill by design (`runtime.state.RunState`)
# transformers' objects, whose members differ by family and which vela-ray rewires: not vela-ray's protocols
THIRD_PARTY = {"self.module",  # `model.experts.ExpertShard` wraps a transformers experts module
               "block.block.experts"}  # `model.modeling.attach_brokers` puts a broker in a decoder block


def _files(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def _classes(path: Path) -> list[ast.ClassDef]:
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]


def _methods(cls: ast.ClassDef) -> list[ast.FunctionDef]:
    return [f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _is_property(method: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).split(".")[0] in ("property", "cached_property") or ast.unparse(d).endswith(".setter")
               for d in method.decorator_list)


def _self_attributes_assigned(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else \
            [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                    names.add(part.attr)
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def test_the_runner_is_a_short_driver():
    lines = len((ROOT / "vela_ray/runtime/runner.py").read_text().splitlines())
    assert lines <= RUNNER_MAX_LINES, f"runner.py has {lines} lines: move a stage out (vela_ray/runtime/)"


@pytest.mark.parametrize("package", ["vela_ray", "actors", "placement"])
def test_no_class_has_more_than_twenty_public_methods(package):
    counts = {f"{path.relative_to(ROOT)}:{cls.name}": sum(not m.name.startswith("_") and not _is_property(m)
                                                          for m in _methods(cls))
              for path in _files(package) for cls in _classes(path)}
    big = {name: count for name, count in counts.items() if count > PUBLIC_METHODS_MAX}
    assert not big, f"classes doing too many jobs (give parts to delegates): {big}"


def test_attributes_are_set_first_in_init():
    late = []
    for path in _files(*STATE_PACKAGES):
        for cls in _classes(path):
            declared = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            declared |= {t.id for s in cls.body if isinstance(s, ast.Assign) for t in s.targets
                         if isinstance(t, ast.Name)}
            inits = [m for m in _methods(cls) if m.name in ("__init__", "__post_init__")]
            declared |= set().union(*map(_self_attributes_assigned, inits)) if inits else set()
            late += [f"{path.relative_to(ROOT)}:{cls.name}.{m.name} sets self.{name}"
                     for m in _methods(cls) if m not in inits
                     for name in sorted(_self_attributes_assigned(m) - declared)]
    assert not late, f"attributes first set outside __init__ (declare them there, None when absent): {late}"


def test_no_getattr_default_stands_in_for_a_protocol_member():
    found = [f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}"
             for path in _files(*STATE_PACKAGES) for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and (node.func.id, len(node.args)) in (("getattr", 3), ("hasattr", 2))
             and isinstance(root := _root(node.args[0]), ast.Name) and root.id == "self"
             and ast.unparse(node.args[0]) not in THIRD_PARTY]
    assert not found, f"duck typing on vela-ray's own objects (add the member to the class or protocol): {found}"


def test_no_attribute_is_set_on_a_collaborator_from_outside():
    found = []
    for path in _files(*STATE_PACKAGES):
        for node in ast.walk(ast.parse(path.read_text())):
            for target in node.targets if isinstance(node, ast.Assign) else []:
                owner = target.value if isinstance(target, ast.Attribute) else None
                if isinstance(owner, ast.Attribute) and owner.attr not in RECORDS \
                        and ast.unparse(target) not in THIRD_PARTY:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(target)}")
    assert not found, f"attributes set on another object's collaborator (give it a method): {found}"
