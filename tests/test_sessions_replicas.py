"""Session pins across kv-mode frontends with ``--router-replica-sync``, all real processes: a
session started on one frontend continues on the same worker through another (the pin is
published with the replica events), and a frontend started later learns the pin from the
snapshot it asks its peers for (it never heard the pin's message)."""

from __future__ import annotations

import asyncio

from tests.support.metrics import fetch_sample
from tests.support.mocker_fleet import serving, start_frontend, start_mocker
from tests.support.sessions import session_counts, session_worker, tokens
from tests.support.waiting import eventually

SYNC = ("--router-replica-sync",)


async def _call(url: str, session: str, seed: int) -> str:
    return await asyncio.to_thread(session_worker, url, session, tokens(seed))


async def _followed(url: str, peers: int) -> None:
    async def ok() -> bool:
        return await fetch_sample(url, "dynamo_router_replica_peers") == peers

    await eventually(ok, 30, f"{url} following {peers} replica(s)")


async def test_a_session_keeps_its_worker_across_frontends(namespace, spawn, tiny_model):
    workers = [start_mocker(spawn, namespace, tiny_model) for _ in range(3)]
    a, b = (start_frontend(spawn, namespace, *SYNC) for _ in range(2))
    for front in (a, b):
        await serving(front, workers)
    await _followed(a.address, 1)
    await _followed(b.address, 1)
    ids = {f"{w.instance_id:x}" for w in workers}

    # Sessions start on frontend A ...
    home = {s: await _call(a.address, s, i) for i, s in enumerate(["ann", "ben", "cat"])}
    assert set(home.values()) <= ids

    async def learned(url: str) -> bool:
        return (await session_counts(url))["live"] == 3

    await eventually(lambda: learned(b.address), 30, "frontend B learning A's pins")
    assert await fetch_sample(b.address, "dynamo_router_replica_events_received_total",
                              kind="pin") == 3
    # ... and continue through B, new prompts each time, on their workers.
    for i in range(3):
        for s in home:
            assert await _call(b.address, s, 100 + i) == home[s], s
    counts = await session_counts(b.address)
    assert counts["pinned"] == 9 and counts["new"] == 0
    # B's requests refreshed the pins at A too (each routed request publishes its pin).
    await eventually(lambda: _heard_pins(a.address, 9), 30, "frontend A hearing B's pins")

    # A frontend that starts now heard none of those pins: the snapshots it asks its peers
    # for bring them.
    c = start_frontend(spawn, namespace, *SYNC)
    await serving(c, workers)
    await _followed(c.address, 2)
    await eventually(lambda: learned(c.address), 30, "frontend C learning the pins")
    assert await fetch_sample(c.address, "dynamo_router_replica_events_received_total",
                              kind="pin") == 0
    for s in home:
        assert await _call(c.address, s, 200) == home[s], s
    assert (await session_counts(c.address))["pinned"] == 3


async def _heard_pins(url: str, n: int) -> bool:
    return await fetch_sample(url, "dynamo_router_replica_events_received_total", kind="pin") == n
