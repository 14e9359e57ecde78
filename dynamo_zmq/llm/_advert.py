"""``ModelAdvert``: what a worker's generate endpoint advertises, typed, decoded in one place.

The worker writes it into its endpoint's metadata (``ModelAdvert.to_metadata``); frontends,
KV routers and tools read it back with ``advert_of(conn, path)``, which decodes each instance's
advert once per description revision and remembers the result. Its KV-event, replay and load
endpoints are given as the connection reaches them (``transport.endpoint_via``: a multi-homed
worker advertises them at one of its addresses, the caller dials the one it reached it at).
``served_models`` lists what the live instances of a namespace serve, for anyone keeping a
model table. With auth on, a model is only ever a worker's: an instance whose key does not hold
the ``worker`` role advertises none (said once), so nothing routes requests to it or follows its
KV events and load.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from ..transport import (
    WORKER,
    PeerConnection,
    current_curve,
    endpoint_via,
    format_roles,
    peer_roles,
)
from ..wire import EndpointInfo
from ._messages import EngineConfig
from ._model_card import ModelCard

__all__ = ["ModelAdvert", "ServedModel", "advert_of", "served_models", "serves"]

log = logging.getLogger(__name__)

#: Adverts remembered (one per instance, endpoint and description revision).
CACHE_SIZE = 4096
#: Instances (and keys) refused as workers, each said once.
_not_workers: set[tuple[int, bytes]] = set()


class ModelAdvert(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """A model served on one endpoint of one worker: its card (name, checksum, files, context
    length, block size, disaggregation role), its engine's configuration (data-parallel size,
    KV-event and replay endpoints), where it publishes its load, its migration limit, and the
    engine's name, capabilities and LoRA adapters."""

    model_card: ModelCard
    engine: EngineConfig
    #: The worker's load-report PUB socket (``dynamo_zmq.llm.LoadReport``), if it publishes.
    load_endpoint: str | None = None
    #: Migrations a request of this model may make (the worker's ``--migration-limit``); it
    #: overrides the frontend's own limit. None: the frontend's.
    migration_limit: int | None = None
    #: The engine's name (``LLMEngine.name``), for error messages.
    engine_name: str = ""
    #: What the engine can do beyond plain generation (``Capability`` names).
    capabilities: list[str] = msgspec.field(default_factory=list)
    #: The worker's tool-call parser (``llm.parsers``): None, tool calls stay in the text.
    tool_call_parser: str | None = None
    #: The worker's reasoning parser: None, reasoning stays in the text.
    reasoning_parser: str | None = None
    #: The LoRA adapters the engine holds now, name -> path (a path on the worker's machine);
    #: re-advertised after each load and unload (``LLMEngine.lora_adapters``).
    lora_adapters: dict[str, str] = msgspec.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.model_card.name

    @property
    def checksum(self) -> str:
        return self.model_card.checksum

    @property
    def role(self) -> str:
        """``agg``, ``prefill`` or ``decode``."""
        return self.model_card.role

    @property
    def data_parallel_size(self) -> int:
        return max(1, self.engine.data_parallel_size)

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block (the card's, else the engine's; 0 if neither says)."""
        return self.model_card.kv_block_size or self.engine.kv_block_size

    @property
    def kv_events_endpoint(self) -> str | None:
        return self.engine.kv_events_endpoint or None

    @property
    def kv_replay_endpoint(self) -> str | None:
        return self.engine.kv_replay_endpoint or None

    @property
    def native_tokenizer(self) -> str | None:
        """The tokenizer plugin the engine asks frontends to use (native processing), if any."""
        extra = self.engine.extra
        if not extra.get("native_processing"):
            return None
        name = extra.get("native_tokenizer")
        return name if isinstance(name, str) and name else None

    def to_metadata(self) -> dict[str, Any]:
        """The endpoint metadata a worker serves this advert as."""
        meta: dict[str, Any] = msgspec.to_builtins(self)
        return meta

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> ModelAdvert | None:
        """The advert in an endpoint's metadata; None if it advertises no model.

        Raises:
            msgspec.ValidationError: the metadata holds a model card but the advert is malformed.
        """
        if "model_card" not in metadata:
            return None
        return msgspec.convert(metadata, cls)


@dataclass(frozen=True)
class ServedModel:
    """One live instance's endpoint serving a model, and what it advertises."""

    conn: PeerConnection
    endpoint: EndpointInfo
    advert: ModelAdvert

    @property
    def instance_id(self) -> int:
        return self.conn.instance_id


