"""One ``MdnsDiscovery.watch()``: a browser for our service type, the resolve tasks it starts,
the events it queues, and the periodic query that finds peers the browser would not.

zeroconf's browser asks a few times at start, then only to refresh records it already knows
(RFC 6762 continuous querying). A peer it never heard, because its announcements were lost (its
link was down, or it started while ours was), would then be found only when some other record
needs refreshing: minutes. So the watch asks again now and then, listing what it knows so that
known peers stay quiet (known-answer suppression); only unknown ones answer.

Such a query lists every known peer: about 9.5 KB in 7 packets at 256 workers, which every
host receives and every responder parses. So it is paced: ``REQUERY_INTERVAL`` seconds after
the watch last saw a change (a peer added, updated or removed, or ``kick``: the caller saw a
lost peer come back, so a link may have healed), doubling while nothing changes, up to
``REQUERY_MAX``.

A service name is one instance's (it carries the instance id). When a name comes to resolve to
another address, a responder is announcing a conflicting record (a stray or cloned one, or
another responder's copy): said once per name and address, the new address is added, and the
old one is removed only as ``stale`` (the caller keeps a peer whose connection answers). The
name is resolved again once the foreign records expire. An address another known name still
leads to (an instance that took a new name) is never removed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Coroutine, Sequence
from typing import Any

from zeroconf import IPVersion, ServiceStateChange, Zeroconf, current_time_millis
from zeroconf._dns import DNSAddress, DNSRecord, DNSService
from zeroconf._services.browser import generate_service_query
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo
from zeroconf.const import _CLASS_IN, _TYPE_A, _TYPE_SRV

from ..resources import cancel_and_wait, wait_event
from ._base import PROTOCOL_VERSION, SERVICE_TYPE, DiscoveryEvent, PeerAdded, PeerRemoved
from ._mdns_addresses import local_networks, pick_ip

__all__ = ["REQUERY_INTERVAL", "REQUERY_MAX", "Watch"]

log = logging.getLogger("dynamo_zmq.discovery.mdns")

#: Seconds from a change to the first query for peers whose announcements this host missed;
#: the interval doubles while nothing changes, up to ``REQUERY_MAX``.
REQUERY_INTERVAL = 3.0
REQUERY_MAX = 60.0
#: Seconds after a conflicting record's expiry before its name is resolved again (zeroconf
#: drops expired records lazily), and the longest wait for it (a record's TTL can be anything).
RECHECK_MARGIN, RECHECK_MAX = 1.0, 600.0
#: (name, address) conflicts said by name; past this many, only the addresses change.
MAX_SAID = 1024
_ADD_OR_UPDATE = (ServiceStateChange.Added, ServiceStateChange.Updated)


class Watch:
    """One ``watch()``: a browser, the resolve tasks it starts, and the events it queues."""

    def __init__(
        self,
        zc: Zeroconf,
        namespace: str | None,
        pinned: Sequence[str],
        resolve_timeout: float,
        resolve_attempts: int,
    ) -> None:
        self.queue: asyncio.Queue[DiscoveryEvent | None] = asyncio.Queue()
        self._zc = zc
        self._namespace = namespace
        self._networks = local_networks(pinned)
        self._timeout_ms = resolve_timeout * 1000
        self._attempts = max(1, resolve_attempts)
        self._browser: AsyncServiceBrowser | None = None
        self._known: dict[str, PeerAdded] = {}
        self._resolving: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: Each name's addresses so far (a new one is a conflict), and its pending re-resolve.
        self._seen: dict[str, set[str]] = {}
        self._rechecks: dict[str, asyncio.Task[None]] = {}
        self._said: set[tuple[str, str]] = set()
        self._stopped = False
        #: Set when something changed: the next query comes ``REQUERY_INTERVAL`` after it.
        self._changed = asyncio.Event()

    def start(self) -> None:
        if self._stopped:
            return
        self._browser = AsyncServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._on_change])
        task = asyncio.get_running_loop().create_task(self._requery(), name="mdns-requery")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def kick(self) -> None:
        """Query again soon (``REQUERY_INTERVAL``): a link may have come back."""
        self._changed.set()

    async def _requery(self) -> None:
        """Ask for every peer now and then, known ones listed as known answers (they stay
        quiet); the browser reports whoever answers. Paced: see the module."""
        loop = asyncio.get_running_loop()
        interval = REQUERY_INTERVAL
        due = loop.time() + interval
        while not self._zc.done:
            self._changed.clear()
            if await wait_event(self._changed, max(0.0, due - loop.time())):
                # A change brings the next query to within REQUERY_INTERVAL, never later.
                interval = REQUERY_INTERVAL
                due = min(due, loop.time() + interval)
                continue
            interval = min(2 * interval, REQUERY_MAX)
            due = loop.time() + interval
            try:
                now = current_time_millis()
                for out in generate_service_query(self._zc, now, {SERVICE_TYPE}, True, None):
                    self._zc.async_send(out)
            except Exception:  # zeroconf's internals changed: browse as zeroconf alone does
                log.exception("mDNS: cannot send a periodic query; relying on the browser")
                return

    async def stop(self) -> None:
        """Cancel the browser and resolve tasks and end the iterator. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        browser, self._browser = self._browser, None
        if browser is not None:
            try:
                await browser.async_cancel()
            except Exception:
                log.exception("mDNS: error while cancelling a browser")
        await cancel_and_wait(self._tasks)
        self.queue.put_nowait(None)

    def _on_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        if self._stopped:
            return
        try:
            previous = self._resolving.pop(name, None)
            if previous is not None:
                previous.cancel()
            if state_change in _ADD_OR_UPDATE:
                self._resolving[name] = self._start(self._resolve(name), f"mdns-resolve {name}")
            elif (old := self._known.pop(name, None)) is not None:
                self._seen.pop(name, None)
                if (recheck := self._rechecks.pop(name, None)) is not None:
                    recheck.cancel()
                self._drop(old, stale=False)
                self._changed.set()
        except Exception:
            log.exception("mDNS: error handling %s for %s", state_change, name)

    def _start(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=what)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _resolve(self, name: str, recheck: bool = False) -> None:
        """Resolve ``name`` and publish what it resolves to; a ``recheck`` (after a conflict)
        that gets no answer drops the name (as ``stale``)."""
        try:
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            for _ in range(self._attempts):
                if await info.async_request(self._zc, self._timeout_ms):
                    break
            else:
                log.debug("mDNS: %s did not resolve in %d attempts", name, self._attempts)
                if recheck and name in self._known:
                    log.info("mDNS: %s no longer resolves: the conflicting record expired", name)
                    self._publish(name, None)
                return
            event = self._event(info)
            if recheck and event is not None and event != self._known.get(name):
                log.info("mDNS: %s resolves to %s again", name, event.address)
            self._publish(name, event)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("mDNS: error resolving %s", name)
        finally:
            if self._resolving.get(name) is asyncio.current_task():
                del self._resolving[name]

    def _event(self, info: AsyncServiceInfo) -> PeerAdded | None:
        """The ``PeerAdded`` for a resolved service, or ``None`` if it is not for this watch."""
        props = info.decoded_properties
        ns = props.get("ns")
        if ns is None or (self._namespace is not None and ns != self._namespace):
            return None
        if props.get("v") != str(PROTOCOL_VERSION):
            log.debug("mDNS: skipping %s: protocol version %r", info.name, props.get("v"))
            return None
        try:
            instance_id = int(props.get("iid") or "", 16)
        except ValueError:
            return None
        ip = pick_ip(info.parsed_addresses(IPVersion.V4Only), self._networks)
        if ip is None or not info.port:
            return None
        comps = tuple(c for c in (props.get("comps") or "").split(",") if c)
        key = props.get("key")
        return PeerAdded(
            f"tcp://{ip}:{info.port}", ns, instance_id, comps, key.encode() if key else None
        )

    def _publish(self, name: str, event: PeerAdded | None) -> None:
        old = self._known.get(name)
        if event == old:
            return
        if event is None:
            self._known.pop(name, None)
            self._seen.pop(name, None)
            if old is not None:
                self._drop(old, stale=True)
            return
        self._known[name] = event
        seen = self._seen.setdefault(name, {event.address})
        if old is not None and event.address != old.address:
            if event.address not in seen:
                seen.add(event.address)
                self._conflict(name, old, event)
            self._drop(old, stale=True)  # the caller keeps it while it answers
        self.queue.put_nowait(event)
        self._changed.set()

    def _drop(self, old: PeerAdded, stale: bool) -> None:
        """``PeerRemoved`` for ``old``'s address, unless another known name leads there."""
        if all(known.address != old.address for known in self._known.values()):
            self.queue.put_nowait(PeerRemoved(old.address, old.instance_id, stale))

    def _conflict(self, name: str, old: PeerAdded, new: PeerAdded) -> None:
        """``name`` resolved to ``old`` and now to ``new``: say so once, and resolve it again
        when the records that say ``new`` expire."""
        delay = self._expiry(name, new.address, old.address)
        if (name, new.address) not in self._said and len(self._said) < MAX_SAID:
            self._said.add((name, new.address))
            log.warning("mDNS: %s now resolves to %s, not %s: a conflicting record (a stray or "
                        "cloned responder?); %s stays in use while it answers, and the name is "
                        "resolved again in %.0f s, when that record expires", name, new.address,
                        old.address, old.address, delay)
        self._recheck_later(name, delay, old.address)

    def _recheck_later(self, name: str, delay: float, home: str) -> None:
        previous = self._rechecks.pop(name, None)
        if previous is not None:
            previous.cancel()
        self._rechecks[name] = self._start(self._recheck(name, delay, home),
                                           f"mdns-recheck {name}")

    def _forget_expired(self, name: str) -> None:
        """Drop ``name``'s expired SRV records and their targets' expired A records from the
        cache now (zeroconf drops them every 10 s, and until then may resolve with the
        latest record alone, although expired, when a valid one is there too)."""
        now = current_time_millis()
        cache = self._zc.cache
        stale: dict[DNSRecord, None] = {}  # once each: several SRV records share a target
        for srv in cache.async_all_by_details(name, _TYPE_SRV, _CLASS_IN):
            if isinstance(srv, DNSService):
                stale.update((a, None) for a in
                             cache.async_all_by_details(srv.server, _TYPE_A, _CLASS_IN)
                             if a.is_expired(now))
                if srv.is_expired(now):
                    stale[srv] = None
        try:
            cache.async_remove_records(stale)
        except Exception:  # zeroconf's internals changed: resolve with the cache as it is
            log.debug("mDNS: cannot drop the expired records of %s", name, exc_info=True)

    def _expiry(self, name: str, address: str, home: str) -> float:
        """Seconds until the cached records that make ``name`` resolve to ``address`` rather
        than ``home`` expire: its SRV records with that port, their targets' A records with
        that IP. A record ``home`` shares (the same port, or the same IP: a claimant on the
        owner's host has the owner's A record, refreshed by the owner) is not foreign."""
        ip, _, port = address.removeprefix("tcp://").rpartition(":")
        home_ip, _, home_port = home.removeprefix("tcp://").rpartition(":")
        now = current_time_millis()
        cache = self._zc.cache
        ends = []
        for srv in cache.async_all_by_details(name, _TYPE_SRV, _CLASS_IN):
            if isinstance(srv, DNSService) and str(srv.port) == port and not srv.is_expired(now):
                if port != home_port:
                    ends.append(srv.get_expiration_time(100))
                if ip == home_ip:
                    continue
                for a in cache.async_all_by_details(srv.server, _TYPE_A, _CLASS_IN):
                    if isinstance(a, DNSAddress) and not a.is_expired(now) and _ipv4(a) == ip:
                        ends.append(a.get_expiration_time(100))
        return min(RECHECK_MAX, max(0.0, (max(ends, default=now) - now) / 1000))

    async def _recheck(self, name: str, delay: float, home: str) -> None:
        """Resolve ``name`` again after ``delay``; while it still resolves away from ``home``
        (the foreign records were refreshed meanwhile), again when those expire."""
        try:
            await asyncio.sleep(delay + RECHECK_MARGIN)
            if name in self._known:
                self._forget_expired(name)
                await self._resolve(name, recheck=True)
            now = self._known.get(name)
            if now is not None and now.address != home:  # never more often than a requery
                delay = max(self._expiry(name, now.address, home), REQUERY_INTERVAL)
                self._recheck_later(name, delay, home)
        finally:
            if self._rechecks.get(name) is asyncio.current_task():
                del self._rechecks[name]


def _ipv4(record: DNSAddress) -> str:
    try:
        return socket.inet_ntoa(record.address)
    except (OSError, TypeError, ValueError):
        return ""
