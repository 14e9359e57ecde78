"""LoRA adapters at the frontend: vLLM's ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, and what a request naming an adapter as its ``model`` is
routed with.

Load (``{"lora_name", "lora_path", "model"?}``; ``model``, ours, names the base model and is
required only when several are served) calls the ``load_lora`` endpoint of the model's live
workers, all of them or ``--lora-placement N`` of them (those holding the fewest adapters, N per
disaggregation role), all at once. All or nothing: when one fails, the adapter is unloaded from
those that loaded it and the error is answered (400 with the worker's message for a bad path or
rank; 400 for a name already loaded or taken by a base model). The answer, vLLM's plain text,
comes once this frontend's model table shows the adapter on every worker that loaded it, so a
request sent right after it is routed there. Unload (``{"lora_name", "model"?}``) calls
``unload_lora`` on every worker holding it (404 when none does) and answers once the table no
longer lists it. The path is read by the workers: a path on their machines.

A request whose ``model`` is an adapter is preprocessed with its base model's preprocessor,
carries ``lora_name``, and is routed only to the instances holding the adapter
(``RouteOptions.only``); 503 when no live worker holds it.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from .. import errors
from ..llm import Capability, ServedModel, served_models
from . import errors as http_errors
from .errors import HttpError
from .models import ModelEntry, ModelManager

__all__ = ["LoraRoutes", "resolve_model"]

#: Seconds a worker may take to load or unload an adapter.
CALL_TIMEOUT = 120.0
#: Seconds to wait for the model table to show a load or an unload.
TABLE_WAIT = 15.0
T = TypeVar("T")


class _Load(msgspec.Struct):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False
    is_3d_lora_weight: bool = False
    model: str | None = None


class _Unload(msgspec.Struct):
    lora_name: str = ""
    lora_int_id: int | None = None
    model: str | None = None


def resolve_model(manager: ModelManager, model: str) -> tuple[ModelEntry, frozenset[int] | None]:
    """The model entry a request for ``model`` uses, and the only instances it may go to
    (None: any; a set: those holding the LoRA adapter ``model`` names).

    Raises:
        HttpError: 404 for a name neither a model nor an adapter; 503 for an adapter no live
            worker holds.
    """
    entry = manager.get(model)
    if entry is not None:
        return entry, None
    adapter = manager.adapters.get(model)
    if adapter is None:
        raise http_errors.model_not_found(model)
    entry = manager.get(adapter.base)
    if entry is None or not adapter.holders & set(entry.router.instance_ids()):
        raise http_errors.no_worker(
            f"no live worker holds the LoRA adapter {model!r} (of model {adapter.base!r})"
        )
    return entry, adapter.holders


def _decode(body: bytes, kind: type[T], shape: str) -> T:
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise http_errors.bad_request(f"expected {shape}: {exc}") from exc


class LoraRoutes:
    """The two routes for one frontend.

    Args:
        manager: the model table.
        placement: workers an adapter is loaded on (per role); 0: all of the model's.
    """

    def __init__(self, manager: ModelManager, placement: int = 0) -> None:
        self.manager = manager
        self.placement = placement
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def load(self, body: bytes) -> bytes:
        """``POST /v1/load_lora_adapter``: vLLM's success text.

        Raises:
            HttpError: see the module docstring.
        """
        req = _decode(body, _Load, '{"lora_name": NAME, "lora_path": PATH, "model"?: BASE}')
        name = req.lora_name
        if not name or not req.lora_path:
            raise http_errors.bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        if req.load_inplace:
            raise http_errors.unsupported("load_inplace", "unload the adapter, then load it")
        if req.is_3d_lora_weight:
            raise http_errors.unsupported("is_3d_lora_weight")
        async with self._locks[name]:
            entry = self._base(req.model)
            if self.manager.get(name) is not None:
                raise http_errors.bad_request(
                    f"The lora adapter '{name}' conflicts with a served base model.")
            known = self.manager.adapters.get(name)
            if known is not None and known.holders:
                raise http_errors.bad_request(
                    f"The lora adapter '{name}' has already been loaded.")
            if Capability.LORA not in entry.capabilities:
                raise http_errors.engine_lacks(entry.name, entry.engine_name, "lora_name",
                                               Capability.LORA)
            targets = await self._place(entry)
            if not targets:
                raise http_errors.no_worker(f"no live worker serves model {entry.name!r}")
            args = {"lora_name": name, "lora_path": req.lora_path}
            results = await asyncio.gather(*(self._call(s, "load_lora", args) for s in targets))
            failed = [exc for exc in results if exc is not None]
            loaded = [s for s, exc in zip(targets, results, strict=True) if exc is None]
            ids = {s.instance_id for s in loaded}
            if failed:
                await asyncio.gather(*(self._call(s, "unload_lora", {"lora_name": name})
                                       for s in loaded))
                # Answer once this table no longer shows the rolled-back loads, so a retry
                # right after is not refused as "already loaded".
                await self._wait(lambda: not ids & _holders(self.manager, name))
                raise _http(failed[0], name)
            await self._wait(lambda: ids <= _holders(self.manager, name))
        return f"Success: LoRA adapter '{name}' added successfully.".encode()

    async def unload(self, body: bytes) -> bytes:
        """``POST /v1/unload_lora_adapter``: vLLM's success text.

        Raises:
            HttpError: 400 for a malformed body, 404 when no live worker holds the adapter.
        """
        req = _decode(body, _Unload, '{"lora_name": NAME, "model"?: BASE}')
        name = req.lora_name
        if not name:
            raise http_errors.bad_request(
                "'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._locks[name]:
            peers = await self.manager.runtime.peers(self.manager.namespace)
            holders = [s for s in served_models(peers, self.manager.namespace)
                       if name in s.advert.lora_adapters
                       and (req.model is None or s.advert.name == req.model)]
            if not holders:
                self.manager.adapters.forget(name)
                raise http_errors.not_found(f"The lora adapter '{name}' cannot be found.")
            results = await asyncio.gather(*(self._call(s, "unload_lora", {"lora_name": name})
                                             for s in holders))
            failed = [e for e in results if e is not None and not isinstance(e, errors.NotFound)]
            if failed:
                raise _http(failed[0], name)
            await self._wait(lambda: not _holders(self.manager, name))
        return f"Success: LoRA adapter '{name}' removed successfully.".encode()

    def _base(self, model: str | None) -> ModelEntry:
        """The base model a load is for: ``model``, else the only one served."""
        if model is not None:
            entry = self.manager.get(model)
            if entry is None:
                raise http_errors.model_not_found(model)
            return entry
        live = self.manager.live()
        if len(live) != 1:
            names = ", ".join(repr(m.name) for m in live) or "none"
            raise http_errors.bad_request(
                f"name the base model in 'model': this frontend serves {names}", param="model")
        return live[0]

    async def _place(self, entry: ModelEntry) -> list[ServedModel]:
        """The live instances to load on: every one of ``entry``'s card, or ``placement`` of
        each role, those holding the fewest adapters first."""
        pool = await self.manager.runtime.peers(self.manager.namespace)
        mine = [s for s in served_models(pool, self.manager.namespace)
                if s.advert.name == entry.name and s.advert.checksum == entry.card.checksum]
        if not self.placement:
            return mine
        by_role: defaultdict[str, list[ServedModel]] = defaultdict(list)
        for s in sorted(mine, key=lambda s: (len(s.advert.lora_adapters), s.instance_id)):
            by_role[s.advert.role].append(s)
        return [s for role in sorted(by_role) for s in by_role[role][: self.placement]]

    async def _wait(self, done: Callable[[], bool]) -> None:
        """Until ``done()`` holds of the model table (at most ``TABLE_WAIT`` seconds)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + TABLE_WAIT
        while not done() and (left := until - loop.time()) > 0:
            changed = self.manager.changed
            try:
                await asyncio.wait_for(changed.wait(), min(left, 1.0))
            except TimeoutError:
                pass


    async def _call(
        self, served: ServedModel, endpoint: str, args: dict[str, Any]
    ) -> errors.DynamoError | None:
        """Call ``endpoint`` of the worker behind ``served`` (in its component) with ``args``;
        the error it answered (None: success)."""
        ep = served.endpoint
        component = self.manager.runtime.namespace(ep.namespace).component(ep.component)
        try:
            client = await component.endpoint(endpoint).client()
            stream = await client.direct(args, served.instance_id, timeout=CALL_TIMEOUT)
            async for _ in stream:
                pass
        except errors.DynamoError as exc:
            return exc
        return None


def _holders(manager: ModelManager, name: str) -> frozenset[int]:
    adapter = manager.adapters.get(name)
    return adapter.holders if adapter is not None else frozenset()




def _http(exc: errors.DynamoError, name: str) -> HttpError:
    """A worker's refusal as the HTTP error vLLM answers."""
    if isinstance(exc, (errors.InvalidArgument, errors.Unsupported)):
        return http_errors.bad_request(exc.message)
    if isinstance(exc, errors.NotFound):
        return http_errors.not_found(exc.message)
    return http_errors.from_dynamo(exc)
