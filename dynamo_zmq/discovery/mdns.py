"""mDNS discovery: advertise instances as ``_dynamo-zmq._tcp.local.`` services, browse for peers.

One ``AsyncZeroconf`` per ``MdnsDiscovery`` owns the sockets. Each advert is one service named
``<namespace>-<instance id as 16 hex>``; its TXT carries only ``ns``, ``iid``, ``v``,
``comps`` and, with auth on, ``key`` (the instance's CURVE public key). Each ``watch()`` is
a ``_mdns_watch.Watch``: one browser, the resolve tasks it starts, a periodic query for
peers whose announcements were missed, and the queue it yields from. Zeroconf failures
after ``start()`` are logged, never raised into the caller's loop. Which IPv4 addresses are
published and dialled is ``_mdns_addresses.py``'s; what the network says about our own
services (conflicts, goodbyes we did not send) ``_mdns_guard.py``'s, and ``renew`` (the
runtime's lease keep-alive) acts on it: another responder claiming an advert's name makes it
announce the advert under a new one (``<namespace>-<instance id>-2``, ...), said once; the
instance, its lease and its peers' connections stay as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator, Iterable
from typing import Any

from zeroconf import InterfaceChoice, IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from ..errors import InvalidArgument
from ._base import (
    SERVICE_TYPE,
    Advert,
    Discovery,
    DiscoveryEvent,
)
from ._config import DiscoveryConfig
from ._mdns_addresses import advert_endpoint as _advert_endpoint
from ._mdns_addresses import local_ipv4 as _local_ipv4
from ._mdns_addresses import pick_ip as _pick_ip  # noqa: F401 (tests import it from here)
from ._mdns_guard import AdvertGuard
from ._mdns_watch import Watch

__all__ = ["MdnsDiscovery", "instance_name"]

log = logging.getLogger(__name__)

#: Longest DNS label; the instance label is ``<namespace>-<16 hex>``.
_MAX_LABEL = 63
#: TTL of every record we publish. RFC 6762 suggests 75 min for PTR/TXT; 2 min makes a peer that
#: died without a goodbye leave browsers' caches sooner (liveness itself is the ping's job).
_TTL = 120
#: Budget for one TXT entry (the format allows 255 bytes per ``key=value``).
_MAX_TXT_VALUE = 200
#: Receive buffer of zeroconf's sockets (``_enlarge_receive_buffers``).
_RECEIVE_BUFFER = 4 * 1024 * 1024
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def instance_name(namespace: str, instance_id: int, generation: int = 1) -> str:
    """The service name for one advert: a DNS-safe namespace label plus the instance id in hex,
    and from the second ``generation`` on (a name claimed by another responder) ``-N``."""
    suffix = f"-{generation}" if generation > 1 else ""
    safe = re.sub(r"[^A-Za-z0-9-]+", "-", namespace).strip("-") or "ns"
    safe = safe[: _MAX_LABEL - 17 - len(suffix)].rstrip("-") or "ns"
    return f"{safe}-{instance_id:016x}{suffix}.{SERVICE_TYPE}"


class MdnsDiscovery(Discovery):
    """Advertise and browse over multicast DNS.

    Args:
        cfg: ``cfg.mdns_interfaces`` pins mDNS to those IPv4 addresses (``None``: all).
        resolve_timeout: seconds one attempt to resolve a peer's records may take.
        resolve_attempts: attempts before a peer that does not answer is skipped.
        ttl: seconds the records it publishes live in others' caches.
    """

    def __init__(
        self,
        cfg: DiscoveryConfig | None = None,
        *,
        resolve_timeout: float = 1.0,
        resolve_attempts: int = 3,
        ttl: int = _TTL,
    ) -> None:
        self._interfaces = tuple((cfg.mdns_interfaces if cfg else None) or ())
        self._ttl = ttl
        #: The name generation of each advert (``instance_name``): 1 until its name is claimed.
        self._generation: dict[tuple[str, int], int] = {}
        self._resolve_timeout = resolve_timeout
        self._resolve_attempts = resolve_attempts
        self._aiozc: AsyncZeroconf | None = None
        self._closed = False
        self._lock = asyncio.Lock()
        self._adverts: dict[tuple[str, int], AsyncServiceInfo] = {}
        #: adverts whose registration failed: ``renew`` tries again.
        self._unregistered: dict[tuple[str, int], AsyncServiceInfo] = {}
        self._watches: set[Watch] = set()
        #: zeroconf's pending announce broadcast per advert: cancelled on withdraw and close, so
        #: a late announcement cannot resurrect a withdrawn advert.
        self._announcing: dict[tuple[str, int], asyncio.Future[Any]] = {}
        #: goodbye broadcasts and cancelled announcements, awaited by close().
        self._finishing: set[asyncio.Future[Any]] = set()
        self._guard = AdvertGuard()

    async def start(self) -> None:
        """Open the mDNS sockets and wait until zeroconf runs.

        Raises:
            InvalidArgument: a pinned interface address is not one of this host's.
            OSError: the sockets could not be opened.
            RuntimeError: the discovery was closed.
        """
        async with self._lock:
            await self._start_locked()

    async def advertise(self, advert: Advert) -> None:
        """Register ``advert``, or update it if this (namespace, instance id) is already advertised.

        Raises:
            InvalidArgument: the advert has no IPv4 ``tcp://`` address or an oversized namespace.
            RuntimeError: the discovery was closed.
        """
        info = self._service_info(advert)
        async with self._lock:
            await self._start_locked()
            key = (advert.namespace, advert.instance_id)
            try:
                await self._register_locked(key, info, update=key in self._adverts)
            except Exception:
                log.exception("mDNS: could not advertise %s", info.name)
                self._unregistered[key] = info

    async def renew(self, advert: Advert) -> str | None:
        """Keep ``advert`` registered: announce it again after a goodbye we did not send, under
        a new name when another responder claims its name, or register it when that failed
        before. Returns ``None`` while it is kept, else why it is lost (the responder stopped,
        registering under a new name failed)."""
        async with self._lock:
            key = (advert.namespace, advert.instance_id)
            if self._closed or self._aiozc is None or self._aiozc.zeroconf.done:
                return "the mDNS responder stopped"
            registered = self._adverts.get(key)
            info = registered or self._unregistered.get(key)
            if info is None:
                return None  # not ours to keep (withdrawn)
            # (No ServiceInfo is built here: every advert of every worker is renewed twice a
            # second.)
            conflict = self._guard.conflict(info.name)
            if conflict is not None:
                return await self._rename_locked(advert, info, conflict)
            removed = self._guard.take_removed(info.name)
            if registered is not None and not removed:
                return None  # kept
            if registered is not None:
                log.info("mDNS: %s was removed from the network: announcing it again", info.name)
            try:
                await self._register_locked(key, info, update=registered is not None)
            except Exception as exc:
                return f"cannot register {info.name} again: {exc!r}"
            return None

    async def _rename_locked(
        self, advert: Advert, info: AsyncServiceInfo, conflict: str
    ) -> str | None:
        """Give up ``info``'s name, claimed by another responder, for the next one (RFC 6762,
        section 9); None once the advert is registered under it, else why it cannot be."""
        key = (advert.namespace, advert.instance_id)
        self._generation[key] = self._generation.get(key, 1) + 1
        renamed = self._service_info(advert)
        log.warning("mDNS: %s: announcing instance %x as %s from now on", conflict,
                    advert.instance_id, renamed.name)
        self._guard.release(info.name)
        self._cancel_announce(key)
        if self._adverts.pop(key, None) is not None and self._aiozc is not None:
            try:  # goodbyes for our records of the old name (the other responder's stay)
                self._finish_later(await self._aiozc.async_unregister_service(info))
            except Exception:
                log.exception("mDNS: could not withdraw %s", info.name)
        try:
            await self._register_locked(key, renamed, update=False)
        except Exception as exc:
            self._unregistered[key] = renamed
            return f"cannot register {renamed.name}: {exc!r}"
        return None

    async def _register_locked(
        self, key: tuple[str, int], info: AsyncServiceInfo, update: bool
    ) -> None:
        """Register ``info`` (or announce its update); raises what zeroconf raises."""
        aiozc = self._aiozc
        assert aiozc is not None
        self._cancel_announce(key)
        if update:
            sent = await aiozc.async_update_service(info)
        else:
            sent = await aiozc.async_register_service(info, cooperating_responders=True)
        self._adverts[key] = info
        self._unregistered.pop(key, None)
        self._guard.claim(info.name, info.server or "", info.port or 0,
                          info.parsed_addresses(IPVersion.V4Only))
        if isinstance(sent, asyncio.Future):
            self._announcing[key] = sent

    async def withdraw(self, advert: Advert) -> None:
        """Unregister ``advert``; peers see the goodbye within milliseconds. Unknown is ignored."""
        async with self._lock:
            key = (advert.namespace, advert.instance_id)
            self._cancel_announce(key)
            self._unregistered.pop(key, None)
            info = self._adverts.pop(key, None)
            self._generation.pop(key, None)
            if info is None or self._aiozc is None:
                return
            self._guard.release(info.name)
            try:
                sent = await self._aiozc.async_unregister_service(info)
            except Exception:
                log.exception("mDNS: could not withdraw %s", info.name)
                return
            self._finish_later(sent)

    def refresh(self) -> None:
        """Ask the network for peers again soon (every watch's paced query)."""
        for w in self._watches:
            w.kick()

    async def watch(self, namespace: str | None = None) -> AsyncIterator[DiscoveryEvent]:
        """Yield peers advertising ``namespace`` (all when ``None``) and follow their changes.

        Ends when ``close()`` is called. Close it early with ``contextlib.aclosing``.
        """
        async with self._lock:
            if self._closed:
                return
            await self._start_locked()
            assert self._aiozc is not None
            w = Watch(
                self._aiozc.zeroconf, namespace, self._interfaces,
                self._resolve_timeout, self._resolve_attempts,
            )
            self._watches.add(w)
        try:
            w.start()
            while (event := await w.queue.get()) is not None:
                yield event
        finally:
            self._watches.discard(w)
            await w.stop()

    async def close(self) -> None:
        """Withdraw every advert, end every watch and close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        async with self._lock:
            for w in list(self._watches):
                await w.stop()
            for key in list(self._announcing):
                self._cancel_announce(key)
            # Goodbyes of earlier withdrawals may not have been sent yet: let them finish.
            await asyncio.gather(*self._finishing, return_exceptions=True)
            aiozc, self._aiozc = self._aiozc, None
            self._adverts.clear()
            self._unregistered.clear()
            if aiozc is not None:
                try:
                    await aiozc.async_close()  # sends the goodbyes first
                except Exception:
                    log.exception("mDNS: error while closing zeroconf")

    async def _start_locked(self) -> None:
        if self._closed:
            raise RuntimeError("MdnsDiscovery is closed")
        if self._aiozc is not None:
            return
        # zeroconf leaks a socket when an interface is unknown, so check first.
        unknown = set(self._interfaces) - set(_local_ipv4())
        if unknown:
            raise InvalidArgument(
                f"cannot pin mDNS to {', '.join(sorted(unknown))}: not an address of this host"
            )
        interfaces = list(self._interfaces) or InterfaceChoice.All
        aiozc = AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
        try:
            await aiozc.zeroconf.async_wait_for_start()
        except BaseException:
            await aiozc.async_close()
            raise
        aiozc.zeroconf.async_add_listener(self._guard, None)
        _enlarge_receive_buffers(aiozc.zeroconf)
        self._aiozc = aiozc

    def _cancel_announce(self, key: tuple[str, int]) -> None:
        fut = self._announcing.pop(key, None)
        if fut is not None:
            fut.cancel()
            self._finish_later(fut)

    def _finish_later(self, fut: Any) -> None:
        if isinstance(fut, asyncio.Future) and not fut.done():
            self._finishing.add(fut)
            fut.add_done_callback(self._finishing.discard)

    def _service_info(self, advert: Advert) -> AsyncServiceInfo:
        ns_bytes = len(advert.namespace.encode())
        if not advert.namespace or ns_bytes > _MAX_TXT_VALUE:
            raise InvalidArgument(
                f"namespace must be 1-{_MAX_TXT_VALUE} bytes for mDNS, got {ns_bytes}"
            )
        if not 0 <= advert.instance_id < 2**64:
            raise InvalidArgument(f"instance id {advert.instance_id} is not a u64")
        ips, port = _advert_endpoint(advert.addresses, self._interfaces)
        name = instance_name(advert.namespace, advert.instance_id,
                             self._generation.get((advert.namespace, advert.instance_id), 1))
        return AsyncServiceInfo(
            SERVICE_TYPE,
            name,
            port=port,
            properties={
                "ns": advert.namespace,
                "iid": f"{advert.instance_id:016x}",
                "v": str(advert.protocol_version),
                "comps": _join_limited(advert.components, _MAX_TXT_VALUE),
                **({"key": advert.public_key} if advert.public_key else {}),
            },
            server=name.removesuffix(SERVICE_TYPE) + "local.",
            host_ttl=self._ttl,
            other_ttl=self._ttl,
            parsed_addresses=ips,
        )


def _enlarge_receive_buffers(zc: Any) -> None:
    """Give zeroconf's sockets a large receive buffer. A fleet starting together announces
    hundreds of services in seconds while a frontend's loop is busy connecting to them: with
    the default buffer (a few hundred small datagrams) a third of them were dropped at 256
    workers, and those peers were found only by a later query. Best effort (zeroconf's
    internals)."""
    try:
        socks = {t.sock for t in (*zc.engine.readers, *zc.engine.senders)}
    except AttributeError:
        return
    for sock in socks:
        try:
            sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, _RECEIVE_BUFFER)  # root
        except OSError:
            with contextlib.suppress(OSError):  # capped at net.core.rmem_max
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)


def _join_limited(names: Iterable[str], limit: int) -> str:
    """Comma-join ``names``, dropping the ones past ``limit`` bytes."""
    out: list[str] = []
    size = 0
    for name in names:
        size += len(name.encode()) + (1 if out else 0)
        if size > limit:
            log.debug("mDNS: TXT comps truncated at %r", name)
            break
        out.append(name)
    return ",".join(out)
