"""Waits for tests: a condition on a client's view of the cluster, any async check, a frontend
that lists some models, and a frontend that serves every worker it was started with."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .http_calls import get

T = TypeVar("T")


async def until(client, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """True once ``predicate()`` holds; False if it still does not after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        await client._pool.wait_changed(min(remaining, 0.1))
    return True


async def eventually(check: Callable[[], Awaitable[T]], timeout: float = 15.0,
                     what: str = "condition", interval: float = 0.1) -> T:
    """The first truthy value of ``await check()``, polled every ``interval`` seconds; fails the
    test if there is none within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := await check()):
        assert loop.time() < deadline, f"{what} not reached in {timeout}s"
        await asyncio.sleep(interval)
    return value


async def wait_models(url: str, names: set[str], timeout: float = 30.0) -> None:
    """Wait until the frontend at ``url`` lists every model of ``names`` on ``/v1/models``;
    fails the test (with the last answer) after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        status, body = await asyncio.to_thread(get, f"{url}/v1/models")
        if status == 200 and names <= {m["id"] for m in json.loads(body)["data"]}:
            return
        assert loop.time() < deadline, f"models {names} not listed: {body!r}"
        await asyncio.sleep(0.1)


async def serving(front: Any, workers: Sequence[Any], model: str = "tiny",
                  timeout: float = 30.0) -> str:
    """Wait until the frontend and ``workers`` (``spawn``ed with ``ready=False``) are ready and
    the frontend's ``/health`` lists exactly those workers for ``model``; returns its URL.
    A process that already said READY (``address`` set) is not waited for again, so a test can
    wait for a frontend started later, or a worker added later, the same way. ``timeout``
    bounds each process's READY too."""
    for proc in [*workers, front]:
        if not proc.address:
            proc.wait_ready(max(timeout, 30.0))
    url = str(front.address)
    ids = {f"{w.instance_id:x}" for w in workers}

    async def all_listed() -> bool:
        status, body = await asyncio.to_thread(get, f"{url}/health")
        return status == 200 and set(json.loads(body)["models"].get(model, [])) == ids

    await eventually(all_listed, timeout, f"{len(ids)} workers serving {model!r} at {url}")
    return url
