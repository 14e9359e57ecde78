"""The discovery interface: advertise this process, and watch for peers.

Discovery only answers "which addresses might serve namespace N"; everything else about an
instance (its id, components, endpoints, model card) is fetched from the instance itself over its
ROUTER socket, so mDNS and static lists share one handshake and one liveness mechanism.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..wire import PROTOCOL_VERSION as PROTOCOL_VERSION

SERVICE_TYPE = "_dynamo-zmq._tcp.local."


@dataclass(frozen=True)
class Advert:
    """What one runtime advertises for one namespace it serves."""

    namespace: str
    instance_id: int
    #: ``tcp://host:port`` addresses the ROUTER socket can be reached at.
    addresses: tuple[str, ...]
    components: tuple[str, ...] = ()
    protocol_version: int = PROTOCOL_VERSION
    #: The CURVE public key (Z85) its sockets prove; empty when auth is off.
    public_key: str = ""


@dataclass(frozen=True)
class PeerAdded:
    """A peer may be reachable at ``address``. Hints are ``None`` when discovery cannot know
    them."""

    address: str
    namespace: str | None = None
    instance_id: int | None = None
    components: tuple[str, ...] = field(default=())
    #: The CURVE public key (Z85) advertised with the address; None: none was.
    key: bytes | None = None


@dataclass(frozen=True)
class PeerRemoved:
    """A peer withdrew its advert (clean shutdown), or its record went ``stale`` (a discovery
    directory's file no longer refreshed). Crashes are found by liveness, not here: a stale
    peer is dropped only if its connection finds it dead too."""

    address: str
    instance_id: int | None = None
    stale: bool = False


DiscoveryEvent = PeerAdded | PeerRemoved


class Discovery(abc.ABC):
    """Advertises local instances and reports remote ones.

    Lifecycle: ``await start()`` once, then any number of ``advertise``/``renew``/``withdraw``/
    ``watch``, then ``await close()`` (idempotent, safe without ``start``).
    """

    @abc.abstractmethod
    async def start(self) -> None:
        """Open sockets / resources."""

    @abc.abstractmethod
    async def advertise(self, advert: Advert) -> None:
        """Make ``advert`` visible to watchers; re-advertising the same namespace updates it."""

    @abc.abstractmethod
    async def withdraw(self, advert: Advert) -> None:
        """Remove ``advert``; watchers see ``PeerRemoved`` promptly. Unknown adverts are ignored."""

    async def renew(self, advert: Advert) -> str | None:
        """Keep ``advert`` registered (the runtime's lease keep-alive, called every
        ``LEASE_KEEPALIVE`` seconds): register it again if it was lost and can be.

        Returns:
            ``None`` while it is kept, else why it cannot be (the runtime's lease is then lost
            and the runtime shuts down). This default has nothing to lose.
        """
        return None

    def refresh(self) -> None:
        """A hint from the caller: a peer it had lost answers again, so a link may have come
        back and peers missed meanwhile may be found by asking soon. This default ignores it."""
        return None

    @abc.abstractmethod
    def watch(self, namespace: str | None = None) -> AsyncIterator[DiscoveryEvent]:
        """Yield events for peers in ``namespace`` (all namespaces when ``None``).

        Starts with a ``PeerAdded`` for every peer already known, then follows changes, until
        the iterator is closed or ``close()`` is called.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Withdraw everything advertised and release resources."""
