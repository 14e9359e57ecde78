"""Another mDNS responder claiming an instance's name (issue 33, items 5 and 7), real zeroconf
pinned to loopback.

The owner of a claimed name announces its advert under a new name and says so once; it never
gives the advert up. A watcher that sees a name resolve to another address keeps the old one
(removed only as ``stale``: the caller keeps a peer that answers), says so once, and resolves
the name again when the foreign records expire, back to the owner's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import AsyncIterator

import pytest

from dynamo_zmq.discovery import (
    Advert,
    DiscoveryConfig,
    DiscoveryEvent,
    MdnsDiscovery,
    PeerAdded,
    PeerRemoved,
)
from dynamo_zmq.discovery.mdns import instance_name
from tests.support.discovery import WAIT, next_event, unique_iid, unique_ns
from tests.support.procs import ROOT, pythonpath

LOOPBACK = DiscoveryConfig(mdns_interfaces=("127.0.0.1",))
MDNS_LOG = "dynamo_zmq.discovery.mdns"


async def events_for(it: AsyncIterator[DiscoveryEvent], seconds: float) -> list[DiscoveryEvent]:
    """Every event ``it`` yields within ``seconds``."""
    seen: list[DiscoveryEvent] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        try:
            seen.append(await asyncio.wait_for(it.__anext__(), left))
        except TimeoutError:
            break
    return seen


async def until_event(it: AsyncIterator[DiscoveryEvent], wanted: DiscoveryEvent,
                      timeout: float) -> list[DiscoveryEvent]:
    """Events up to and including ``wanted``; fails if it does not come within ``timeout``."""
    seen: list[DiscoveryEvent] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not seen or seen[-1] != wanted:
        left = deadline - loop.time()
        try:
            seen.append(await asyncio.wait_for(it.__anext__(), max(left, 0)))
        except TimeoutError:
            pytest.fail(f"{wanted} did not come within {timeout} s; saw {seen}")
    return seen


async def test_a_claimed_name_is_given_up_for_a_new_one_never_the_advert(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ns, iid = unique_ns(), unique_iid()
    advert = Advert(ns, iid, ("tcp://127.0.0.1:5562",), ("backend",))
    claim = Advert(ns, iid, ("tcp://127.0.0.1:5563",), ("backend",))
    renamed = f"announcing instance {iid:x} as {instance_name(ns, iid, 2)}"
    async with contextlib.AsyncExitStack() as stack:
        owner, rogue = MdnsDiscovery(LOOPBACK), MdnsDiscovery(LOOPBACK)
        for disc in (owner, rogue):
            stack.push_async_callback(disc.close)
        await owner.advertise(advert)
        assert await owner.renew(advert) is None
        # Same namespace and instance id, so the same service name; another target.
        await rogue.advertise(claim)
        with caplog.at_level(logging.INFO, logger=MDNS_LOG):
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT
            while renamed not in caplog.text:
                assert loop.time() < deadline, "the owner never took a new name"
                assert await owner.renew(advert) is None  # kept: never a lost lease
                await asyncio.sleep(0.05)
            for _ in range(10):
                assert await owner.renew(advert) is None
                await asyncio.sleep(0.05)
        assert caplog.text.count("another responder claims") == 1, caplog.text
        assert f"{instance_name(ns, iid)} (target" in caplog.text
        # The claimant leaves; a fresh watcher finds the instance under its new name alone.
        await rogue.withdraw(claim)
        watcher = MdnsDiscovery(LOOPBACK)
        stack.push_async_callback(watcher.close)
        await watcher.start()
        it = watcher.watch(ns)
        assert await next_event(it) == PeerAdded("tcp://127.0.0.1:5562", ns, iid, ("backend",))
        assert await events_for(it, 3) == []


@pytest.fixture
async def rogue_record() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Started ``tests.support.mdns_record`` processes, killed at the end."""
    procs: list[asyncio.subprocess.Process] = []
    yield procs
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def test_a_watcher_keeps_a_peer_whose_name_is_claimed_and_resolves_it_again(
    caplog: pytest.LogCaptureFixture, rogue_record: list[asyncio.subprocess.Process],
) -> None:
    ns, iid = unique_ns(), unique_iid()
    real, fake = "tcp://127.0.0.1:5570", "tcp://127.0.0.1:5571"
    async with contextlib.AsyncExitStack() as stack:
        # An owner that never renews: it does not take a new name (an older release, or one
        # the claim did not reach), so the watcher alone must keep things straight.
        owner, watcher = MdnsDiscovery(LOOPBACK), MdnsDiscovery(LOOPBACK)
        for disc in (owner, watcher):
            stack.push_async_callback(disc.close)
        await watcher.start()
        it = watcher.watch(ns)
        await owner.advertise(Advert(ns, iid, (real,), ("backend",)))
        assert await next_event(it) == PeerAdded(real, ns, iid, ("backend",))

        env = {**os.environ, "PYTHONPATH": pythonpath()}
        rogue = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.support.mdns_record", ns, f"{iid:x}", fake, "backend",
            "--ttl", "5", cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE)
        rogue_record.append(rogue)
        assert rogue.stdout is not None
        assert (await asyncio.wait_for(rogue.stdout.readline(), WAIT)).startswith(b"READY")
        with caplog.at_level(logging.INFO, logger=MDNS_LOG):
            claimed = await until_event(it, PeerAdded(fake, ns, iid, ("backend",)), WAIT)
            # The owner's address is only ever removed as stale: its connection decides.
            assert claimed[-2:] == [PeerRemoved(real, iid, stale=True),
                                    PeerAdded(fake, ns, iid, ("backend",))], claimed
            # The claimant dies without a goodbye: its records expire after their 5 s TTL,
            # and the name is resolved again, to the owner, who still answers for it.
            os.kill(rogue.pid, signal.SIGKILL)
            await rogue.wait()
            back = await until_event(it, PeerAdded(real, ns, iid, ("backend",)), 30)
            assert PeerRemoved(real, iid) not in claimed + back  # never a plain removal
            assert back[-2:] == [PeerRemoved(fake, iid, stale=True),
                                 PeerAdded(real, ns, iid, ("backend",))], back
        said = f"now resolves to {fake}, not {real}: a conflicting record"
        assert caplog.text.count(said) == 1, caplog.text
        # Resolved again when the claimant's records expire, not the owner's: both are on
        # 127.0.0.1, so the owner's A record (TTL 120) is not the claimant's to wait for.
        when = re.search(r"resolved again in (\d+) s", caplog.text)
        assert when is not None and int(when[1]) <= 5, caplog.text
        assert f"{instance_name(ns, iid)} resolves to {real} again" in caplog.text
