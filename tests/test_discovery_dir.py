"""Directory discovery (``--discovery dir``) and several backends at once (``mdns,dir``).

The scanner on a real directory: adverts appear and leave, garbage and half-written files are
skipped with one log line, a file not refreshed goes stale and comes back, an old one is
deleted. The merge of several backends against a model (hypothesis). Then real runtimes on
loopback: a worker found through the directory, served, and gone from the directory when it
shuts down; a stale file of a live worker leaves it in routing (liveness is ours); both ways of
following the directory (inotify, polling). Across hosts and subnets: test_cluster_subnets.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_zmq.discovery import (
    Advert,
    DirectoryDiscovery,
    DiscoveryConfig,
    PeerAdded,
    PeerRemoved,
)
from dynamo_zmq.discovery._combined import _Merger
from dynamo_zmq.discovery._dir_files import (
    advert_file_name,
    decode_advert,
    encode_advert,
    filesystem_type,
    is_network_filesystem,
    write_atomic,
)
from dynamo_zmq.discovery._dir_watch import DirScanner, pick_address
from dynamo_zmq.errors import InvalidArgument
from dynamo_zmq.runtime import DistributedRuntime, RuntimeConfig

STALE, GC = 60.0, 600.0


def advert(iid: int, ns: str = "ns1", port: int = 5000) -> Advert:
    return Advert(ns, iid, (f"tcp://127.0.0.1:{port}",), ("backend",))


def put(directory: Path, ad: Advert) -> Path:
    name = advert_file_name(ad.namespace, ad.instance_id)
    write_atomic(directory, name, encode_advert(ad))
    return directory / name


def age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


# -- the files ---------------------------------------------------------------------------------


def test_an_advert_file_round_trips_and_names_its_instance():
    ad = Advert("my ns/x", 0xABC, ("tcp://10.0.0.1:5555", "tcp://10.1.0.1:5555"), ("a", "b"),
                public_key="k" * 40)
    got = decode_advert(encode_advert(ad))
    assert (got.ns, int(got.iid, 16), got.addresses, got.comps, got.key) == (
        "my ns/x", 0xABC, list(ad.addresses), ["a", "b"], "k" * 40)
    assert advert_file_name("my ns/x", 0xABC) == "my-ns-x-0000000000000abc.json"


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b'{"v": 1}', b"\xff" * 10,
                                  b'{"v":1,"ns":"n","iid":"zz","addresses":[]}'])
def test_garbage_is_not_an_advert(data):
    with pytest.raises(ValueError):
        decode_advert(data)


def test_a_file_of_another_protocol_version_is_not_an_advert():
    ad = Advert("n", 1, ("tcp://127.0.0.1:1",), protocol_version=999)
    with pytest.raises(ValueError, match="protocol version 999"):
        decode_advert(encode_advert(ad))


def test_the_filesystem_type_of_a_local_directory_is_not_a_network_one(tmp_path):
    kind = filesystem_type(tmp_path)
    assert kind and not is_network_filesystem(kind)
    assert is_network_filesystem("nfs4") and is_network_filesystem("lustre")
    assert is_network_filesystem("fuse.sshfs") and not is_network_filesystem("ext4")


def test_the_address_dialled_is_one_on_a_local_network_else_the_first():
    import ipaddress

    nets = [ipaddress.IPv4Network("10.1.0.0/16")]
    assert pick_address(["tcp://10.2.0.5:7", "tcp://10.1.3.4:7"], nets) == "tcp://10.1.3.4:7"
    assert pick_address(["tcp://10.2.0.5:7", "tcp://10.3.0.5:7"], nets) == "tcp://10.2.0.5:7"
    assert pick_address([], nets) is None


# -- the scanner ---------------------------------------------------------------------------------


def test_the_scanner_reports_adverts_as_they_come_and_go(tmp_path):
    scan = DirScanner(tmp_path, "ns1", STALE, GC)
    assert scan.scan() == []
    one = put(tmp_path, advert(1))
    put(tmp_path, advert(2, ns="other"))
    (added,) = scan.scan()
    assert isinstance(added, PeerAdded) and added.instance_id == 1
    assert (added.address, added.namespace, added.components) == (
        "tcp://127.0.0.1:5000", "ns1", ("backend",))
    assert scan.scan() == []  # nothing new
    os.utime(one)  # a heartbeat: nothing to say
    assert scan.scan() == []
    put(tmp_path, advert(1, port=5001))  # the same instance at a new address
    assert scan.scan() == [PeerRemoved("tcp://127.0.0.1:5000", 1),
                           PeerAdded("tcp://127.0.0.1:5001", "ns1", 1, ("backend",))]
    one.unlink()  # a clean shutdown
    assert scan.scan() == [PeerRemoved("tcp://127.0.0.1:5001", 1)]


def test_garbage_and_temporary_files_are_skipped_with_one_line(tmp_path, caplog):
    scan = DirScanner(tmp_path, None, STALE, GC)
    (tmp_path / "junk-0000000000000001.json").write_bytes(b"{not json")
    (tmp_path / ".ns1-0000000000000002.json.1234.tmp").write_bytes(b"{half")
    (tmp_path / "README").write_text("not an advert")
    with caplog.at_level(logging.WARNING, "dynamo_zmq.discovery.directory"):
        assert scan.scan() == [] and scan.scan() == []
    lines = [r for r in caplog.records if "junk" in r.getMessage()]
    assert len(lines) == 1  # once, not every pass
    write_atomic(tmp_path, "junk-0000000000000001.json", encode_advert(advert(1)))
    (added,) = scan.scan()  # repaired: reported
    assert isinstance(added, PeerAdded) and added.instance_id == 1


def test_a_file_not_refreshed_goes_stale_and_comes_back(tmp_path):
    scan = DirScanner(tmp_path, "ns1", STALE, GC)
    path = put(tmp_path, advert(1))
    assert len(scan.scan()) == 1
    age(path, STALE + 5)
    assert scan.scan() == [PeerRemoved("tcp://127.0.0.1:5000", 1, stale=True)]
    assert scan.scan() == []
    os.utime(path)  # refreshed: the peer is back
    (back,) = scan.scan()
    assert isinstance(back, PeerAdded) and back.instance_id == 1
    age(put(tmp_path, advert(2)), STALE + 5)  # stale when first seen: not reported at all
    assert scan.scan() == []


def test_a_long_dead_advert_is_deleted(tmp_path):
    scan = DirScanner(tmp_path, "ns1", STALE, GC)
    path = put(tmp_path, advert(1))
    assert len(scan.scan()) == 1
    age(path, GC + 5)
    assert scan.scan() == [PeerRemoved("tcp://127.0.0.1:5000", 1)]
    assert not path.exists()


def test_an_unreadable_directory_keeps_what_is_known(tmp_path):
    scan = DirScanner(tmp_path / "d", "ns1", STALE, GC)
    (tmp_path / "d").mkdir()
    put(tmp_path / "d", advert(1))
    assert len(scan.scan()) == 1
    (tmp_path / "d").rename(tmp_path / "gone")  # an NFS outage looks like this to a reader
    assert scan.scan() == []  # no peer is removed for it


def test_the_directory_backend_refuses_a_path_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    cfg = DiscoveryConfig(backend="dir", discovery_dir=str(tmp_path / "f"))
    with pytest.raises(InvalidArgument, match="not a directory"):
        asyncio.run(DirectoryDiscovery(cfg).start())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"backend": "dir"}, "needs --discovery-dir"),
    ({"backend": "mdns", "discovery_dir": "/x"}, "use --discovery dir"),
    ({"backend": "mdns,bogus"}, "unknown discovery backend"),
    ({"backend": "mdns,mdns"}, "unknown discovery backend"),
    ({"backend": "dir", "discovery_dir": "/x", "dir_watch": "sometimes"}, "must be one of"),
])
def test_bad_discovery_settings_are_refused(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        DiscoveryConfig(**kwargs)


def test_the_settings_come_from_flags_and_variables():
    cfg = DiscoveryConfig.from_env({"DYN_DISCOVERY": "mdns,dir", "DYN_DISCOVERY_DIR": "/shared",
                                    "DYN_DISCOVERY_DIR_WATCH": "poll"})
    assert cfg.backends == ("mdns", "dir") and cfg.discovery_dir == "/shared"
    assert cfg.dir_watch == "poll"


# -- several backends merged ---------------------------------------------------------------------

EVENTS = st.lists(st.tuples(st.integers(0, 1), st.integers(1, 3), st.booleans(),
                            st.booleans()), max_size=40)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_the_merged_view_is_the_union_of_the_backends(events):
    """Each backend adds and removes instances (each at an address of its own); the merged
    stream says an instance is there exactly while some backend says so, and a removal is
    stale only if every backend's last removal of it was."""
    merger = _Merger()
    there: dict[int, set[int]] = {}  # instance -> backends reporting it now (the model)
    merged: dict[int, str] = {}  # instance -> address the merged stream holds
    stale_only: dict[int, bool] = {}
    for source, iid, add, stale in events:
        address = f"tcp://10.{source}.0.{iid}:1"
        if add:
            event = merger.apply(source, PeerAdded(address, "ns", iid))
            if not there.get(iid):
                stale_only[iid] = True
            there.setdefault(iid, set()).add(source)
        else:
            event = merger.apply(source, PeerRemoved(address, iid, stale=stale))
            if source in there.get(iid, set()):
                there[iid].discard(source)
                stale_only[iid] = stale_only[iid] and stale
        if isinstance(event, PeerAdded):
            assert event.instance_id not in merged
            merged[iid] = event.address
        elif isinstance(event, PeerRemoved):
            assert merged.pop(iid) == event.address
            assert event.stale == stale_only[iid]
        assert set(merged) == {i for i, by in there.items() if by}


