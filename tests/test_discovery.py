"""Discovery: static config and file polling, and real mDNS pinned to loopback.

mDNS tests never touch the machine's real interfaces (``mdns_interfaces=("127.0.0.1",)``) and use
a fresh namespace each, so parallel runs on one host never see each other's adverts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import re
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from zeroconf.asyncio import AsyncServiceInfo

import dynamo_zmq.discovery as discovery
from dynamo_zmq.discovery import (
    PROTOCOL_VERSION,
    Advert,
    DiscoveryConfig,
    DiscoveryEvent,
    MdnsDiscovery,
    PeerAdded,
    PeerRemoved,
    StaticDiscovery,
    add_discovery_args,
    make_discovery,
)
from dynamo_zmq.discovery.mdns import _pick_ip, instance_name
from dynamo_zmq.errors import InvalidArgument
from tests.support.discovery import WAIT, next_event, unique_iid, unique_ns

LOOPBACK = DiscoveryConfig(mdns_interfaces=("127.0.0.1",))
REPO = Path(__file__).resolve().parent.parent


async def wait_until_seen(it: AsyncIterator[DiscoveryEvent], expected: DiscoveryEvent) -> None:
    """Skip other events (a watch of every namespace also sees parallel test runs)."""

    async def scan() -> None:
        async for event in it:
            if event == expected:
                return
        raise AssertionError(f"watch ended before {expected}")

    await asyncio.wait_for(scan(), WAIT)


@pytest.fixture
async def mdns_pair() -> AsyncIterator[tuple[MdnsDiscovery, MdnsDiscovery]]:
    """Two independent zeroconf instances on loopback: an advertiser and a watcher."""
    a, b = MdnsDiscovery(LOOPBACK), MdnsDiscovery(LOOPBACK)
    try:
        await a.start()
        await b.start()
        yield a, b
    finally:
        await a.close()
        await b.close()


# --- package surface ----------------------------------------------------------------------------


def test_all_exports_exist() -> None:
    assert len(set(discovery.__all__)) == len(discovery.__all__)
    for name in discovery.__all__:
        assert hasattr(discovery, name), name


def test_make_discovery_picks_backend() -> None:
    assert isinstance(make_discovery(DiscoveryConfig()), MdnsDiscovery)
    cfg = DiscoveryConfig(backend="static", static_addresses=("tcp://h:1",))
    assert isinstance(make_discovery(cfg), StaticDiscovery)


# --- config ---------------------------------------------------------------------------------------


def test_config_from_flags() -> None:
    parser = argparse.ArgumentParser()
    add_discovery_args(parser, environ={})
    args = parser.parse_args(
        [
            "--discovery",
            "static",
            "--static-workers",
            "tcp://10.0.0.1:5000, tcp://node-b:5001",
            "--mdns-interfaces",
            "127.0.0.1",
        ]
    )
    cfg = DiscoveryConfig.from_args(args)
    assert cfg.backend == "static"
    assert cfg.static_addresses == ("tcp://10.0.0.1:5000", "tcp://node-b:5001")
    assert cfg.static_file is None
    assert cfg.mdns_interfaces == ("127.0.0.1",)


def test_config_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_discovery_args(parser, environ={})
    cfg = DiscoveryConfig.from_args(parser.parse_args([]))
    assert cfg == DiscoveryConfig()
    assert DiscoveryConfig.from_env({}) == DiscoveryConfig()


def test_config_from_env() -> None:
    env = {
        "DYN_DISCOVERY": "static",
        "DYN_STATIC_WORKERS": "tcp://a:1,tcp://b:2",
        "DYN_STATIC_FILE": "/tmp/peers.txt",
        "DYN_MDNS_INTERFACES": "127.0.0.1, 10.1.2.3",
    }
    cfg = DiscoveryConfig.from_env(env)
    assert cfg == DiscoveryConfig(
        "static", ("tcp://a:1", "tcp://b:2"), "/tmp/peers.txt", ("127.0.0.1", "10.1.2.3")
    )


def test_flag_defaults_come_from_env_and_flags_win() -> None:
    env = {"DYN_DISCOVERY": "static", "DYN_STATIC_WORKERS": "tcp://a:1"}
    parser = argparse.ArgumentParser()
    add_discovery_args(parser, environ=env)
    assert DiscoveryConfig.from_args(parser.parse_args([])).static_addresses == ("tcp://a:1",)
    args = parser.parse_args(["--static-workers", "tcp://b:2"])
    assert DiscoveryConfig.from_args(args).static_addresses == ("tcp://b:2",)


@pytest.mark.parametrize(
    "address",
    [
        "10.0.0.1:5000",
        "udp://10.0.0.1:5000",
        "tcp://10.0.0.1",
        "tcp://:5000",
        "tcp://10.0.0.1:0",
        "tcp://10.0.0.1:65536",
        "tcp://10.0.0.1:http",
        "tcp://a b:1",
    ],
)
def test_bad_static_address_is_invalid(address: str) -> None:
    with pytest.raises(InvalidArgument, match="tcp://host:port"):
        DiscoveryConfig(backend="static", static_addresses=(address,))
    with pytest.raises(InvalidArgument):
        DiscoveryConfig.from_env({"DYN_DISCOVERY": "static", "DYN_STATIC_WORKERS": address})


def test_unknown_backend_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="etcd"):
        DiscoveryConfig(backend="etcd")
    with pytest.raises(InvalidArgument):
        DiscoveryConfig.from_env({"DYN_DISCOVERY": "etcd"})


async def test_static_without_peers_is_allowed_and_quiet() -> None:
    # A serving process in static mode needs no peers: it is found by the watchers' lists.
    disc = StaticDiscovery(DiscoveryConfig(backend="static"))
    await disc.start()
    pending = asyncio.ensure_future(anext(disc.watch()))
    await asyncio.sleep(0)
    assert not pending.done()
    await disc.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(pending, WAIT)


def test_bad_mdns_interface_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="IPv4"):
        DiscoveryConfig(mdns_interfaces=("eth0",))


# --- static backend -------------------------------------------------------------------------------


async def test_static_lists_configured_peers_without_hints() -> None:
    cfg = DiscoveryConfig(backend="static", static_addresses=("tcp://a:1", "tcp://b:2"))
    disc = StaticDiscovery(cfg)
    await disc.start()
    await disc.advertise(Advert("ns", 1, ("tcp://self:9",)))  # no-op
    it = disc.watch("ns")
    assert await next_event(it) == PeerAdded("tcp://a:1")
    assert await next_event(it) == PeerAdded("tcp://b:2")
    waiting = asyncio.ensure_future(anext(it))
    await asyncio.sleep(0)
    assert not waiting.done()
    await disc.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiting, WAIT)
    await disc.close()  # idempotent


async def test_static_file_is_read_and_followed(tmp_path: Path) -> None:
    peers = tmp_path / "peers.txt"
    peers.write_text("# workers\ntcp://a:1\n\ntcp://b:2  # second\n")
    cfg = DiscoveryConfig(backend="static", static_addresses=("tcp://c:3",), static_file=str(peers))
    disc = StaticDiscovery(cfg, poll_interval=0.01)
    await disc.start()
    try:
        it = disc.watch()
        first = {await next_event(it) for _ in range(3)}
        assert first == {PeerAdded("tcp://c:3"), PeerAdded("tcp://a:1"), PeerAdded("tcp://b:2")}

        peers.write_text("tcp://b:2\ntcp://d:4\ntcp://c:3\n")
        changes = {await next_event(it) for _ in range(2)}
        assert changes == {PeerRemoved("tcp://a:1"), PeerAdded("tcp://d:4")}

        # A bad edit is ignored, the previous list stands; the next good edit applies.
        peers.write_text("tcp://b:2\nnot-an-address\n")
        peers.write_text("tcp://d:4\n")
        assert await next_event(it) == PeerRemoved("tcp://b:2")
        # c:3 is configured by flag as well, so dropping it from the file keeps it.
    finally:
        await disc.close()


async def test_static_missing_file_is_invalid(tmp_path: Path) -> None:
    cfg = DiscoveryConfig(backend="static", static_file=str(tmp_path / "absent.txt"))
    with pytest.raises(InvalidArgument, match=r"absent\.txt"):
        await StaticDiscovery(cfg).start()


async def test_static_file_with_bad_line_is_invalid(tmp_path: Path) -> None:
    peers = tmp_path / "peers.txt"
    peers.write_text("tcp://a:1\ntcp://b\n")
    cfg = DiscoveryConfig(backend="static", static_file=str(peers))
    with pytest.raises(InvalidArgument, match="tcp://b"):
        await StaticDiscovery(cfg).start()


# --- mDNS ---------------------------------------------------------------------------------------


@given(st.text(min_size=1, max_size=120), st.integers(0, 2**64 - 1))
def test_instance_name_is_a_dns_label(namespace: str, instance_id: int) -> None:
    name = instance_name(namespace, instance_id)
    label = name.removesuffix("." + discovery.SERVICE_TYPE)
    assert label.endswith(f"-{instance_id:016x}")
    assert len(label.encode()) <= 63
    assert re.fullmatch(r"[A-Za-z0-9-]+", label)
    AsyncServiceInfo(discovery.SERVICE_TYPE, name)  # zeroconf accepts it


def test_address_choice_prefers_attached_networks_then_non_loopback() -> None:
    lo, lan = ipaddress.IPv4Network("127.0.0.0/8"), ipaddress.IPv4Network("10.1.0.0/16")
    assert _pick_ip(["127.0.0.1", "10.1.2.3"], [lo, lan]) == "10.1.2.3"
    assert _pick_ip(["10.1.2.3", "127.0.0.1"], [lo]) == "127.0.0.1"
    assert _pick_ip(["172.16.0.1", "10.1.2.3"], [lan]) == "10.1.2.3"
    assert _pick_ip(["172.16.0.1", "172.16.0.2"], [lan]) == "172.16.0.1"
    assert _pick_ip([], [lan]) is None


async def test_mdns_watcher_sees_advert_and_withdraw(
    mdns_pair: tuple[MdnsDiscovery, MdnsDiscovery],
) -> None:
    a, b = mdns_pair
    ns, iid = unique_ns(), unique_iid()
    it = b.watch(ns)
    advert = Advert(ns, iid, ("tcp://127.0.0.1:5555",), ("backend", "prefill"))
    await a.advertise(advert)
    assert await next_event(it) == PeerAdded(
        "tcp://127.0.0.1:5555", ns, iid, ("backend", "prefill")
    )
    await a.withdraw(advert)
    assert await next_event(it) == PeerRemoved("tcp://127.0.0.1:5555", iid)
    await a.withdraw(advert)  # unknown now: ignored


async def test_mdns_withdraw_then_close_still_says_goodbye(
    mdns_pair: tuple[MdnsDiscovery, MdnsDiscovery],
) -> None:
    a, b = mdns_pair
    ns, iid = unique_ns(), unique_iid()
    it = b.watch(ns)
    advert = Advert(ns, iid, ("tcp://127.0.0.1:5556",))
    await a.advertise(advert)
    assert isinstance(await next_event(it), PeerAdded)
    await a.withdraw(advert)
    await a.close()  # at once: the pending goodbye must still go out
    assert await next_event(it) == PeerRemoved("tcp://127.0.0.1:5556", iid)


async def test_mdns_namespaces_are_isolated(
    mdns_pair: tuple[MdnsDiscovery, MdnsDiscovery],
) -> None:
    a, b = mdns_pair
    ns_a, ns_b = unique_ns(), unique_ns()
    iid_a, iid_b1, iid_b2 = unique_iid(), unique_iid(), unique_iid()
    watch_b = b.watch(ns_b)
    await a.advertise(Advert(ns_b, iid_b1, ("tcp://127.0.0.1:6001",)))
    assert await next_event(watch_b) == PeerAdded("tcp://127.0.0.1:6001", ns_b, iid_b1)
    # A's advert goes out between B's two; B's watcher must skip straight to the second.
    await a.advertise(Advert(ns_a, iid_a, ("tcp://127.0.0.1:6002",)))
    await a.advertise(Advert(ns_b, iid_b2, ("tcp://127.0.0.1:6003",)))
    assert await next_event(watch_b) == PeerAdded("tcp://127.0.0.1:6003", ns_b, iid_b2)
    # ...while a watcher of every namespace does see A's advert.
    watch_all = b.watch(None)
    await wait_until_seen(watch_all, PeerAdded("tcp://127.0.0.1:6002", ns_a, iid_a))


async def test_mdns_other_protocol_version_is_skipped(
    mdns_pair: tuple[MdnsDiscovery, MdnsDiscovery],
) -> None:
    a, b = mdns_pair
    ns, old_iid, iid = unique_ns(), unique_iid(), unique_iid()
    it = b.watch(ns)
    await a.advertise(
        Advert(ns, old_iid, ("tcp://127.0.0.1:6101",), protocol_version=PROTOCOL_VERSION + 1)
    )
    await a.advertise(Advert(ns, iid, ("tcp://127.0.0.1:6102",)))
    assert await next_event(it) == PeerAdded("tcp://127.0.0.1:6102", ns, iid)


async def test_mdns_peer_advertised_before_watch_in_fresh_instance() -> None:
    ns, iid = unique_ns(), unique_iid()
    async with contextlib.AsyncExitStack() as stack:
        a = MdnsDiscovery(LOOPBACK)
        stack.push_async_callback(a.close)
        await a.advertise(Advert(ns, iid, ("tcp://127.0.0.1:7001",), ("decode",)))
        b = MdnsDiscovery(LOOPBACK)  # empty cache: must query the network
        stack.push_async_callback(b.close)
        await b.start()
        event = await next_event(b.watch(ns))
        assert event == PeerAdded("tcp://127.0.0.1:7001", ns, iid, ("decode",))


async def test_mdns_readvertise_updates_components(
    mdns_pair: tuple[MdnsDiscovery, MdnsDiscovery],
) -> None:
    a, b = mdns_pair
    ns, iid = unique_ns(), unique_iid()
    it = b.watch(ns)
    await a.advertise(Advert(ns, iid, ("tcp://127.0.0.1:7002",), ("backend",)))
    assert (await next_event(it)) == PeerAdded("tcp://127.0.0.1:7002", ns, iid, ("backend",))
    await a.advertise(Advert(ns, iid, ("tcp://127.0.0.1:7002",), ("backend", "router")))
    updated = await next_event(it)
    assert updated == PeerAdded("tcp://127.0.0.1:7002", ns, iid, ("backend", "router"))


async def test_mdns_close_announces_goodbye_and_ends_watchers(
    mdns_pair: tuple[MdnsDiscovery, MdnsDiscovery],
) -> None:
    a, b = mdns_pair
    ns, iid = unique_ns(), unique_iid()
    it = b.watch(ns)
    await a.advertise(Advert(ns, iid, ("tcp://127.0.0.1:7003",)))
    assert isinstance(await next_event(it), PeerAdded)
    await a.close()
    assert await next_event(it) == PeerRemoved("tcp://127.0.0.1:7003", iid)
    await b.close()
    with pytest.raises(StopAsyncIteration):  # what was queued before the close, then the end
        for _ in range(5):
            await next_event(it)


async def test_mdns_concurrent_watchers_each_see_events(
    mdns_pair: tuple[MdnsDiscovery, MdnsDiscovery],
) -> None:
    a, b = mdns_pair
    ns, iid = unique_ns(), unique_iid()
    watchers = [b.watch(ns), b.watch(ns), a.watch(ns)]
    firsts = [asyncio.ensure_future(next_event(w)) for w in watchers]
    await a.advertise(Advert(ns, iid, ("tcp://127.0.0.1:7004",)))
    expected = PeerAdded("tcp://127.0.0.1:7004", ns, iid)
    got = await asyncio.gather(*firsts)
    assert got == [expected] * 3


async def test_mdns_wildcard_host_advertises_pinned_interface(
    mdns_pair: tuple[MdnsDiscovery, MdnsDiscovery],
) -> None:
    a, b = mdns_pair
    ns, iid = unique_ns(), unique_iid()
    it = b.watch(ns)
    await a.advertise(Advert(ns, iid, ("tcp://*:7005",)))
    assert await next_event(it) == PeerAdded("tcp://127.0.0.1:7005", ns, iid)


async def test_mdns_bad_advert_is_invalid() -> None:
    disc = MdnsDiscovery(LOOPBACK)
    try:
        with pytest.raises(InvalidArgument):
            await disc.advertise(Advert("ns", 1, ("tcp://[::1]:5000",)))
        with pytest.raises(InvalidArgument):
            await disc.advertise(Advert("ns", 1, ("not-an-address",)))
        with pytest.raises(InvalidArgument):
            await disc.advertise(Advert("x" * 300, 1, ("tcp://127.0.0.1:5000",)))
    finally:
        await disc.close()


async def test_mdns_unknown_interface_is_invalid() -> None:
    disc = MdnsDiscovery(DiscoveryConfig(mdns_interfaces=("203.0.113.254",)))
    try:
        with pytest.raises(InvalidArgument, match=r"203\.0\.113\.254"):
            await disc.start()
    finally:
        await disc.close()


async def test_mdns_close_is_idempotent_and_safe_before_start() -> None:
    never_started = MdnsDiscovery(LOOPBACK)
    await never_started.close()
    await never_started.close()
    assert [e async for e in never_started.watch()] == []
    with pytest.raises(RuntimeError):
        await never_started.start()

    started = MdnsDiscovery(LOOPBACK)
    await started.start()
    await started.close()
    await started.close()


async def test_mdns_advertiser_in_another_process() -> None:
    ns, iid = unique_ns(), unique_iid()
    child = textwrap.dedent(
        f"""
        import asyncio, signal
        from dynamo_zmq.discovery import Advert, DiscoveryConfig, MdnsDiscovery

        async def main():
            disc = MdnsDiscovery(DiscoveryConfig(mdns_interfaces=("127.0.0.1",)))
            stop = asyncio.Event()
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
            await disc.advertise(Advert({ns!r}, {iid}, ("tcp://127.0.0.1:7100",), ("worker",)))
            print("ready", flush=True)
            await stop.wait()
            await disc.close()

        asyncio.run(main())
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", child, cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE
    )
    watcher = MdnsDiscovery(LOOPBACK)
    try:
        await watcher.start()
        it = watcher.watch(ns)
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), WAIT) == b"ready\n"
        assert await next_event(it) == PeerAdded("tcp://127.0.0.1:7100", ns, iid, ("worker",))
        os.kill(proc.pid, signal.SIGTERM)  # clean shutdown: the child says goodbye
        assert await next_event(it) == PeerRemoved("tcp://127.0.0.1:7100", iid)
        assert await asyncio.wait_for(proc.wait(), WAIT) == 0
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()
        await watcher.close()


