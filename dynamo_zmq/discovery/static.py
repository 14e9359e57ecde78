"""Static discovery: a fixed list of peer addresses, optionally from a file that is re-read.

Static peers are configured on the watching side, so ``advertise``/``withdraw`` do nothing and
events carry no hints (namespace, instance id, components): the handshake fetches those. An
entry may carry the peer's CURVE key (``tcp://host:port key=<Z85>``), which the event carries.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

from ..errors import InvalidArgument
from ..resources import wait_event
from ._base import Advert, Discovery, DiscoveryEvent, PeerAdded, PeerRemoved
from ._config import DiscoveryConfig, read_static_file, split_entry

__all__ = ["StaticDiscovery"]

log = logging.getLogger(__name__)

_FileStamp = tuple[int, int, int]
_MISSING: _FileStamp = (-1, -1, -1)


class StaticDiscovery(Discovery):
    """Reports ``cfg.static_addresses`` plus the lines of ``cfg.static_file``.

    Args:
        cfg: the configuration; its backend is not checked, only its static fields are used.
        poll_interval: seconds between checks of the static file for changes.
    """

    def __init__(self, cfg: DiscoveryConfig, *, poll_interval: float = 1.0) -> None:
        self._cfg = cfg
        self._poll_interval = poll_interval
        self._closed = asyncio.Event()

    async def start(self) -> None:
        """Check that the static file, if any, can be read and parsed.

        Raises:
            InvalidArgument: the file is missing or holds a bad address.
        """
        if self._cfg.static_file is not None:
            read_static_file(self._cfg.static_file)

    async def advertise(self, advert: Advert) -> None:
        """Do nothing: static peers are configured where they are watched."""

    async def withdraw(self, advert: Advert) -> None:
        """Do nothing: static peers are configured where they are watched."""

    async def watch(self, namespace: str | None = None) -> AsyncIterator[DiscoveryEvent]:
        """Yield a ``PeerAdded`` per configured address, then follow the static file's edits.

        ``namespace`` is ignored: a static peer may serve any namespace, the handshake tells.
        """
        path = self._cfg.static_file
        stamp, from_file = self._load(path, None, ())
        current = _merge(self._cfg.static_addresses, from_file)
        for entry in current:
            if self._closed.is_set():
                return
            yield _added(entry)
        if path is None:
            await self._closed.wait()
            return
        while not self._closed.is_set():
            if await wait_event(self._closed, self._poll_interval):
                return
            stamp, from_file = self._load(path, stamp, from_file)
            new = _merge(self._cfg.static_addresses, from_file)
            for entry in current:
                if entry not in new:
                    yield PeerRemoved(split_entry(entry)[0])
            for entry in new:
                if entry not in current:
                    yield _added(entry)
            current = new

    async def close(self) -> None:
        """End every ``watch`` iterator. Idempotent."""
        self._closed.set()

    @staticmethod
    def _load(
        path: str | None, stamp: _FileStamp | None, previous: tuple[str, ...]
    ) -> tuple[_FileStamp | None, tuple[str, ...]]:
        """Re-read ``path`` if its stamp changed; keep ``previous`` when it is unreadable or bad."""
        if path is None:
            return None, ()
        try:
            st = os.stat(path)
        except OSError as exc:
            if stamp != _MISSING:
                log.warning("static discovery file %r unavailable: %s", path, exc)
            return _MISSING, previous
        new_stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if new_stamp == stamp:
            return stamp, previous
        try:
            return new_stamp, read_static_file(path)
        except InvalidArgument as exc:
            log.warning("ignoring edit to static discovery file: %s", exc.message)
            return new_stamp, previous


def _added(entry: str) -> PeerAdded:
    address, key = split_entry(entry)
    return PeerAdded(address, key=key)


def _merge(first: tuple[str, ...], second: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(first + second))
