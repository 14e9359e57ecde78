"""An engine that stops producing while its worker process lives on (a stuck kernel, a
deadlock), through real processes: ``tests.support.engines:StopsProducingMocker`` on one of two
workers. Liveness sees nothing wrong (the process answers its pings); the worker's health
canary, which also runs while requests are in flight, takes it out of routing, and the
frontend's stall timeout (``--stream-stall-timeout``) migrates its streams, which end with the
exact text a fault-free run gives: none hangs."""

from __future__ import annotations

import asyncio
import json

from tests.support.churn import (
    frontend,
    metrics_port,
    openai_client,
    stream_completion,
    wait_live,
    worker,
    worker_inflight,
)
from tests.support.http_calls import get
from tests.support.metrics import sample
from tests.support.procs import Proc

#: Tokens a stream asks for (about 60 ms each at the workers' speed).
TOKENS = 30
NO_EOS = {"ignore_eos": True}
#: Every stream runs to its max_tokens and reports its usage.
FULL = {"extra_body": NO_EOS, "stream_options": {"include_usage": True}}
STOPS = ("--engine", "tests.support.engines:StopsProducingMocker")


def hexid(proc: Proc) -> str:
    return f"{proc.instance_id:x}"


async def two_workers(spawn, namespace, model, *frontend_flags: str) -> tuple[Proc, Proc, str]:
    """A healthy worker, one whose engine stops after 40 tokens, a round-robin frontend."""
    healthy = worker(spawn, namespace, model)
    stuck = worker(spawn, namespace, model, *STOPS, "--stop-producing-after", "40")
    url = frontend(spawn, namespace, *frontend_flags).address
    await wait_live(url, lambda ids: ids == {hexid(healthy), hexid(stuck)}, 30)
    return healthy, stuck, url


async def worker_health(proc: Proc) -> tuple[int, dict]:
    status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{metrics_port(proc)}/health")
    return status, json.loads(body)


async def test_streams_on_an_engine_that_stops_producing_finish_elsewhere_unchanged(
    namespace, spawn, tiny_model
):
    healthy, stuck, url = await two_workers(spawn, namespace, tiny_model,
                                            "--stream-stall-timeout", "2")
    async with openai_client(url) as client:
        outcomes = await asyncio.wait_for(asyncio.gather(*(
            stream_completion(client, TOKENS, **FULL) for _ in range(8)
        )), 60)
        assert [o.served_by for o in outcomes].count(hexid(stuck)) == 4, outcomes
        # The stuck worker is out of routing; what it was serving went on elsewhere.
        await wait_live(url, lambda ids: ids == {hexid(healthy)})
        again = await asyncio.gather(*(stream_completion(client, 3, extra_body=NO_EOS)
                                       for _ in range(4)))
        assert {o.served_by for o in again} == {hexid(healthy)}, again
        ref = await stream_completion(client, TOKENS, **FULL)  # fault-free
    assert ref.ok and ref.finish == "length"
    assert ref.completion_tokens == TOKENS
    for o in outcomes:
        assert o.ok and o.finish == "length", o
        assert o.text == ref.text and o.completion_tokens == TOKENS, o
    _, page = await asyncio.to_thread(get, f"{url}/metrics")
    stalls = sample(page.decode(), "dynamo_frontend_migrations_total", reason="StreamStalled")
    assert stalls and stalls >= 1, page.decode()
    status, body = await worker_health(stuck)
    assert status == 503 and body["status"] == "unhealthy", body


async def test_an_engine_that_stops_producing_leaves_routing_with_its_requests_in_flight(
    namespace, spawn, tiny_model
):
    """Its requests never end (no stall timeout here): the canary runs anyway."""
    healthy, stuck, url = await two_workers(spawn, namespace, tiny_model,
                                            "--stream-stall-timeout", "0")
    async with openai_client(url) as client:
        streams = [asyncio.create_task(stream_completion(client, TOKENS, extra_body=NO_EOS))
                   for _ in range(4)]
        try:
            await wait_live(url, lambda ids: ids == {hexid(healthy)}, 20)
            assert await worker_inflight(stuck) == 2  # still in flight: never idle
            status, body = await worker_health(stuck)
            assert status == 503 and "produced nothing" in body["error"], body
            again = await asyncio.gather(*(stream_completion(client, 3, extra_body=NO_EOS)
                                           for _ in range(4)))
            assert {o.served_by for o in again} == {hexid(healthy)}, again
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)


async def test_a_reader_that_stops_reading_is_no_stuck_engine(namespace, spawn, make_runtime,
                                                             tiny_model):
    """A stream whose reader takes nothing more holds the worker's engine back (credit): no
    output for seconds, with a request that has had outputs. The canary it triggers passes,
    so the worker stays routed and healthy."""
    proc = worker(spawn, namespace, tiny_model, "--speedup-ratio", "1000")
    runtime = make_runtime(static=(proc.address,))
    client = await runtime.endpoint(f"{namespace}.backend.generate").client()
    assert await client.wait_for_instances(timeout=15) == [proc.instance_id]
    stream = await client.generate({"token_ids": list(range(10, 42)),
                                    "stop": {"max_tokens": 1900, "ignore_eos": True}})
    await stream.__anext__()
    await asyncio.sleep(3)  # the window's 1024 outputs are sent; the engine waits for credit
    assert client.instance_ids() == [proc.instance_id]
    status, body = await worker_health(proc)
    assert status == 200 and body["status"] == "healthy", body
    await stream.aclose()
