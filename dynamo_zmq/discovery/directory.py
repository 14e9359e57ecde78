"""Directory discovery: adverts as files in a directory every host mounts (the NFS, Lustre or
GPFS home of an HPC cluster), for networks where multicast does not cross.

``--discovery dir --discovery-dir PATH`` (``DYN_DISCOVERY_DIR``). Each advert is one small JSON
file (``_dir_files.py``), written atomically (a temporary file, then rename), refreshed every
``heartbeat`` seconds (its mtime touched; rewritten if it vanished) and removed on shutdown.
Readers (``_dir_watch.py``) follow the directory with inotify where it sees every change (a
local filesystem) and by polling where it does not (a network filesystem: inotify there sees
only this host's writes), skip files that do not parse with one log line, report adverts not
refreshed for ``stale_after`` seconds as stale, and delete those untouched for ``gc_after``.

What is in the directory only says where a peer might be, as an mDNS record does: liveness in
routing is the connection's own (pings and socket events), so a stale file never takes a live
peer out of routing, and a fresh file of a dead process never puts it in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from ..errors import InvalidArgument
from ._base import Advert, Discovery, DiscoveryEvent
from ._config import DiscoveryConfig
from ._dir_files import (
    advert_file_name,
    encode_advert,
    filesystem_type,
    is_network_filesystem,
    write_atomic,
)
from ._dir_watch import DirScanner, DirWatch

__all__ = ["DIR_HEARTBEAT", "DIR_STALE", "DirectoryDiscovery"]

log = logging.getLogger(__name__)

#: Seconds between two refreshes of an advert file (512 workers: 51 writes a second).
DIR_HEARTBEAT = 10.0
#: Seconds without a refresh after which readers report an advert stale.
DIR_STALE = 60.0
#: Seconds without a refresh after which readers delete an advert file.
DIR_GC = 600.0
#: Seconds between passes where the directory is polled, and between the passes that judge
#: staleness where inotify reports changes.
POLL_INTERVAL = 1.0
CHECK_INTERVAL = 5.0
#: Seconds between two warnings about adverts that cannot be written.
WARN_EVERY = 60.0


class DirectoryDiscovery(Discovery):
    """Advertise and watch through advert files in ``cfg.discovery_dir``.

    Args:
        cfg: ``discovery_dir`` (required) and ``dir_watch``: ``auto`` (inotify on a local
            filesystem, polling on a network one), ``inotify`` or ``poll``.
        heartbeat, stale_after, gc_after, poll_interval: seconds (the module's constants).
    """

    def __init__(
        self,
        cfg: DiscoveryConfig,
        *,
        heartbeat: float = DIR_HEARTBEAT,
        stale_after: float = DIR_STALE,
        gc_after: float = DIR_GC,
        poll_interval: float = POLL_INTERVAL,
    ) -> None:
        if not cfg.discovery_dir:
            raise InvalidArgument("directory discovery needs --discovery-dir (DYN_DISCOVERY_DIR)")
        self.directory = Path(cfg.discovery_dir)
        self._mode = cfg.dir_watch
        self._heartbeat = heartbeat
        self._stale_after = stale_after
        self._gc_after = gc_after
        self._poll_interval = poll_interval
        #: Our adverts: (namespace, instance id) -> (file name, content, last written).
        self._mine: dict[tuple[str, int], tuple[str, bytes, float]] = {}
        self._watches: set[DirWatch] = set()
        self._closed = False
        self._warned_at = -WARN_EVERY
        self._notify = False

    async def start(self) -> None:
        """Create the directory if it is missing and choose how to follow it.

        Raises:
            InvalidArgument: the path exists and is not a directory, or cannot be created.
        """
        try:
            await asyncio.to_thread(self.directory.mkdir, parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise InvalidArgument(f"--discovery-dir {self.directory}: not a directory") from exc
        except OSError as exc:
            raise InvalidArgument(f"--discovery-dir {self.directory}: {exc}") from exc
        kind = await asyncio.to_thread(filesystem_type, self.directory)
        self._notify = self._mode == "inotify" or (
            self._mode == "auto" and not is_network_filesystem(kind))
        log.info("discovery directory %s (%s): %s", self.directory, kind or "unknown filesystem",
                 "inotify" if self._notify else f"polled every {self._poll_interval:g} s")

    async def advertise(self, advert: Advert) -> None:
        """Write ``advert``'s file (replacing an earlier one of the same instance). A failed
        write is logged and tried again by ``renew``."""
        key = (advert.namespace, advert.instance_id)
        name, data = advert_file_name(*key), encode_advert(advert)
        self._mine[key] = (name, data, -float("inf"))
        await self._write(key)

    async def renew(self, advert: Advert) -> str | None:
        """Refresh the advert's file every heartbeat (rewrite it if it vanished). A shared
        filesystem that fails for a while is logged, never a reason to give the lease up."""
        key = (advert.namespace, advert.instance_id)
        mine = self._mine.get(key)
        if mine is not None and time.monotonic() - mine[2] >= self._heartbeat:
            await self._write(key, touch=True)
        return None

    async def _write(self, key: tuple[str, int], touch: bool = False) -> None:
        name, data, _ = self._mine[key]
        path = self.directory / name

        def write() -> None:
            if touch:
                try:
                    os.utime(path)
                    return
                except FileNotFoundError:
                    log.info("advert file %s was removed: writing it again", name)
            write_atomic(self.directory, name, data)

        try:
            await asyncio.to_thread(write)
        except OSError as exc:
            now = time.monotonic()
            if now - self._warned_at >= WARN_EVERY:
                self._warned_at = now
                log.warning("cannot write advert %s to %s: %s", name, self.directory, exc)
            return
        if key in self._mine:  # not withdrawn meanwhile
            self._mine[key] = (name, data, time.monotonic())

    async def withdraw(self, advert: Advert) -> None:
        """Remove the advert's file; watchers see it gone at their next pass."""
        mine = self._mine.pop((advert.namespace, advert.instance_id), None)
        if mine is not None:
            await asyncio.to_thread(self._remove, mine[0])

    def _remove(self, name: str) -> None:
        try:
            (self.directory / name).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot remove advert %s from %s: %s", name, self.directory, exc)

    async def watch(self, namespace: str | None = None) -> AsyncIterator[DiscoveryEvent]:
        """Yield the adverts of ``namespace`` (all when ``None``) and follow their changes.

        Ends when ``close()`` is called. Close it early with ``contextlib.aclosing``.
        """
        if self._closed:
            return
        scanner = DirScanner(self.directory, namespace, self._stale_after, self._gc_after)
        interval = CHECK_INTERVAL if self._notify else self._poll_interval
        w = DirWatch(scanner, interval, self._notify)
        self._watches.add(w)
        try:
            w.start()
            while (event := await w.queue.get()) is not None:
                yield event
        finally:
            self._watches.discard(w)
            await w.stop()

    async def close(self) -> None:
        """Remove every advert file of ours and end every watch. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in list(self._watches):
            await w.stop()
        mine, self._mine = self._mine, {}
        for name, _, _ in mine.values():
            await asyncio.to_thread(self._remove, name)