# -- real runtimes ---------------------------------------------------------------------------------


def runtime(directory: Path, watch: str = "auto") -> DistributedRuntime:
    disc = DiscoveryConfig(backend="dir", discovery_dir=str(directory), dir_watch=watch)
    return DistributedRuntime(config=RuntimeConfig(discovery=disc, host="127.0.0.1"))


async def serve_count(rt: DistributedRuntime, namespace: str) -> None:
    async def count(request, context):
        for i in range(int(request["n"])):
            yield {"i": i, "instance": rt.instance_id}

    await rt.namespace(namespace).component("backend").endpoint("count").start_serving(count)


@pytest.mark.parametrize("watch", ["inotify", "poll"])
async def test_a_worker_is_found_through_the_directory_and_leaves_it(tmp_path, namespace, watch):
    worker, caller = runtime(tmp_path, watch), runtime(tmp_path, watch)
    try:
        await serve_count(worker, namespace)
        files = list(tmp_path.glob(f"*-{worker.instance_id:016x}.json"))
        assert len(files) == 1
        client = await caller.endpoint(f"{namespace}.backend.count").client()
        assert await client.wait_for_instances(timeout=15) == [worker.instance_id]
        items = [r.data() async for r in await client.generate({"n": 3})]
        assert [it["i"] for it in items] == [0, 1, 2]
        await worker.close()  # a clean shutdown removes the file
        assert not files[0].exists()
        for _ in range(200):
            if not client.instance_ids():
                break
            await asyncio.sleep(0.05)
        assert client.instance_ids() == []
    finally:
        await worker.close()
        await caller.close()


async def test_a_stale_file_of_a_live_worker_keeps_it_in_routing(tmp_path, namespace):
    worker, caller = runtime(tmp_path), runtime(tmp_path)
    watcher = DirectoryDiscovery(DiscoveryConfig(backend="dir", discovery_dir=str(tmp_path)))
    try:
        await serve_count(worker, namespace)
        client = await caller.endpoint(f"{namespace}.backend.count").client()
        assert await client.wait_for_instances(timeout=15) == [worker.instance_id]
        await watcher.start()
        events = watcher.watch(namespace)
        assert isinstance(await anext(events), PeerAdded)
        (path,) = tmp_path.glob(f"*-{worker.instance_id:016x}.json")
        age(path, STALE + 5)  # its writer stalled (an NFS hiccup): the file looks dead
        removed = await asyncio.wait_for(anext(events), 15)
        assert removed == PeerRemoved(removed.address, worker.instance_id, stale=True)
        await asyncio.sleep(1.0)  # the caller's own reader saw the same by now
        assert client.instance_ids() == [worker.instance_id]  # it answers: still routed
        items = [r.data() async for r in await client.generate({"n": 2})]
        assert len(items) == 2
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]
    finally:
        await watcher.close()
        await worker.close()
        await caller.close()
