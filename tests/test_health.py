"""Health canaries through real processes: an endpoint whose canary fails leaves routing (the
runtime's clients, the frontend's router and the KV router all stop sending to it) and comes
back once the canary passes again, under static and mDNS discovery alike. The test switches
(``tests.support.app --canary-file``, ``tests.support.engines:FlakyMocker``) break and repair a
process's health from outside."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import openai
import pytest

from dynamo_zmq import errors
from tests.conftest import app_args
from tests.support.http_calls import get
from tests.support.mocker_fleet import start_frontend
from tests.support.procs import Proc, system_port
from tests.support.waiting import until

#: Canary timings for the runtime-API processes: an idle endpoint is probed every 0.2 s.
CANARY_ENV = {"DYN_CANARY_WAIT_TIME": "0.2", "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "2"}


@pytest.mark.parametrize("discovery", ["static", "mdns"])
async def test_runtime_api_endpoint_canary_leaves_and_rejoins_routing(
    discovery, namespace, spawn, make_runtime, tmp_path
):
    switch = tmp_path / "broken"
    flags = ["--discovery", "static"] if discovery == "static" else []
    flaky = spawn(*app_args(namespace, "--canary-file", str(switch), *flags), env=CANARY_ENV)
    steady = spawn(*app_args(namespace, *flags), env=CANARY_ENV)
    runtime = (
        make_runtime(static=(flaky.address, steady.address))
        if discovery == "static" else make_runtime()
    )
    client = await runtime.endpoint(f"{namespace}.backend.count").client()
    both = {flaky.instance_id, steady.instance_id}
    assert await until(client, lambda: set(client.instance_ids()) == both, 15)

    async def one() -> int:  # the instance that served one request
        items = [r.data() async for r in await client.generate({"n": 1})]
        return int(items[0]["instance"])

    switch.touch()  # the handler, and so its canary, now fails
    assert await until(client, lambda: client.instance_ids() == [steady.instance_id], 10), (
        "the instance whose canary fails is still routed to"
    )
    assert {await one() for _ in range(6)} == {steady.instance_id}

    switch.unlink()  # repaired: the next canary passes
    assert await until(client, lambda: set(client.instance_ids()) == both, 10), (
        "the repaired instance did not come back"
    )
    assert {await one() for _ in range(4)} == both


async def test_runtime_api_canary_runs_while_requests_keep_coming(
    namespace, spawn, make_runtime, tmp_path
):
    """Requests every 50 ms, never idle for the canary's 0.2 s: it is probed all the same (a
    stuck handler still has requests started on it), and leaves routing once broken."""
    switch = tmp_path / "broken"
    flaky = spawn(*app_args(namespace, "--canary-file", str(switch), "--discovery", "static"),
                  env=CANARY_ENV)
    runtime = make_runtime(static=(flaky.address,))
    client = await runtime.endpoint(f"{namespace}.backend.count").client()
    assert await until(client, lambda: client.instance_ids() == [flaky.instance_id], 15)
    stop = asyncio.Event()

    async def traffic() -> None:  # bounded: at most 400 requests, 50 ms apart
        for _ in range(400):
            if stop.is_set():
                return
            with contextlib.suppress(errors.DynamoError):
                [r async for r in await client.direct({"n": 1}, flaky.instance_id)]
            await asyncio.sleep(0.05)

    load = asyncio.create_task(traffic())
    try:
        await asyncio.sleep(0.5)
        switch.touch()
        assert await until(client, lambda: not client.instance_ids(), 10), (
            "a busy endpoint whose canary fails is still routed to"
        )
    finally:
        stop.set()
        await load


# -- a worker's canary, seen by a round-robin frontend and a KV-routing frontend ---------------


def worker(spawn, namespace, model, engine: str, *extra: str) -> Proc:
    return spawn("-m", "dynamo_zmq.worker", "--engine", engine, "--model-path", str(model),
                 "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
                 "--speedup-ratio", "100", "--block-size", "16", "--system-port", "0",
                 "--health-check-interval", "0.3", *extra)


async def routed(url: str) -> set[int]:
    """The instances a frontend routes model 'tiny' to (its /health)."""
    status, body = await asyncio.to_thread(get, f"{url}/health")
    models = json.loads(body).get("models", {}) if status in (200, 503) else {}
    return {int(i, 16) for i in models.get("tiny", [])}


async def eventually_routed(urls: list[str], expect: set[int], timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        seen = [await routed(url) for url in urls]
        if all(s == expect for s in seen):
            return
        assert loop.time() < deadline, f"frontends route to {seen}, expected {expect}"
        await asyncio.sleep(0.1)


async def served_by(
    client: openai.AsyncOpenAI, prompts: list[list[int]], max_tokens: int
) -> set[int]:
    """Send the prompts at once; every request must succeed. The instances that served them."""

    async def one(prompt: list[int]) -> int:
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens
        )
        assert raw.parse().choices[0].finish_reason in ("length", "stop")
        return int(raw.headers["x-dynamo-worker"].split("/")[0], 16)

    return set(await asyncio.gather(*(one(p) for p in prompts)))


async def test_worker_canary_failure_takes_it_out_of_frontend_and_kv_routing(
    namespace, spawn, tiny_model, tmp_path
):
    switch = tmp_path / "broken"
    flaky = worker(spawn, namespace, tiny_model, "tests.support.engines:FlakyMocker",
                   "--flaky-file", str(switch))
    steady = worker(spawn, namespace, tiny_model, "mocker")
    both = {flaky.instance_id, steady.instance_id}
    # One frontend finds the workers by a static list, the other by mDNS.
    rr = start_frontend(spawn, namespace, "--discovery", "static", "--static-workers",
                        f"{flaky.address},{steady.address}", mode=None)
    kv = start_frontend(spawn, namespace)
    urls = [rr.wait_ready().address, kv.wait_ready().address]
    await eventually_routed(urls, both, 30)
    rng = random.Random(7)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(10, 500) for _ in range(64)] for _ in range(n)]

    switch.touch()  # the flaky worker's engine (and so its canary) now fails every request
    await eventually_routed(urls, {steady.instance_id})
    status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{system_port(flaky)}/health")
    assert status == 503 and json.loads(body)["status"] == "unhealthy"
    async with (
        openai.AsyncOpenAI(base_url=f"{urls[0]}/v1", api_key="none", max_retries=0) as by_rr,
        openai.AsyncOpenAI(base_url=f"{urls[1]}/v1", api_key="none", max_retries=0) as by_kv,
    ):
        for _ in range(4):  # round-robin, one at a time: every request goes to the healthy one
            assert await served_by(by_rr, prompts(1), 4) == {steady.instance_id}
        # KV routing, several at once (load would spread them): all on the healthy one.
        assert await served_by(by_kv, prompts(4), 24) == {steady.instance_id}

        switch.unlink()  # repaired: the next canary passes and the worker is routed again
        await eventually_routed(urls, both)
        seen: set[int] = set()
        for _ in range(4):
            seen |= await served_by(by_rr, prompts(1), 4)
        assert seen == both
        seen = set()
        for _ in range(5):  # bounded: the predicted load spreads concurrent requests
            seen |= await served_by(by_kv, prompts(4), 24)
            if seen == both:
                break
        assert seen == both, "the KV router never sent to the repaired worker"
    status, _ = await asyncio.to_thread(get, f"http://127.0.0.1:{system_port(flaky)}/health")
    assert status == 200
