"""No silent hangs (issue 14, item 5): whatever happens to workers, every request a frontend
holds ends, with its tokens or a typed error (HTTP 503/504, or an SSE error event), before its
whole-request deadline plus a small margin. Real processes on loopback: a frontend with
``--request-timeout`` and slow mocker workers (about 60 ms a token), bounded streaming loads,
and one fault each: SIGKILL, SIGSTOP/SIGCONT, a restart on the same port, a restart storm, a
frontend restart, and no live worker at all.

A stream whose worker fails after its first chunk is migrated to another worker (a request
that had no output yet fails over) and completes with the text an undisturbed stream has (every
request here has the same prompt, and the mocker's output is a function of it); with no worker
left at all, it ends with a typed error.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections import Counter

from dynamo_zmq import errors
from dynamo_zmq.llm._migration import MIGRATION_WAIT
from tests.support.churn import (
    Outcome,
    frontend,
    openai_client,
    read_stream,
    stream_completion,
    wait_live,
    worker,
    worker_inflight,
)
from tests.support.http_calls import get
from tests.support.metrics import sample
from tests.support.waiting import eventually, until

DEADLINE = 20.0
#: Slack past the deadline for the frontend to write the 504 and the client to read it.
MARGIN = 3.0
#: Tokens that take a few seconds unhurt (about 60 ms each), well inside the deadline.
TOKENS = 60
#: Every stream runs to its ``max_tokens`` (the mocker may sample its end-of-sequence token).
NO_EOS = {"ignore_eos": True}


def hexid(proc) -> str:
    return f"{proc.instance_id:x}"


async def frontend_migrations(url: str, n: int) -> bool:
    """Whether the frontend has migrated ``n`` streams (or more)."""
    _, body = await asyncio.to_thread(get, f"{url}/metrics")
    return (sample(body.decode(), "dynamo_frontend_migrations_total") or 0) >= n


def assert_all_ended(outcomes: list[Outcome]) -> Counter[str]:
    """Every request ended in time, complete or with a typed error; returns the tally."""
    tally: Counter[str] = Counter()
    for out in outcomes:
        assert out.seconds < DEADLINE + MARGIN, out
        if out.ok:
            assert out.finish == "length", out
            tally["ok"] += 1
        else:
            assert out.error is not None, out  # a typed error, never a silent end
            assert out.status in (None, 503, 504), out
            kind = out.error.get("code") or out.error.get("type")
            assert kind in ("disconnected", "engine_shutdown", "service_unavailable",
                            "cannot_connect", "timeout", "stream_incomplete"), out
            tally[str(kind)] += 1
    return tally


async def start_streams(client, n: int, tokens: int = TOKENS) -> list[asyncio.Task[Outcome]]:
    """``n`` streamed completions, returned once each has its first chunk."""
    started = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(stream_completion(client, tokens, ev, extra_body=NO_EOS))
             for ev in started]
    await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 30)
    return tasks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def cluster(spawn, namespace, model, n: int, *worker_flags: str):
    workers = [worker(spawn, namespace, model, *worker_flags) for _ in range(n)]
    url = frontend(spawn, namespace, "--request-timeout", str(DEADLINE)).address
    await wait_live(url, lambda ids: ids == {hexid(w) for w in workers})
    return workers, url


async def test_sigkill_of_the_serving_worker_moves_its_streams_at_once(
    namespace, spawn, tiny_model
):
    workers, url = await cluster(spawn, namespace, tiny_model, 3)
    victim = workers[0]
    async with openai_client(url) as client:
        tasks = await start_streams(client, 9, tokens=150)
        victim.signal(signal.SIGKILL)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE + MARGIN)
        tally = assert_all_ended(outcomes)
        on_victim = [o for o in outcomes if o.served_by == hexid(victim)]
        assert on_victim, outcomes
        # The kill is noticed at once and the victim's streams continue elsewhere, unchanged.
        assert tally["ok"] == len(outcomes), tally
        assert len({o.text for o in outcomes}) == 1, outcomes
        # New requests go to the survivors.
        again = await asyncio.gather(*(stream_completion(client, 3) for _ in range(4)))
        assert all(o.ok and o.served_by != hexid(victim) for o in again), again


async def test_a_frozen_worker_hands_its_streams_on_and_drops_them_when_it_thaws(
    namespace, spawn, tiny_model
):
    workers, url = await cluster(spawn, namespace, tiny_model, 2)
    frozen = workers[0]
    async with openai_client(url) as client:
        # Long enough to still be running on the frozen worker long after it thaws.
        tasks = await start_streams(client, 4, tokens=200)
        assert await worker_inflight(frozen) == 2
        frozen.signal(signal.SIGSTOP)
        try:
            await wait_live(url, lambda ids: ids == {hexid(workers[1])})
            # Out of routing comes first (a ping unanswered); its streams move on only once
            # it has been silent for the liveness timeout.
            await eventually(lambda: frontend_migrations(url, 2), what="both streams moved")
        finally:
            frozen.signal(signal.SIGCONT)
        # After the thaw the abandoned streams are killed there, long before they would end.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while await worker_inflight(frozen) > 0:
            assert loop.time() < deadline, "the thawed worker still runs abandoned streams"
            await asyncio.sleep(0.1)
        await wait_live(url, lambda ids: ids == {hexid(w) for w in workers})
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE + MARGIN)
    # The frozen worker's two streams moved to the other one and completed unchanged.
    tally = assert_all_ended(outcomes)
    assert [o.served_by for o in outcomes].count(hexid(frozen)) == 2, outcomes
    assert tally["ok"] == len(outcomes), tally
    assert len({o.text for o in outcomes}) == 1, outcomes


async def test_a_stalled_worker_drops_the_streams_its_callers_gave_up(
    namespace, spawn, make_runtime, tiny_model
):
    """A worker whose event loop is stuck (its connection's heartbeats still answered) fails its
    callers' streams with ``Disconnected`` after the liveness timeout; when it comes back on the
    same connection, the KILLs its callers sent meanwhile stop those streams there."""
    proc = spawn("-m", "dynamo_zmq.worker", "--engine", "tests.support.engines:StallingTestEngine",
                 "--model-path", str(tiny_model), "--namespace", namespace, "--host", "127.0.0.1",
                 "--echo-delay", "0.05", "--stall-after", "5", "--stall-for", "4")
    client = await make_runtime().endpoint(f"{namespace}.backend.generate").client()
    assert await until(client, lambda: client.instance_ids() == [proc.instance_id], timeout=15)
    conn = client.instances()[0]
    # 300 tokens, 50 ms apart: 15 s of work, far beyond the stall.
    streams = [await client.generate({"token_ids": [1, 2, 3], "stop": {"max_tokens": 300}})
               for _ in range(3)]
    for stream in streams:
        await stream.__anext__()
    results = await asyncio.wait_for(asyncio.gather(*(read_stream(s) for s in streams)), 15)
    for _, exc in results:
        assert isinstance(exc, errors.Disconnected), repr(exc)
    assert await until(client, lambda: client.instance_ids() == [proc.instance_id], timeout=10)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3
    while conn.inflight > 0:  # the worker's own count, from its pongs
        assert loop.time() < deadline, f"the worker still runs {conn.inflight} abandoned streams"
        await asyncio.sleep(0.1)


async def test_a_restart_on_the_same_port_takes_every_old_stream_on(namespace, spawn, tiny_model):
    port = str(free_port())
    first = worker(spawn, namespace, tiny_model, "--port", port)
    url = frontend(spawn, namespace, "--request-timeout", str(DEADLINE)).address
    await wait_live(url, lambda ids: ids == {hexid(first)})
    async with openai_client(url) as client:
        tasks = await start_streams(client, 4, tokens=150)
        first.signal(signal.SIGKILL)
        second = worker(spawn, namespace, tiny_model, "--port", port)  # as soon as it can
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE + MARGIN)
        tally = assert_all_ended(outcomes)
        # The old instance's streams end there and continue on the new one, unchanged.
        assert tally["ok"] == 4, outcomes
        assert len({o.text for o in outcomes}) == 1, outcomes
        await wait_live(url, lambda ids: ids == {hexid(second)})
        again = await asyncio.gather(*(stream_completion(client, 3) for _ in range(3)))
        assert all(o.ok and o.served_by == hexid(second) for o in again), again


async def test_a_restart_storm_loses_no_request_to_a_hang(namespace, spawn, tiny_model):
    """Five worker restarts in a row (SIGKILL or SIGTERM, alternately, each restarted on its
    port) under a bounded load: every request ends in time and completes, unchanged."""
    ports = [str(free_port()) for _ in range(3)]
    workers = [worker(spawn, namespace, tiny_model, "--port", p, "--graceful-timeout", "1",
                      "--grace-period", "0.2") for p in ports]
    url = frontend(spawn, namespace, "--request-timeout", str(DEADLINE)).address
    await wait_live(url, lambda ids: ids == {hexid(w) for w in workers})
    outcomes: list[Outcome] = []

    async def load(stop: asyncio.Event) -> None:  # at most 4 at a time, at most 60 in all
        async with openai_client(url) as client:
            sem = asyncio.Semaphore(4)

            async def one() -> None:
                async with sem:
                    outcomes.append(await stream_completion(client, 20))

            pending = []
            for _ in range(60):
                if stop.is_set():
                    break
                await sem.acquire()
                sem.release()
                pending.append(asyncio.create_task(one()))
                await asyncio.sleep(0.1)
            await asyncio.gather(*pending)

    stop = asyncio.Event()
    running = asyncio.create_task(load(stop))
    for i in range(5):
        await asyncio.sleep(1.0)
        slot = i % 3
        victim = workers[slot]
        victim.signal(signal.SIGKILL if i % 2 == 0 else signal.SIGTERM)
        await asyncio.to_thread(victim.wait, 30)
        workers[slot] = worker(spawn, namespace, tiny_model, "--port", ports[slot],
                               "--graceful-timeout", "1", "--grace-period", "0.2")
    stop.set()
    await asyncio.wait_for(running, DEADLINE + 2 * MARGIN)
    tally = assert_all_ended(outcomes)
    assert outcomes and tally["ok"] == len(outcomes), tally
    assert len({o.text for o in outcomes}) == 1, outcomes
    await wait_live(url, lambda ids: ids == {hexid(w) for w in workers})


async def test_a_new_frontend_rediscovers_every_live_worker(namespace, spawn, tiny_model):
    workers, url = await cluster(spawn, namespace, tiny_model, 3)
    old = frontend(spawn, namespace)
    old.signal(signal.SIGKILL)
    old.wait()
    new = frontend(spawn, namespace, "--request-timeout", str(DEADLINE))
    ids = {hexid(w) for w in workers}
    await wait_live(new.address, lambda live: live == ids, timeout=5)
    served: set[str] = set()
    async with openai_client(new.address) as client:
        for _ in range(9):  # round-robin: each worker serves within a few requests
            out = await stream_completion(client, 2)
            assert out.ok, out
            served.add(out.served_by)
    assert served == ids
    del url


async def test_requests_with_no_live_worker_end_at_once(namespace, spawn, tiny_model):
    """With every worker gone, a request is not parked until its deadline: it gets 503 now;
    and once a worker is back, requests are served again."""
    workers, url = await cluster(spawn, namespace, tiny_model, 1)
    async with openai_client(url) as client:
        tasks = await start_streams(client, 2, tokens=150)
        workers[0].signal(signal.SIGKILL)
        # Sent as the worker dies: routed to it before its death is known, a request fails
        # before any output and waits up to MIGRATION_WAIT for another worker, never to its
        # deadline.
        racing = [asyncio.create_task(stream_completion(client, 5)) for _ in range(4)]
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, *racing), DEADLINE + MARGIN)
        tally = assert_all_ended(outcomes)
        assert tally["ok"] == 0, tally
        for out in outcomes[2:]:
            assert out.seconds < MIGRATION_WAIT + MARGIN < DEADLINE, out
        # Once the frontend knows no worker is live, a request is refused at once.
        await wait_live(url, lambda ids: not ids)
        refused = await asyncio.gather(*(stream_completion(client, 5) for _ in range(4)))
        assert assert_all_ended(refused)["ok"] == 0
        for out in refused:
            assert out.seconds < MARGIN, out  # refused, not held to the deadline
        back = worker(spawn, namespace, tiny_model)
        await wait_live(url, lambda ids: ids == {hexid(back)})
        out = await stream_completion(client, 3)
        assert out.ok and out.served_by == hexid(back), out
