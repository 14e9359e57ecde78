"""Reading a discovery directory: ``DirScanner`` turns one pass over it into events, and
``DirWatch`` (one ``DirectoryDiscovery.watch()``) runs passes when inotify says something
changed, or every poll interval where inotify cannot see other hosts (NFS, Lustre, GPFS).

A pass lists the directory and reads only the files whose size or inode changed (a heartbeat
only moves a file's mtime). A file that does not parse is logged once (per version of it) and
skipped. A file not refreshed for ``stale_after`` seconds is reported removed with
``stale=True`` (the peer pool drops the peer only if our own liveness finds it dead too), and
reported again if it is refreshed; one untouched for ``gc_after`` seconds is deleted, so a
directory shared by many jobs does not fill with the adverts of killed processes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..resources import cancel_and_wait, wait_event
from ._base import DiscoveryEvent, PeerAdded, PeerRemoved
from ._dir_files import SUFFIX, DirAdvert, decode_advert
from ._mdns_addresses import local_networks, pick_ip

__all__ = ["DirScanner", "DirWatch", "pick_address"]

log = logging.getLogger("dynamo_zmq.discovery.directory")

#: Seconds to let a burst of changes (a fleet starting) settle before a pass.
SETTLE = 0.05


def pick_address(
    addresses: Sequence[str], networks: Sequence[ipaddress.IPv4Network]
) -> str | None:
    """The address to dial among an advert's: one on a local network if any (``pick_ip``),
    else the first (a routed subnet)."""
    by_ip: dict[str, str] = {}
    for address in addresses:
        host = address.removeprefix("tcp://").rpartition(":")[0]
        try:
            by_ip.setdefault(str(ipaddress.IPv4Address(host)), address)
        except ValueError:
            continue
    ip = pick_ip(list(by_ip), networks)
    if ip is not None:
        return by_ip[ip]
    return addresses[0] if addresses else None


@dataclass
class _Entry:
    stamp: tuple[int, int]  # (size, inode): what a heartbeat leaves alone
    event: PeerAdded | None  # None: not for this watch, or garbage
    stale: bool = False


class DirScanner:
    """One watch's view of the directory; ``scan`` is blocking (run it in a thread).

    Args:
        directory: the discovery directory.
        namespace: report only adverts of this namespace (None: all).
        stale_after: seconds without a refresh after which an advert is reported stale.
        gc_after: seconds without a refresh after which an advert file is deleted.
    """

    def __init__(
        self, directory: Path, namespace: str | None, stale_after: float, gc_after: float
    ) -> None:
        self.directory = directory
        self.namespace = namespace
        self.stale_after = stale_after
        self.gc_after = gc_after
        self._networks = local_networks(())
        self._known: dict[str, _Entry] = {}
        #: The (size, inode, mtime) of each garbage file already logged.
        self._logged: dict[str, tuple[int, int, int]] = {}
        self._unreadable = False

    def scan(self, now: float | None = None) -> list[DiscoveryEvent]:
        """One pass: the events since the last one (``now``: wall-clock time, for tests)."""
        now = time.time() if now is None else now
        try:
            entries = list(os.scandir(self.directory))
        except OSError as exc:
            if not self._unreadable:
                log.warning("cannot read the discovery directory %s: %s", self.directory, exc)
            self._unreadable = True
            return []  # what is known stays: an NFS hiccup is not every peer leaving
        self._unreadable = False
        events: list[DiscoveryEvent] = []
        seen: set[str] = set()
        for entry in entries:
            name = entry.name
            if name.startswith(".") or not name.endswith(SUFFIX):
                continue
            try:
                st = entry.stat()
            except OSError:
                continue  # removed meanwhile
            age = now - st.st_mtime
            if age > self.gc_after:
                self._collect(entry.path, age)
                continue
            seen.add(name)
            self._update(name, entry.path, (st.st_size, st.st_ino), st.st_mtime_ns, age, events)
        for name in [n for n in self._known if n not in seen]:
            gone = self._known.pop(name)
            self._logged.pop(name, None)
            if gone.event is not None and not gone.stale:
                events.append(PeerRemoved(gone.event.address, gone.event.instance_id))
        return events

    def _update(
        self, name: str, path: str, stamp: tuple[int, int], mtime_ns: int, age: float,
        events: list[DiscoveryEvent],
    ) -> None:
        old = self._known.get(name)
        if old is None or old.stamp != stamp:
            event = self._read(name, path, (*stamp, mtime_ns))
            if old is not None and old.event is not None and not old.stale and (
                    event is None or event.address != old.event.address):
                events.append(PeerRemoved(old.event.address, old.event.instance_id))
            old_reported = old is not None and old.event == event and not old.stale
            old = self._known[name] = _Entry(stamp, event, stale=False)
            if event is not None and not old_reported and age <= self.stale_after:
                events.append(event)
            elif event is not None and age > self.stale_after:
                old.stale = True
            return
        if old.event is None:
            return
        if age > self.stale_after and not old.stale:
            old.stale = True
            events.append(PeerRemoved(old.event.address, old.event.instance_id, stale=True))
        elif age <= self.stale_after and old.stale:
            old.stale = False
            events.append(old.event)

    def _read(self, name: str, path: str, version: tuple[int, int, int]) -> PeerAdded | None:
        try:
            with open(path, "rb") as f:
                advert = decode_advert(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            if self._logged.get(name) != version:
                self._logged[name] = version
                log.warning("ignoring %s in the discovery directory: %s", name, exc)
            return None
        self._logged.pop(name, None)
        return self._event(advert)

    def _event(self, advert: DirAdvert) -> PeerAdded | None:
        if self.namespace is not None and advert.ns != self.namespace:
            return None
        address = pick_address(advert.addresses, self._networks)
        if address is None:
            return None
        return PeerAdded(address, advert.ns, int(advert.iid, 16), tuple(advert.comps),
                         advert.key.encode() if advert.key else None)

    def _collect(self, path: str, age: float) -> None:
        try:
            os.unlink(path)
            log.info("deleted %s from the discovery directory: not refreshed for %.0f s",
                     os.path.basename(path), age)
        except OSError:
            pass  # another reader did, or we may not


class DirWatch:
    """One ``watch()``: passes of a ``DirScanner`` when inotify signals a change (``notify``)
    or every ``interval`` seconds, their events queued for the iterator."""

    def __init__(self, scanner: DirScanner, interval: float, notify: bool) -> None:
        self.queue: asyncio.Queue[DiscoveryEvent | None] = asyncio.Queue()
        self._scanner = scanner
        self._interval = interval
        self._notify = notify
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._inotify: Any = None  # inotify_simple.INotify (optional dependency)
        self._stopped = False

    def start(self) -> None:
        if self._notify:
            self._watch_inotify()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dir-watch")

    def _watch_inotify(self) -> None:
        try:
            from inotify_simple import INotify, flags
        except ImportError:  # not Linux, or not installed: polling does it, only slower
            return
        try:
            ino = INotify(nonblocking=True)
            ino.add_watch(self._scanner.directory, flags.CREATE | flags.MOVED_TO | flags.DELETE
                          | flags.MOVED_FROM | flags.CLOSE_WRITE | flags.ATTRIB)
        except OSError as exc:
            log.info("no inotify on %s (%s): polling every %g s", self._scanner.directory, exc,
                     self._interval)
            return

        def readable() -> None:
            try:
                if ino.read(timeout=0):
                    self._poke.set()
            except OSError:
                pass

        asyncio.get_running_loop().add_reader(ino.fileno(), readable)
        self._inotify = ino

    async def _run(self) -> None:
        while not self._stopped:
            try:
                for event in await asyncio.to_thread(self._scanner.scan):
                    self.queue.put_nowait(event)
            except Exception:
                log.exception("reading the discovery directory failed")
            self._poke.clear()
            if await wait_event(self._poke, self._interval):
                await asyncio.sleep(SETTLE)  # a fleet writes hundreds of files at once

    async def stop(self) -> None:
        """Stop reading and end the iterator. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        ino, self._inotify = self._inotify, None
        if ino is not None:
            asyncio.get_running_loop().remove_reader(ino.fileno())
            ino.close()
        if self._task is not None:
            await cancel_and_wait((self._task,))
        self.queue.put_nowait(None)
