"""Session affinity through real processes: mocker workers, a frontend, the ``openai`` client
naming sessions in ``x-dynamo-session-id``. In kv mode a session's requests, whatever their
prompts, stay on one worker while other sessions spread by load (a request of several choices
too); when that worker dies the session moves and sticks to the new one (``moved{lost}``); when
it is busy the request goes elsewhere and the session follows (``moved{busy}``); a session
unused for ``--session-ttl`` is unpinned with no traffic at all (``expired``). Round-robin pins
too; a bad session id is a 400 in OpenAI's shape. A request migrated off a dying worker
takes its session along."""

from __future__ import annotations

import asyncio
import signal

import openai
import pytest

from tests.support.metrics import fetch_sample
from tests.support.migration import LONG, MESSAGES, PARAMS, client_for
from tests.support.migration import fleet as slow_fleet
from tests.support.mocker_fleet import mocker_fleet, serving
from tests.support.sessions import session_counts, session_worker, tokens
from tests.support.waiting import eventually


async def _call(url: str, session: str | None, seed: int, max_tokens: int = 4, n: int = 1,
                header: str = "x-dynamo-session-id") -> str:
    return await asyncio.to_thread(session_worker, url, session, tokens(seed), max_tokens, n,
                                   header)


async def test_a_session_sticks_to_its_worker_and_moves_when_it_is_lost(namespace, spawn,
                                                                      tiny_model):
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 3, speedup="1",
                               frontend_args=("--session-ttl", "600"))
    url = fleet.url
    # One session, different prompts (no shared prefix to follow): one worker.
    served = {await _call(url, "alice", seed) for seed in range(4)}
    assert len(served) == 1 and served <= fleet.ids
    home = served.pop()

    # Long requests at once: six other sessions spread by load, alice's stay home however
    # loaded it is.
    others = [_call(url, f"s{i}", 100 + i, max_tokens=100) for i in range(6)]
    mine = [_call(url, "alice", 200 + i, max_tokens=100) for i in range(3)]
    got = await asyncio.gather(*others, *mine)
    assert len(set(got[:6])) >= 2, got
    assert set(got[6:]) == {home}
    # Several choices: each sub-request follows the pin.
    assert await _call(url, "alice", 300, n=2) == home
    assert await session_counts(url) == {"pinned": 3 + 3 + 2, "new": 1 + 6, "moved_busy": 0,
                                         "moved_lost": 0, "expired": 0, "evicted": 0, "live": 7}

    # The pinned worker dies: the next request goes to another, and the session stays there.
    lost = next(w for w in fleet.workers if f"{w.instance_id:x}" == home)
    lost.signal(signal.SIGKILL)
    await serving(fleet.front, [w for w in fleet.workers if w is not lost])
    new_home = await _call(url, "alice", 400)
    assert new_home != home and new_home in fleet.ids
    assert {await _call(url, "alice", 500 + i) for i in range(3)} == {new_home}
    counts = await session_counts(url)
    assert counts["moved_lost"] == 1 and counts["pinned"] == 8 + 3


async def test_an_unused_session_expires_without_traffic(namespace, spawn, tiny_model):
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 2,
                               frontend_args=("--session-ttl", "1"))
    url = fleet.url
    await _call(url, "bob", 1)
    assert (await session_counts(url))["new"] == 1

    async def expired() -> bool:  # the scrape itself sweeps: no request needed
        counts = await session_counts(url)
        return counts["expired"] == 1 and counts["live"] == 0

    await eventually(expired, 30, "bob's pin expiring")
    # The session is routed afresh (it may land anywhere), and pinned again.
    await _call(url, "bob", 2)
    counts = await session_counts(url)
    assert counts["new"] == 2 and counts["pinned"] == 0 and counts["live"] == 1


async def test_a_busy_pinned_worker_passes_the_session_to_another(namespace, spawn, tiny_model):
    """``--busy-prefill-tokens``: the session's worker still prefilling its long prompt (10 ms a
    token) takes nothing new; the session's next request goes to the other worker, and the
    session now belongs there."""
    fleet = await mocker_fleet(
        spawn, namespace, tiny_model, 2, speedup="1",
        worker_args=("--prefill-ms-per-token", "10"),
        frontend_args=("--busy-kv-threshold", "0", "--busy-prefill-tokens", "500"))
    url = fleet.url
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    long = asyncio.create_task(client.completions.create(
        model="tiny", prompt=tokens(1, 1000), max_tokens=1,
        extra_headers={"x-dynamo-session-id": "carol"}))
    try:
        async def routed() -> bool:
            return await fetch_sample(url, "dynamo_router_session_new_total") == 1

        await eventually(routed, 30, "the long prompt routed")
        elsewhere = await _call(url, "carol", 2, max_tokens=1)
        again = await _call(url, "carol", 3, max_tokens=1)
        assert again == elsewhere and not long.done()
        counts = await session_counts(url)
        assert counts["moved_busy"] == 1 and counts["pinned"] == 1 and counts["new"] == 1
        # ... and the worker it left is the one still prefilling (the other is idle): a session
        # of its own goes to the idle one.
        assert await _call(url, "dave", 4, max_tokens=1) == elsewhere
    finally:
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
        await client.close()


async def test_round_robin_pins_sessions_and_a_bad_session_id_is_a_400(namespace, spawn,
                                                                      tiny_model):
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 3, mode="round-robin")
    url = fleet.url
    # Without a session, round-robin visits every worker; with one, the session's stays.
    assert {await _call(url, None, i) for i in range(6)} == fleet.ids
    assert len({await _call(url, "erin", i) for i in range(6)}) == 1
    # An agent's own header names a session too (Codex's session-id).
    assert len({await _call(url, "frank", i, header="session-id") for i in range(4)}) == 1
    counts = await session_counts(url)
    assert counts["new"] == 2 and counts["pinned"] == 5 + 3 and counts["live"] == 2

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    for bad in ("x" * 257, "tab\there"):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt="hi", max_tokens=1,
                                      extra_headers={"x-dynamo-session-id": bad})
        body = err.value.body
        assert isinstance(body, dict) and body["param"] == "x-dynamo-session-id"
        assert body["type"] == "invalid_request_error" and "printable ASCII" in body["message"]


async def test_a_migrated_request_takes_its_session_to_its_new_worker(namespace, spawn,
                                                                     tiny_model):
    fleet = await slow_fleet(spawn, namespace, tiny_model, 2, mode="kv")
    url = fleet.url
    home = await _call(url, "gus", 1)
    client = client_for(url)
    stream = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, stream=True,
        extra_headers={"x-dynamo-session-id": "gus"}, stream_options={"include_usage": True},
        **PARAMS)
    lost = next(w for w in fleet.workers if f"{w.instance_id:x}" == home)
    chunks, usage = 0, None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            if chunks == 3:  # streaming from the session's worker: it dies
                lost.signal(signal.SIGKILL)
        usage = chunk.usage or usage
    await client.close()
    assert usage is not None and usage.completion_tokens == LONG  # it went on elsewhere
    assert await fetch_sample(url, "dynamo_frontend_migrations_total") >= 1
    counts = await session_counts(url)
    assert counts["moved_lost"] == 1 and counts["pinned"] == 1
    # The session now belongs to the worker the request migrated to.
    other = next(f"{w.instance_id:x}" for w in fleet.workers if w is not lost)
    assert await _call(url, "gus", 2) == other
    assert (await session_counts(url))["pinned"] == 2
