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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from zeroconf import IPVersion, ServiceStateChange, Zeroconf, current_time_millis
from zeroconf._services.browser import generate_service_query
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo

from ..resources import cancel_and_wait, wait_event
from ._base import PROTOCOL_VERSION, SERVICE_TYPE, DiscoveryEvent, PeerAdded, PeerRemoved
from ._mdns_addresses import local_networks, pick_ip

__all__ = ["REQUERY_INTERVAL", "REQUERY_MAX", "Watch"]

log = logging.getLogger("dynamo_zmq.discovery.mdns")

#: Seconds from a change to the first query for peers whose announcements this host missed;
#: the interval doubles while nothing changes, up to ``REQUERY_MAX``.
REQUERY_INTERVAL = 3.0
REQUERY_MAX = 60.0
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
                task = asyncio.get_running_loop().create_task(
                    self._resolve(name), name=f"mdns-resolve {name}"
                )
                self._resolving[name] = task
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif (old := self._known.pop(name, None)) is not None:
                self.queue.put_nowait(PeerRemoved(old.address, old.instance_id))
                self._changed.set()
        except Exception:
            log.exception("mDNS: error handling %s for %s", state_change, name)

    async def _resolve(self, name: str) -> None:
        try:
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            for _ in range(self._attempts):
                if await info.async_request(self._zc, self._timeout_ms):
                    break
            else:
                log.debug("mDNS: %s did not resolve in %d attempts", name, self._attempts)
                return
            self._publish(name, self._event(info))
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
        if old is not None and (event is None or event.address != old.address):
            self.queue.put_nowait(PeerRemoved(old.address, old.instance_id))
        if event is None:
            self._known.pop(name, None)
            return
        self._known[name] = event
        self.queue.put_nowait(event)
        self._changed.set()
