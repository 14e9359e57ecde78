"""No test module imports from another test module: helpers that tests share live in
``tests/support/`` (importing a ``tests.test_x`` module runs its module-level code wherever it
is imported, and ties one test file's edits to another's)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _test_imports(path: Path) -> set[str]:
    """The ``tests.test_*`` modules ``path`` imports: with ``import``, with ``from`` naming the
    test module or naming ``tests`` and importing it from there, and the relative forms."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:  # a test module's package is tests
                module = f"tests.{module}" if module else "tests"
            names = ([f"{module}.{alias.name}" for alias in node.names]
                     if module == "tests" else [module])
        else:
            continue
        found.update(n for n in names if n.startswith("tests.test_"))
    return found


def _offenders(tests: Path = TESTS) -> dict[str, set[str]]:
    """Each ``test_*.py`` directly in ``tests`` that imports a test module: what it imports."""
    found = {path.name: _test_imports(path) for path in sorted(tests.glob("test_*.py"))}
    return {name: imported for name, imported in found.items() if imported}


def test_no_test_module_imports_another():
    offenders = _offenders()
    assert not offenders, (
        "test modules import from other test modules; move the shared helpers to "
        f"tests/support/: {offenders}")


def test_the_check_sees_every_form_of_import(tmp_path):
    """The scan itself, on test files of its own (spelt so that a grep for such imports in
    tests/ finds none here)."""
    pkg = "tests"
    (tmp_path / "test_a.py").write_text(f"from {pkg}.test_b import helper\n")
    (tmp_path / "test_b.py").write_text(f"import {pkg}.test_c as c\nimport os\n")
    (tmp_path / "test_c.py").write_text(
        "def f():\n    from tests import test_a, support\n    from .test_b import x\n")
    (tmp_path / "test_d.py").write_text(
        "from tests.support.waiting import eventually\nimport tests.support.procs\n"
        "from tests import conftest\n")
    assert _offenders(tmp_path) == {
        "test_a.py": {"tests.test_b"},
        "test_b.py": {"tests.test_c"},
        "test_c.py": {"tests.test_a", "tests.test_b"},
    }
