"""The runtime's registrations in discovery: one advert per namespace, renewed every
``LEASE_KEEPALIVE`` seconds while the primary lease lives (Dynamo's lease keep-alive task), and
withdrawn when an endpoint's namespace empties, at drain, at close, or when the lease ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from ..discovery import Advert, Discovery
from ..resources import Resources
from ._lease import Lease

__all__ = ["LEASE_KEEPALIVE", "Registrations"]

#: Seconds between renewals of the runtime's registrations (its lease keep-alive).
LEASE_KEEPALIVE = 0.5


class Registrations:
    """What this process has advertised, per namespace, kept alive under ``lease``.

    ``start_discovery`` starts the discovery backend (once) before the first advert.
    """

    def __init__(
        self,
        discovery: Discovery,
        lease: Lease,
        resources: Resources,
        start_discovery: Callable[[], Awaitable[Discovery]],
    ) -> None:
        self._discovery = discovery
        self._lease = lease
        self._res = resources
        self._start_discovery = start_discovery
        self._advertised: dict[str, Advert] = {}
        self._keeping = False

    async def advertise(self, advert: Advert) -> None:
        """Register ``advert`` (unless it is already what its namespace advertises) and keep
        every registration alive from then on."""
        if self._advertised.get(advert.namespace) != advert:
            await self._start_discovery()
            await self._discovery.advertise(advert)
            self._advertised[advert.namespace] = advert
        if not self._keeping:
            self._keeping = True
            self._res.spawn(self._keep(), "lease-keepalive")

    async def withdraw(self, namespace: str) -> None:
        """Withdraw the advert of ``namespace`` (if there is one)."""
        advert = self._advertised.pop(namespace, None)
        if advert is not None:
            await self._discovery.withdraw(advert)

    async def withdraw_all(self) -> None:
        """Withdraw every advert (best effort: a failing backend withdraws what it can)."""
        adverts = list(self._advertised.values())
        self._advertised.clear()  # first, so the keep-alive renews none of them
        for advert in adverts:
            with contextlib.suppress(Exception):
                await self._discovery.withdraw(advert)

    async def _keep(self) -> None:
        """Renew every registration until the lease ends (Dynamo's lease keep-alive task)."""
        while self._lease.is_valid():
            await asyncio.sleep(LEASE_KEEPALIVE)
            for advert in list(self._advertised.values()):
                if advert not in self._advertised.values():
                    continue  # withdrawn meanwhile: nothing to keep
                try:
                    reason = await self._discovery.renew(advert)
                except Exception as exc:  # Dynamo: a failed keep-alive task ends the lease too
                    reason = f"renewing failed: {exc!r}"
                if reason is not None and advert in self._advertised.values():
                    self._lease.revoke(f"registration in {advert.namespace!r} lost: {reason}")
                    return