_cache: OrderedDict[tuple[int, int, str, str], ModelAdvert | None] = OrderedDict()


def advert_of(conn: PeerConnection, path: str) -> ModelAdvert | None:
    """The model advert of endpoint ``path`` of the instance behind ``conn``.

    None if the instance is not described yet, does not serve ``path``, serves no model there,
    or advertises a malformed one (logged once per description revision).
    """
    desc = conn.description
    if desc is None:
        return None
    key = (desc.instance_id, desc.rev, path, conn.address)
    try:
        found = _cache[key]
    except KeyError:
        pass
    else:
        _cache.move_to_end(key)
        return found if found is None or _worker_key(conn) else None
    advert = None
    for info in desc.endpoints:
        if info.path == path:
            try:
                advert = ModelAdvert.from_metadata(info.metadata)
                if advert is not None and len(desc.hosts) > 1:
                    advert = _reached(advert, conn.address, desc.hosts)
            except msgspec.ValidationError as exc:
                log.warning("instance %x advertises a malformed model on %s: %s",
                            desc.instance_id, path, exc)
            break
    _cache[key] = advert
    if len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return advert if advert is None or _worker_key(conn) else None


def _worker_key(conn: PeerConnection) -> bool:
    """Whether the instance behind ``conn`` may serve a model: auth off, or its key holds the
    ``worker`` role now (roles change at runtime, so this is never cached)."""
    roles = peer_roles(conn.server_key)
    if roles is None or WORKER in roles:
        return True
    curve, key = current_curve(), conn.server_key or b""
    if (conn.instance_id, key) not in _not_workers and len(_not_workers) < CACHE_SIZE:
        _not_workers.add((conn.instance_id, key))
        name = curve.name_of(key) if curve is not None and key else "?"
        log.warning("instance %x at %s advertises a model, but its key %s holds %s, not "
                    "worker: nothing is routed to it", conn.instance_id, conn.address, name,
                    format_roles(roles) if roles else "no role")
    return False


def _reached(advert: ModelAdvert, dialed: str, hosts: list[str]) -> ModelAdvert:
    """``advert`` with its endpoints as a caller that dialed ``dialed`` reaches them."""

    def via(endpoint: str | None) -> str | None:
        return endpoint_via(endpoint, dialed, hosts) if endpoint else endpoint

    engine = msgspec.structs.replace(
        advert.engine, kv_events_endpoint=via(advert.engine.kv_events_endpoint),
        kv_replay_endpoint=via(advert.engine.kv_replay_endpoint),
    )
    return msgspec.structs.replace(advert, engine=engine, load_endpoint=via(advert.load_endpoint))


def served_models(conns: Iterable[PeerConnection], namespace: str) -> list[ServedModel]:
    """Every model endpoint of ``namespace`` among the routable ``conns``."""
    found: list[ServedModel] = []
    for conn in conns:
        desc = conn.description
        if desc is None or not conn.routable:
            continue
        for info in desc.endpoints:
            if info.namespace == namespace and (advert := advert_of(conn, info.path)) is not None:
                found.append(ServedModel(conn, info, advert))
    return found


def serves(
    model: str,
    path: str,
    checksum: str | None = None,
    roles: frozenset[str] | None = None,
) -> Callable[[PeerConnection], bool]:
    """Whether an instance serves ``model`` on endpoint ``path`` (instances of one endpoint
    may serve different models), with the card ``checksum`` when one is given (instances of one
    model name may serve different cards), in one of ``roles`` (disaggregation roles: ``agg``,
    ``prefill``, ``decode``) when given: a ``Client``'s ``select``."""

    def select(conn: PeerConnection) -> bool:
        advert = advert_of(conn, path)
        return (
            advert is not None
            and advert.name == model
            and (checksum is None or advert.checksum == checksum)
            and (roles is None or advert.role in roles)
        )

    return select