# --- renew: the runtime's lease keep-alive ------------------------------------------------------


async def eventually_renew(disc: MdnsDiscovery, advert: Advert, want: str | None) -> str | None:
    """Call ``renew`` (as the runtime's keep-alive does) until it answers ``want`` (a reason
    contains it) or the wait is over; returns the last answer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while True:
        got = await disc.renew(advert)
        if (got is None) == (want is None) and (want is None or want in (got or "")):
            return got
        if loop.time() > deadline:
            return got
        await asyncio.sleep(0.05)


async def test_mdns_renew_keeps_a_registered_advert(
    mdns_pair: tuple[MdnsDiscovery, MdnsDiscovery],
) -> None:
    a, _ = mdns_pair
    advert = Advert(unique_ns(), unique_iid(), ("tcp://127.0.0.1:5561",))
    await a.advertise(advert)
    for _ in range(3):
        assert await a.renew(advert) is None
    await a.withdraw(advert)
    assert await a.renew(advert) is None  # withdrawn: nothing to keep, nothing registered again
    assert await StaticDiscovery(DiscoveryConfig(backend="static")).renew(advert) is None


async def test_mdns_renew_announces_again_after_a_goodbye_it_did_not_send(
    mdns_pair: tuple[MdnsDiscovery, MdnsDiscovery], caplog: pytest.LogCaptureFixture
) -> None:
    owner, watcher = mdns_pair
    ns, iid = unique_ns(), unique_iid()
    advert = Advert(ns, iid, ("tcp://127.0.0.1:5564",), ("backend",))
    it = watcher.watch(ns)
    await owner.advertise(advert)
    added = PeerAdded("tcp://127.0.0.1:5564", ns, iid, ("backend",))
    assert await next_event(it) == added
    # A third responder publishes the very same records, then says goodbye for them: every
    # browser drops the owner's service although the owner never left.
    other = MdnsDiscovery(LOOPBACK)
    try:
        await other.advertise(advert)
        await other.withdraw(advert)
        assert await next_event(it) == PeerRemoved("tcp://127.0.0.1:5564", iid)
        # The owner's keep-alive notices and announces the service again (a browser's next query
        # would bring it back too, later: the log says the announcement was the owner's own).
        back = asyncio.create_task(next_event(it))
        announced = f"{instance_name(ns, iid)} was removed from the network: announcing it again"
        with caplog.at_level(logging.INFO, logger="dynamo_zmq.discovery.mdns"):
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WAIT
            while announced not in caplog.text:
                assert loop.time() < deadline, "the owner never announced again"
                assert await owner.renew(advert) is None
                await asyncio.sleep(0.05)
        assert await back == added
        assert await owner.renew(advert) is None  # kept: nothing more to do
        assert caplog.text.count(announced) == 1
    finally:
        await other.close()
