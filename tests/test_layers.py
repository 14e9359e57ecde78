"""The layer picture of docs/architecture.md ("Layers"), held against the imports: every import
inside ``dynamo_zmq`` goes to a lower layer (``TYPE_CHECKING`` and function-local imports
count too), and the core never imports its plugins (``engines/``, ``router/``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dynamo_zmq"

#: Each unit of the package (a subpackage or a top-level module) and its layer, lowest first:
#: the picture in docs/architecture.md, row by row.
LAYERS: dict[str, int] = {
    # bottom
    "wire": 0, "errors": 0, "context": 0, "resources": 0, "histogram": 0, "tracing": 0,
    # transport
    "transport": 1, "discovery": 1,
    # runtime
    "runtime": 2, "kv_transfer": 2,
    # LLM
    "llm": 3,
    # processes and tools
    "worker": 4, "frontend": 4, "tools": 4, "testing": 4, "_conformance_checks": 4,
    # entry points and the package's own re-exports
    "__init__": 5, "__main__": 5, "demo": 5, "keys": 5, "quickstart": 5, "status": 5,
}
#: Imports between units of one layer that the picture allows (importer, imported).
SAME_LAYER = {("testing", "_conformance_checks")}
PLUGINS = ("engines", "router")


def _module_parts(path: Path, root: Path) -> tuple[list[str], bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return parts[:-1], True
    return parts, False


def _imports(path: Path, root: Path) -> set[str]:
    """Every module ``path`` imports, as absolute dotted names."""
    parts, is_package = _module_parts(path, root)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts if is_package else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if node.module is None or module == "dynamo_zmq":  # from . import x: x may be a module
                found.update(f"{module}.{alias.name}" for alias in node.names)
            else:
                found.add(module)
    return found


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _edges(package: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """(importer unit, imported unit) -> the files with such an import."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        parts, _ = _module_parts(path, package.parent)
        me = _unit(".".join(parts))
        for module in _imports(path, package.parent):
            if module.split(".")[0] in PLUGINS:
                edges.setdefault((me, module.split(".")[0]), []).append(str(path))
            if module.startswith("dynamo_zmq.") and _unit(module) != me:
                edges.setdefault((me, _unit(module)), []).append(str(path))
    return edges


def test_every_unit_of_the_package_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert units == set(LAYERS), "add the new unit to LAYERS and to docs/architecture.md"


def test_imports_flow_down_the_layers():
    upward = {
        (a, b): files for (a, b), files in _edges().items()
        if b in LAYERS and LAYERS[b] >= LAYERS[a] and (a, b) not in SAME_LAYER
    }
    assert not upward, f"imports against the layer picture: {upward}"


def test_the_core_never_imports_its_plugins():
    found = {(a, b): files for (a, b), files in _edges().items() if b in PLUGINS}
    assert not found, found


def test_the_check_sees_upward_and_plugin_imports(tmp_path):
    """The scan itself, on a package of its own: relative, absolute and plugin imports."""
    package = tmp_path / "dynamo_zmq"
    (package / "tracing").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "tracing" / "__init__.py").write_text("from ._engine import x\n")
    (package / "tracing" / "_engine.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..llm import Request\n"
        "def f():\n    import router.kv_router\n    from dynamo_zmq import worker\n"
    )
    edges = _edges(package)
    assert {("tracing", "llm"), ("tracing", "router"), ("tracing", "worker")} <= set(edges)
    assert ("tracing", "tracing") not in edges
