"""Helpers are objects their owner hands what they need (issue 32, item 5): no module reaches
into another module's private state, and no two modules import each other behind
``TYPE_CHECKING`` or inside a function (a cycle the import system would refuse at the top).

Both checks read the source (``ast``), so they are approximations, on the safe side of useful:

* ``other._name`` (``other`` a plain name, not ``self`` or ``cls``; ``_name`` not a dunder) is a
  reach when a class of another module of the same package assigns ``self._name`` or defines a
  method ``_name``, and no class of the module itself does (it may be its own object's).
* A module's deferred imports (under ``if TYPE_CHECKING:`` or inside a function) must not name a
  module of the same package that imports it back, deferred or not.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dynamo_zmq", "router", "engines")


def _modules() -> dict[str, ast.Module]:
    """Every module of the packages, by dotted name (a package by its own name)."""
    found: dict[str, ast.Module] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return found


def _owned_privates(tree: ast.Module) -> set[str]:
    """Private names a class of the module owns: ``self._x = ...`` and ``def _x``."""
    owned: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if node in cls.body and _private(node.name):
                    owned.add(node.name)
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                            and sub.value.id == "self" and _private(sub.attr)):
                        owned.add(sub.attr)
    return owned


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _reaches(tree: ast.Module) -> Iterator[tuple[int, str, str]]:
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id not in ("self", "cls")):
            yield node.lineno, node.value.id, node.attr


def private_reaches(modules: dict[str, ast.Module]) -> list[str]:
    """``module:line: other._name`` for each reach into another module's private state."""
    owned = {name: _owned_privates(tree) for name, tree in modules.items()}
    found = []
    for name, tree in modules.items():
        pkg = name.split(".")[0]
        for line, obj, attr in _reaches(tree):
            if attr in owned[name]:
                continue
            owners = sorted(other for other, names in owned.items()
                            if other != name and other.split(".")[0] == pkg and attr in names)
            if owners:
                found.append(f"{name}:{line}: {obj}.{attr} (owned in {', '.join(owners)})")
    return found


def _imports(name: str, tree: ast.Module, modules: dict[str, ast.Module],
             is_package: bool) -> Iterator[tuple[str, bool]]:
    """``(module, deferred)`` for each module of the packages that ``name`` imports."""
    deferred_nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            deferred_nodes.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            deferred_nodes.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    here = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
            targets = [stem, *(f"{stem}.{alias.name}" for alias in node.names)]
        for target in targets:
            if target in modules and target != name:
                yield target, id(node) in deferred_nodes


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def deferred_cycles(modules: dict[str, ast.Module]) -> list[str]:
    """``a -> b`` for each deferred import of ``b`` by ``a`` where ``b`` imports ``a``."""
    packages = {name for name in modules
                if (ROOT / Path(*name.split(".")) / "__init__.py").exists()}
    edges = {name: dict(_imports(name, tree, modules, name in packages))
             for name, tree in modules.items()}
    found = []
    for a, targets in edges.items():
        for b, deferred in targets.items():
            if deferred and a in edges[b] and not _contains(b, a) and not _contains(a, b):
                found.append(f"{a} -> {b} (deferred; {b} imports {a})")
    return sorted(found)


def _contains(pkg: str, module: str) -> bool:
    """A package and its own submodules import each other by design (re-exports)."""
    return module.startswith(pkg + ".")


def test_no_module_reaches_into_another_modules_private_state() -> None:
    found = private_reaches(_modules())
    assert not found, "private state reached across modules:\n" + "\n".join(found)


def test_no_deferred_import_cycles() -> None:
    found = deferred_cycles(_modules())
    assert not found, "modules importing each other:\n" + "\n".join(found)
