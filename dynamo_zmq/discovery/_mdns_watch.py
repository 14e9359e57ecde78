"""One ``MdnsDiscovery.watch()``: a browser for our service type, the resolve tasks it starts,
the events it queues, and the periodic query that finds peers the browser would not.

zeroconf's browser asks a few times at start, then only to refresh records it already knows
(RFC 6762 continuous querying). A peer it never heard, because its announcements were lost (its
link was down, or it started while ours was), would then be found only when some other record
needs refreshing: minutes. So every ``REQUERY_INTERVAL`` seconds the watch asks again, listing
what it knows so that known peers stay quiet (known-answer suppression); only unknown ones
answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from zeroconf import IPVersion, ServiceStateChange, Zeroconf, current_time_millis
from zeroconf._services.browser import generate_service_query
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo

from ..resources import cancel_and_wait
from ._base import PROTOCOL_VERSION, SERVICE_TYPE, DiscoveryEvent, PeerAdded, PeerRemoved
from ._mdns_addresses import local_networks, pick_ip

__all__ = ["REQUERY_INTERVAL", "Watch"]

log = logging.getLogger("dynamo_zmq.discovery.mdns")

#: Seconds between the queries that find peers whose announcements this host missed.
REQUERY_INTERVAL = 3.0
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

    def start(self) -> None:
        if self._stopped:
            return
        self._browser = AsyncServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._on_change])
        task = asyncio.get_running_loop().create_task(self._requery(), name="mdns-requery")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _requery(self) -> None:
        """Ask for every peer now and then, known ones listed as known answers (they stay
        quiet); the browser reports whoever answers."""
        while not self._zc.done:
            await asyncio.sleep(REQUERY_INTERVAL)
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
