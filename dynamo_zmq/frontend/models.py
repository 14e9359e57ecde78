"""Which models the frontend can serve, learned from the workers it discovers.

Each worker publishes a model card in the metadata of its ``generate`` endpoint. The first time
a card's checksum is seen, its tokenizer files are fetched from that worker (``model_files``),
checked against the card, cached on disk by checksum, and a ``Preprocessor`` is built. A model
is listed while at least one live instance serves it; a model seen before whose instances all
died is still *known*, so requests for it get 503 (no live worker) rather than 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from .. import errors
from ..llm import ModelCard
from ..runtime import Client, DistributedRuntime
from ..transport import PeerConnection
from .preprocess import Preprocessor

__all__ = ["ModelEntry", "ModelManager"]

log = logging.getLogger(__name__)


@dataclass
class ModelEntry:
    """A served model: its card, its preprocessor and a client routed to its instances."""

    name: str
    card: ModelCard
    preprocessor: Preprocessor
    #: The model's ``Client``, or what ``ModelManager.client_wrapper`` made of it (a KV router):
    #: anything with ``generate(request, context=, **options)`` and ``instance_ids()``.
    client: Any
    created: int
    instance_ids: list[int] = field(default_factory=list)


#: Wraps a model's client, e.g. in a KV router: ``await wrapper(client, card)``. What it returns
#: replaces the client; if that has an async ``close()``, it is called when the model is dropped.
ClientWrapper = Callable[[Client, ModelCard], Awaitable[Any]]


class ModelManager:
    """Follows the workers of one namespace and keeps the model table current.

    ``client_wrapper`` (set before ``start``) wraps each model's client, e.g. in a KV router.
    """

    def __init__(
        self,
        runtime: DistributedRuntime,
        namespace: str,
        router_mode: str = "round_robin",
        cache_dir: str | Path | None = None,
    ) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.router_mode = router_mode
        default_cache = os.environ.get("DYN_MODEL_CACHE") or Path(tempfile.gettempdir()) / "dynamo-zmq-models"
        self.cache_dir = Path(cache_dir or default_cache)
        self.models: dict[str, ModelEntry] = {}
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()
        self.client_wrapper: ClientWrapper | None = None

    async def start(self) -> None:
        await self.runtime.peers(self.namespace)  # starts discovery for the namespace
        self._task = asyncio.create_task(self._follow(), name="model-manager")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._loading.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        for entry in self.models.values():
            await _close_client(entry.client)

    def get(self, name: str) -> ModelEntry | None:
        return self.models.get(name)

    def live(self) -> list[ModelEntry]:
        """Models with at least one live instance, by name."""
        return [m for _, m in sorted(self.models.items()) if m.client.instance_ids()]

    async def _follow(self) -> None:
        while True:
            try:
                await self._refresh()
            except Exception:
                log.exception("model table refresh failed")
            await self.runtime.wait_peers_changed(timeout=1.0)

    async def _refresh(self) -> None:
        for conn in await self.runtime.peers(self.namespace):
            desc = conn.description
            if desc is None or not conn.routable:
                continue
            for ep in desc.endpoints:
                card_data = ep.metadata.get("model_card") if ep.namespace == self.namespace else None
                if card_data is None:
                    continue
                try:
                    card = msgspec.convert(card_data, ModelCard)
                except msgspec.ValidationError as exc:
                    log.warning("instance %x has a malformed model card: %s", desc.instance_id, exc)
                    continue
                known = self.models.get(card.name)
                if (known is None or known.card.checksum != card.checksum) and card.name not in self._loading:
                    self._loading[card.name] = asyncio.create_task(
                        self._load(conn, ep.component, ep.name, card), name=f"load-model-{card.name}"
                    )
        for entry in self.models.values():
            entry.instance_ids = entry.client.instance_ids()
        self.changed.set()
        self.changed = asyncio.Event()

    async def _load(self, conn: PeerConnection, component: str, endpoint: str, card: ModelCard) -> None:
        try:
            model_dir = await self._fetch_files(conn.instance_id, component, card)
            preprocessor = await asyncio.to_thread(Preprocessor, model_dir, card)
            native = _native_tokenizer_class(conn, endpoint)
            if native is not None:  # the engine asks for its own tokenizer and detokenizer
                preprocessor.use_native(await asyncio.to_thread(native, model_dir))
                log.info("model %r uses the engine's native processing", card.name)
            endpoint_obj = self.runtime.namespace(self.namespace).component(component).endpoint(endpoint)
            client: Any = await endpoint_obj.client(self.router_mode, select=_serves(card.name, endpoint))
            if self.client_wrapper is not None:
                client = await self.client_wrapper(client, card)
            created = int(time.time())
            old = self.models.get(card.name)
            self.models[card.name] = ModelEntry(card.name, card, preprocessor, client, created)
            if old is not None:
                await _close_client(old.client)
            log.info("model %r available (checksum %s)", card.name, card.checksum[:12])
            self.changed.set()
        except Exception as exc:
            log.warning("could not load model %r from instance %x: %s", card.name, conn.instance_id, exc)
        finally:
            self._loading.pop(card.name, None)

    async def _fetch_files(self, instance_id: int, component: str, card: ModelCard) -> Path:
        """Download the card's files into the cache (once per checksum) and verify them."""
        target = self.cache_dir / card.checksum
        if await asyncio.to_thread(lambda: all(_matches(target / f.name, f.sha256) for f in card.files)):
            return target
        files = await self.runtime.namespace(self.namespace).component(component).endpoint("model_files").client()
        await files.wait_for_instances(timeout=10)
        fetched: dict[str, bytes] = {}
        for f in card.files:
            stream = await files.direct({"name": f.name}, instance_id, idle_timeout=30)
            data = b"".join([r.data() async for r in stream])
            if hashlib.sha256(data).hexdigest() != f.sha256:
                raise errors.InvalidArgument(f"{f.name} of model {card.name!r} does not match its card")
            fetched[f.name] = data
        await asyncio.to_thread(_install, self.cache_dir, target, fetched)
        return target


def _serves(name: str, endpoint: str) -> Callable[[PeerConnection], bool]:
    """Does an instance serve model ``name`` on ``endpoint``? (Instances of one endpoint path
    may serve different models.)"""

    def select(conn: PeerConnection) -> bool:
        desc = conn.description
        if desc is None:
            return False
        return any(
            ep.name == endpoint and (ep.metadata.get("model_card") or {}).get("name") == name
            for ep in desc.endpoints
        )

    return select


async def _close_client(client: Any) -> None:
    close = getattr(client, "close", None)
    if close is not None:
        try:
            await close()
        except Exception:
            log.exception("closing the client of a model failed")


def _native_tokenizer_class(conn: PeerConnection, endpoint: str) -> Any:
    """The tokenizer adapter an engine names for native processing (``module:Class`` in its
    EngineConfig ``extra``), loaded by name: the frontend never imports engines statically."""
    desc = conn.description
    info = next((ep for ep in desc.endpoints if ep.name == endpoint), None) if desc else None
    extra = ((info.metadata.get("engine") or {}).get("extra") or {}) if info else {}
    if not extra.get("native_processing"):
        return None
    spec = extra.get("native_tokenizer", "engines.vllm.native:NativeTokenizer")
    module_name, _, attr = str(spec).partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _matches(path: Path, sha256: str) -> bool:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() == sha256
    except OSError:
        return False


def _install(cache_dir: Path, target: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into ``target`` atomically (a staging directory renamed into place)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=cache_dir))
    for name, data in files.items():
        (staging / name).write_bytes(data)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
