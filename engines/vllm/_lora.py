"""The LoRA adapters a vLLM engine holds: name -> vLLM's ``LoRARequest``.

``LoraTable.load`` gives each adapter name an int id of its own (vLLM's ``lora_int_id``, never
reused within the engine) and asks vLLM to load it (``AsyncLLM.add_lora``, which loads the
weights in the engine core and fails on a bad path or an adapter that does not fit the model);
only then is the name recorded, so a failed load leaves nothing behind. ``unload`` forgets the
name and asks vLLM to drop the weights (``remove_lora``); a request already running with it
finishes (vLLM's requests carry their ``LoRARequest``). ``request(name)`` is what ``generate``
passes as ``lora_request=``; ``name_of(int_id)`` maps vLLM's ``lora_id`` in KV events back to
the adapter's name (``_edge.py``).

``--lora-modules NAME=PATH ...`` (vLLM's frontend flag, also its JSON form
``{"name": ..., "path": ...}``) names adapters loaded when the engine starts (``parse_modules``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Iterable
from typing import Any

from dynamo_zmq import errors

__all__ = ["LoraTable", "parse_modules"]

log = logging.getLogger("engines.vllm")


def parse_modules(items: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``--lora-modules`` values as (name, path) pairs, in order: ``NAME=PATH`` or vLLM's JSON
    form, an object with ``name`` and ``path`` (``base_model_name`` is accepted and ignored:
    a worker serves one base model). Empty items are skipped.

    Raises:
        InvalidArgument: an item in neither form, an empty name or path, a name given twice.
    """
    pairs: list[tuple[str, str]] = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        if "=" in item and not item.startswith(("{", "[")):
            name, path = (part.strip() for part in item.split("=", 1))
        else:
            try:
                data = json.loads(item)
            except ValueError as exc:
                raise errors.InvalidArgument(
                    f"--lora-modules: {item!r} is neither NAME=PATH nor JSON ({exc})") from exc
            if not isinstance(data, dict) or set(data) - {"name", "path", "base_model_name"}:
                raise errors.InvalidArgument(
                    f"--lora-modules: {item!r}: the JSON form is an object with \"name\" and "
                    "\"path\" (and optionally \"base_model_name\")")
            given = data.get("name"), data.get("path")
            if not all(isinstance(v, str) for v in given):
                raise errors.InvalidArgument(
                    f"--lora-modules: {item!r}: \"name\" and \"path\" must be strings")
            name, path = str(given[0]), str(given[1])
        if not name or not path:
            raise errors.InvalidArgument(f"--lora-modules: {item!r}: empty name or path")
        if any(name == known for known, _ in pairs):
            raise errors.InvalidArgument(f"--lora-modules: adapter {name!r} is given twice")
        pairs.append((name, path))
    return tuple(pairs)


class LoraTable:
    """The adapters one engine has loaded, by name (see the module docstring). Empty and
    refusing loads until ``attach`` gives it the started vLLM."""

    def __init__(self) -> None:
        self._llm: Any = None
        #: Whether vLLM runs with ``enable_lora`` (otherwise every load is refused).
        self.enabled = False
        #: The served model's name, which no adapter may take.
        self.base_name: str | None = None
        self._by_name: dict[str, Any] = {}
        self._names: dict[int, str] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    async def attach(self, llm: Any, base_name: str,
                     modules: Iterable[tuple[str, str]] = ()) -> None:
        """Serve adapters on the started ``llm`` (if it runs with ``enable_lora``), loading
        ``modules`` (``--lora-modules``) in order.

        Raises:
            InvalidArgument: a module did not load (``load``'s errors, named as the flag's).
        """
        self._llm, self.base_name = llm, base_name
        self.enabled = llm.vllm_config.lora_config is not None
        for name, path in modules:
            try:
                await self.load(name, path)
            except errors.DynamoError as exc:
                raise errors.InvalidArgument(f"--lora-modules: {exc}") from exc

    def detach(self) -> None:
        """vLLM is gone: refuse loads, forget the adapters (their names stay for ``name_of``)."""
        self._llm = None
        self._by_name.clear()

    def adapters(self) -> dict[str, str]:
        """name -> path of the adapters loaded now."""
        return {name: req.lora_path for name, req in self._by_name.items()}

    def name_of(self, lora_id: int) -> str | None:
        """The name an adapter id was given (also after it was unloaded: KV events of its
        blocks may still come), or None for an id this engine never gave."""
        return self._names.get(lora_id)

    def request(self, name: str) -> Any:
        """vLLM's ``LoRARequest`` for adapter ``name``.

        Raises:
            NotFound: no adapter of that name is loaded.
        """
        req = self._by_name.get(name)
        if req is None:
            raise errors.NotFound(self._missing(name))
        return req

    def _missing(self, name: str) -> str:
        if not self.enabled:
            return (f"LoRA adapter {name!r} is not loaded: this vLLM worker serves no adapters "
                    "(start it with --enable-lora)")
        return f"The lora adapter '{name}' cannot be found."

    async def load(self, name: str, path: str) -> None:
        """Load ``path`` as adapter ``name`` in vLLM; all or nothing.

        Raises:
            Unsupported: vLLM runs without ``enable_lora`` (or is not running).
            InvalidArgument: an empty name or path, the served model's name, a name already
                loaded, or what vLLM refused (a bad path, a rank above ``max_lora_rank``,
                modules the model lacks), with vLLM's message.
            EngineShutdown: vLLM's engine core died.
        """
        llm = self._llm
        if llm is None:
            raise errors.Unsupported("the vLLM engine is not running")
        if not self.enabled:
            raise errors.Unsupported("this vLLM worker serves no LoRA adapters: start it with "
                                     "--enable-lora")
        if not name or not path:
            raise errors.InvalidArgument("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base_name:
            raise errors.InvalidArgument(
                f"The lora adapter '{name}' conflicts with a served base model.")
        from vllm.lora.request import LoRARequest
        from vllm.v1.engine.exceptions import EngineDeadError

        async with self._lock:
            if name in self._by_name:
                raise errors.InvalidArgument(
                    f"The lora adapter '{name}' has already been loaded (unload it first).")
            req = LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path)
            try:
                await llm.add_lora(req)
            except errors.DynamoError:
                raise
            except EngineDeadError as exc:  # the engine core process is gone
                raise errors.EngineShutdown(f"vLLM's engine core died: {exc}") from exc
            except Exception as exc:
                why = str(exc).removeprefix("Call to add_lora method failed: ")
                raise errors.InvalidArgument(
                    f"LoRA adapter {name!r} could not be loaded from {path!r}: {why}") from exc
            self._by_name[name] = req
            self._names[req.lora_int_id] = name
        log.info("loaded LoRA adapter %r (id %d) from %s", name, req.lora_int_id, path)

    async def unload(self, name: str) -> None:
        """Forget adapter ``name`` and drop its weights in vLLM.

        Raises:
            NotFound: no adapter of that name is loaded.
        """
        async with self._lock:
            req = self._by_name.pop(name, None)
            if req is None:
                raise errors.NotFound(self._missing(name))
            try:
                if self._llm is not None:
                    await self._llm.remove_lora(req.lora_int_id)
            except Exception as exc:  # forgotten anyway: vLLM evicts it when it needs the slot
                log.warning("vLLM did not remove LoRA adapter %r: %s", name, exc)
        log.info("unloaded LoRA adapter %r (id %d)", name, req.lora_int_id)
