"""Which models the frontend can serve, learned from the workers it discovers.

Each worker advertises its model on its generate endpoint (a ``ModelAdvert``). The first time a
model's checksum is seen, its tokenizer files are fetched from that worker (``model_files``),
checked against the card, cached on disk by checksum, and a ``Preprocessor`` and the model's
``ModelRouter`` (the frontend's routing mode) are built. A model is listed while at least one
live instance serves it; a model seen before whose instances all died is still *known*, so
requests for it get 503 (no live worker) rather than 404.

One card per model name: workers that serve one name with different cards (another tokenizer,
chat template or context length: another checksum) are never mixed. The frontend keeps the
**first card it saw** for the name, builds its preprocessor from it, and routes only to the
instances advertising that card; each other card gets one warning. The first card stays while
any live instance serves it (a newcomer with another card cannot take a model over, and
requests never flip between tokenizers); once none does, the card of a live instance replaces
it (a rolling upgrade). Workers refuse requests preprocessed for another card (``mdcsum``).

Workers of one model come in disaggregation roles (the card's ``role``, not part of its
checksum): the model's router sends requests only to its ``agg`` and ``decode`` workers; once a
``prefill`` worker of the model's card appears, the router becomes a ``_disagg.DisaggRouter``
over both pools (prefill there first, then decode), and stays one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from .. import errors
from ..llm import (
    BUILTIN_MODES,
    NO_SESSIONS,
    TOKENIZERS,
    ClientRouter,
    EngineConfig,
    ModelCard,
    ModelRouter,
    RouterPlugin,
    RoutingTarget,
    ServedModel,
    SessionConfig,
    SessionPins,
    load_plugin,
    served_models,
    serves,
)
from ..runtime import DistributedRuntime, RouterMode
from ._adapters import AdapterTable
from ._disagg import GENERATION_ROLES, PREFILL_ROLES, DisaggConfig, DisaggMetrics, DisaggRouter
from ._image_prompt import Vision
from .errors import engine_lacks
from .preprocess import Preprocessor

__all__ = ["ModelEntry", "ModelManager"]

log = logging.getLogger(__name__)

#: Seconds between two refreshes of the model table when no peer changes.
REFRESH_INTERVAL = 5.0


@dataclass
class ModelEntry:
    """A served model: its card, its preprocessor and the router to its instances."""

    name: str
    card: ModelCard
    preprocessor: Preprocessor
    router: ModelRouter
    created: int
    instance_ids: list[int] = field(default_factory=list)
    #: The model's migration limit as its workers advertise it (None: the frontend's).
    migration_limit: int | None = None
    #: The serving engine's name and capabilities (``llm.Capability``), as advertised.
    engine_name: str = ""
    capabilities: frozenset[str] = frozenset()
    #: The workers' tool-call and reasoning parsers (None: that text is not parsed).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    #: How the engine takes images (``Capability.VISION``: its ``EngineConfig``'s image token
    #: and count; None: it advertises none).
    vision: Vision | None = None

    def require(self, capability: str, param: str) -> None:
        """Refuse a request whose ``param`` needs ``capability`` the engine lacks.

        Raises:
            HttpError: 400 naming the engine and the parameter.
        """
        if capability not in self.capabilities:
            raise engine_lacks(self.name, self.engine_name, param, capability)


class ModelManager:
    """Follows the workers of one namespace and keeps the model table current.

    Args:
        runtime: the frontend's runtime.
        namespace: the namespace whose models are served.
        mode: the routing mode, a built-in (``BUILTIN_MODES``) or a plugin's.
        plugin: the router plugin for a plugin mode (None for a built-in one).
        cache_dir: where fetched tokenizer files are kept (``DYN_MODEL_CACHE``, else a temp dir).
        registry: where routers put their metrics (the frontend's).
        disagg: when a model with prefill workers is prefilled remotely.
        sessions: how the routers of the generation pools pin sessions (``--session-ttl``).
    """

    def __init__(
        self,
        runtime: DistributedRuntime,
        namespace: str,
        mode: str = "round-robin",
        plugin: RouterPlugin | None = None,
        cache_dir: str | Path | None = None,
        registry: CollectorRegistry | None = None,
        disagg: DisaggConfig | None = None,
        sessions: SessionConfig = NO_SESSIONS,
    ) -> None:
        if plugin is None and mode not in BUILTIN_MODES:
            raise errors.InvalidArgument(f"router mode {mode!r} needs its plugin")
        self.runtime = runtime
        self.namespace = namespace
        self.mode = mode
        self._plugin = plugin
        self._registry = registry
        self.disagg = disagg or DisaggConfig()
        self.sessions = sessions
        self._disagg_metrics: DisaggMetrics | None = None
        #: Models whose prefill pool's router is being built.
        self._adding: set[str] = set()
        default_cache = (
            os.environ.get("DYN_MODEL_CACHE") or Path(tempfile.gettempdir()) / "dynamo-zmq-models"
        )
        self.cache_dir = Path(cache_dir or default_cache)
        self.models: dict[str, ModelEntry] = {}
        self._loading: set[str] = set()
        #: (model, checksum) of the other cards already warned about.
        self._warned: set[tuple[str, str]] = set()
        self._res = runtime.resources.child("models")
        self.changed = asyncio.Event()
        #: The LoRA adapters the workers advertise (``_adapters.py``).
        self.adapters = AdapterTable()

    async def start(self) -> None:
        await self.runtime.peers(self.namespace)  # starts discovery for the namespace
        self._res.spawn(self._follow(), "model-manager")

    async def close(self) -> None:
        await self._res.close()
        for entry in self.models.values():
            await _close_router(entry.router)

    def get(self, name: str) -> ModelEntry | None:
        return self.models.get(name)

    def live(self) -> list[ModelEntry]:
        """Models with at least one live instance, by name."""
        return [m for _, m in sorted(self.models.items()) if m.router.instance_ids()]

    async def _follow(self) -> None:
        seen: int | None = None
        while not self._res.closed:
            try:
                await self._refresh()
            except Exception:
                log.exception("model table refresh failed")
            # Every change wakes it; the timeout is a safety net (a refresh walks every peer).
            seen = await self.runtime.wait_peers_changed(REFRESH_INTERVAL, seen)

    async def _refresh(self) -> None:
        by_name: dict[str, list[ServedModel]] = {}
        found = served_models(await self.runtime.peers(self.namespace), self.namespace)
        for served in found:
            by_name.setdefault(served.advert.name, []).append(served)
        self.adapters.update(found)
        for name, instances in by_name.items():
            known = self.models.get(name)
            if known is not None and any(s.advert.checksum == known.card.checksum
                                         for s in instances):
                self._warn_other_cards(known, instances)
                if not isinstance(known.router, DisaggRouter) and name not in self._adding:
                    self._follow_prefill(known, instances)
            elif name not in self._loading:  # a new model, or its card is served no more
                self._loading.add(name)
                self._res.spawn(self._load(instances[0], instances), f"load-model-{name}")
        for entry in self.models.values():
            entry.instance_ids = entry.router.instance_ids()
        self.changed.set()
        self.changed = asyncio.Event()

    def _warn_other_cards(self, entry: ModelEntry, instances: list[ServedModel]) -> None:
        """Warn once per card about instances serving ``entry``'s name with another card."""
        for served in instances:
            checksum = served.advert.checksum
            if checksum == entry.card.checksum or (entry.name, checksum) in self._warned:
                continue
            self._warned.add((entry.name, checksum))
            log.warning(
                "model %r: instance %x serves it with another model card (checksum %s: other "
                "tokenizer, template or context length) than the card this frontend "
                "preprocesses with (checksum %s, the first seen); requests for %r go only to "
                "the instances with that card. Serve one model directory per model name.",
                entry.name, served.instance_id, checksum[:12], entry.card.checksum[:12],
                entry.name,
            )

    def _follow_prefill(self, entry: ModelEntry, instances: list[ServedModel]) -> None:
        """Start building ``entry``'s prefill pool router if a prefill worker of its card is
        among ``instances``."""
        for served in instances:
            advert = served.advert
            if advert.role in PREFILL_ROLES and advert.checksum == entry.card.checksum:
                self._adding.add(entry.name)
                self._res.spawn(self._add_prefill(entry, served), f"prefill-pool-{entry.name}")
                return

    async def _add_prefill(self, entry: ModelEntry, served: ServedModel) -> None:
        """Wrap ``entry``'s router in a ``DisaggRouter`` over its prefill pool."""
        try:
            prefill = await self._router(served, PREFILL_ROLES)
            if self.models.get(entry.name) is not entry or isinstance(entry.router, DisaggRouter):
                await _close_router(prefill)  # replaced meanwhile
                return
            if self._disagg_metrics is None:
                self._disagg_metrics = DisaggMetrics(self._registry)
            entry.router = DisaggRouter(
                entry.router, prefill, self.disagg, self._disagg_metrics, entry.name
            )
            log.info("model %r has prefill workers: disaggregated prefill (%s)", entry.name,
                     self.disagg.mode)
        except Exception as exc:
            log.warning("could not follow the prefill workers of model %r: %s", entry.name, exc)
        finally:
            self._adding.discard(entry.name)

    async def _load(self, served: ServedModel, instances: list[ServedModel]) -> None:
        card, advert = served.advert.model_card, served.advert
        try:
            model_dir = await self._fetch_files(served.instance_id, served.endpoint.component, card)
            preprocessor = await asyncio.to_thread(Preprocessor, model_dir, card)
            if advert.native_tokenizer is not None:  # the engine's own tokenizer and template
                native = load_plugin(TOKENIZERS, advert.native_tokenizer)
                preprocessor.use_native(await asyncio.to_thread(native, model_dir))
                log.info("model %r uses the engine's native processing", card.name)
            router = await self._router(served, GENERATION_ROLES)
            old = self.models.get(card.name)
            self.models[card.name] = ModelEntry(
                card.name, card, preprocessor, router, int(time.time()),
                migration_limit=advert.migration_limit, engine_name=advert.engine_name,
                capabilities=frozenset(advert.capabilities),
                tool_call_parser=advert.tool_call_parser,
                reasoning_parser=advert.reasoning_parser, vision=_vision(advert.engine),
            )
            if old is not None:
                await _close_router(old.router)
                if old.card.checksum != card.checksum:
                    log.warning("model %r: now served with card %s (no live instance serves "
                                "card %s any more)", card.name, card.checksum[:12],
                                old.card.checksum[:12])
                    self._warned = {w for w in self._warned if w[0] != card.name}
            log.info("model %r available (checksum %s)", card.name, card.checksum[:12])
            if card.name not in self._adding:
                self._follow_prefill(self.models[card.name], instances)
            self.changed.set()
        except Exception as exc:
            log.warning("could not load model %r from instance %x: %s",
                        card.name, served.instance_id, exc)
        finally:
            self._loading.discard(card.name)

    async def _router(self, served: ServedModel, roles: frozenset[str]) -> ModelRouter:
        """The model's router in the frontend's mode, over a client of the instances serving
        the model with this card on its endpoint in one of ``roles`` (one pool)."""
        path, name = served.endpoint.path, served.advert.name
        endpoint = self.runtime.endpoint(path)
        # Only the card preprocessed for, and only the pool's roles.
        select = serves(name, path, served.advert.checksum, roles)
        # A prefill pool's requests name no session: only generation pools pin.
        sessions = NO_SESSIONS if roles == PREFILL_ROLES else self.sessions
        if self._plugin is None:
            mode = BUILTIN_MODES[self.mode]
            if mode == RouterMode.Direct and roles == PREFILL_ROLES:
                mode = RouterMode.RoundRobin  # a direct request names its decode worker
            client = await endpoint.client(mode, select=select)
            pins = None
            if sessions.enabled and mode != RouterMode.Direct:
                pins = SessionPins(sessions, model=name, registry=self._registry)
            return ClientRouter(client, pins)
        client = await endpoint.client(select=select)
        target = RoutingTarget(self.runtime, client, served.advert, self._registry, sessions)
        return await self._plugin.router(target)

    async def _fetch_files(self, instance_id: int, component: str, card: ModelCard) -> Path:
        """Download the card's files into the cache (once per checksum) and verify them."""
        target = self.cache_dir / card.checksum
        if await asyncio.to_thread(
            lambda: all(_matches(target / f.name, f.sha256) for f in card.files)
        ):
            return target
        worker = self.runtime.namespace(self.namespace).component(component)
        files = await worker.endpoint("model_files").client()
        await files.wait_for_instances(timeout=10)
        fetched: dict[str, bytes] = {}
        for f in card.files:
            stream = await files.direct({"name": f.name}, instance_id, idle_timeout=30)
            data = b"".join([r.data() async for r in stream])
            if hashlib.sha256(data).hexdigest() != f.sha256:
                raise errors.InvalidArgument(
                    f"{f.name} of model {card.name!r} does not match its card"
                )
            fetched[f.name] = data
        await asyncio.to_thread(_install, self.cache_dir, target, fetched)
        return target


def _vision(engine: EngineConfig) -> Vision | None:
    """The engine's image token and count, when it advertises both."""
    if engine.image_token_id is None or engine.tokens_per_image < 1:
        return None
    return Vision(engine.image_token_id, engine.tokens_per_image)


async def _close_router(router: ModelRouter) -> None:
    try:
        await router.close()
    except Exception:
        log.exception("closing the router of a model failed")


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
