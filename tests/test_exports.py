"""Every package's public names: ``__all__`` lists exactly what the package exposes, sorted.

The order is ruff's (RUF022, isort style): CONSTANTS, then Classes, then functions and modules,
each group alphabetical.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

PACKAGES = [
    "dynamo_zmq",
    "dynamo_zmq.discovery",
    "dynamo_zmq.frontend",
    "dynamo_zmq.kv_transfer",
    "dynamo_zmq.llm",
    "dynamo_zmq.llm.parsers",
    "dynamo_zmq.runtime",
    "dynamo_zmq.tools",
    "dynamo_zmq.transport",
    "dynamo_zmq.worker",
    "engines",
    "engines.mocker",
    "engines.vllm",
    "router",
]


def _order(name: str) -> tuple[int, str]:
    if name.upper() == name:
        return 0, name
    return (1 if name[0].isupper() else 2), name


@pytest.mark.parametrize("package", PACKAGES)
def test_all_is_sorted_and_lists_every_public_name(package: str) -> None:
    mod = importlib.import_module(package)
    exported = mod.__all__
    assert exported == sorted(exported, key=_order), f"{package}.__all__ is not sorted"
    assert len(set(exported)) == len(exported), f"{package}.__all__ repeats a name"
    missing = [name for name in exported if not hasattr(mod, name)]
    assert not missing, f"{package}.__all__ names what it does not define: {missing}"
    public = {
        name
        for name, value in vars(mod).items()
        if not name.startswith("_")
        and name != "annotations"
        # Submodules appear as attributes once imported; only re-exported ones count.
        and not (inspect.ismodule(value) and name not in exported)
    }
    assert public == set(exported), f"{package}: public but not in __all__: " + str(
        sorted(public - set(exported))
    )


def test_a_dynamo_worker_ports_by_changing_its_import() -> None:
    """The names Dynamo's Python workers import from ``dynamo.runtime`` are at the root too."""
    import dynamo_zmq
    import dynamo_zmq.runtime as runtime

    for name in ("DistributedRuntime", "dynamo_worker", "dynamo_endpoint", "Context", "Client"):
        assert getattr(dynamo_zmq, name) is getattr(runtime, name)
