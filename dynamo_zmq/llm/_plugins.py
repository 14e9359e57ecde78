"""Plugins: what other packages add to the worker and the frontend, found by entry point.

The core names none of them. A package registers, in its ``pyproject.toml``:

- ``dynamo_zmq.engines``: an ``LLMEngine`` subclass (``python -m dynamo_zmq.worker --engine NAME``);
- ``dynamo_zmq.routers``: a ``RouterPlugin`` subclass, the name being a frontend router mode
  (``python -m dynamo_zmq.frontend --router-mode NAME``);
- ``dynamo_zmq.tokenizers``: a native tokenizer class (``NativeTokenizer`` protocol) an engine
  names in its ``EngineConfig.extra["native_tokenizer"]`` when it asks for native processing.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from ..errors import InvalidArgument

__all__ = ["ENGINES", "ROUTERS", "TOKENIZERS", "load_plugin", "plugin_names"]

ENGINES = "dynamo_zmq.engines"
ROUTERS = "dynamo_zmq.routers"
TOKENIZERS = "dynamo_zmq.tokenizers"


def _entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}


def plugin_names(group: str) -> list[str]:
    """The names registered in ``group``, sorted."""
    return sorted(_entry_points(group))


def load_plugin(group: str, name: str) -> Any:
    """The object registered as ``name`` in ``group``.

    Raises:
        InvalidArgument: nothing is registered under that name, or it does not import.
    """
    found = _entry_points(group)
    if name not in found:
        known = ", ".join(sorted(found)) or "none installed"
        raise InvalidArgument(f"no {group} plugin {name!r} (known: {known})")
    try:
        return found[name].load()
    except (ImportError, AttributeError) as exc:
        raise InvalidArgument(f"cannot load {group} plugin {name!r}: {exc}") from exc
