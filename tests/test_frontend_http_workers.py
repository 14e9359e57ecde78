"""``python -m dynamo_zmq.frontend --http-workers N`` through real processes (issue 34 item 2):
N processes serve one port (SO_REUSEPORT) under a supervisor; fresh connections reach each;
SIGTERM drains them all; a killed one comes back while the other serves; in kv mode each
counts the other's requests in flight (router replica sync, found over mDNS or, with static
discovery, a private directory); ``/metrics`` labels every process's series ``http_worker``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from dynamo_zmq.frontend import FrontendMetrics
from dynamo_zmq.frontend._http_workers import WORKER_ENV
from dynamo_zmq.frontend._sibling_metrics import merge_pages
from tests.support.http_calls import post
from tests.support.metrics import metrics_page, sample
from tests.support.mocker_fleet import mocker_fleet, serving, start_frontend, start_worker
from tests.support.procs import Proc, children, run_cli
from tests.support.sse import events, open_streams
from tests.support.waiting import eventually

N = 2
CHAT = [{"role": "user", "content": "Tell me a story."}]


def _is_frontend(pid: int) -> bool:
    try:
        return b"dynamo_zmq.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.fixture
def groups() -> Iterator[Callable[[Proc], Proc]]:
    """Register a supervisor; at teardown (before ``spawn`` stops it) it is stopped and each of
    its children is made sure gone, by pid."""
    fronts: list[Proc] = []
    yield lambda front: fronts.append(front) or front
    for front in fronts:
        pids = children(front.pid)
        front.stop()
        deadline = time.monotonic() + 30
        for pid in pids:
            while _is_frontend(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _is_frontend(pid):
                os.kill(pid, signal.SIGKILL)


def full_log(front: Proc) -> str:
    """The supervisor's whole stderr (its children's too: they share it)."""
    return Path(front.log.name).read_text(errors="replace")


#: Seconds a group may take to start: a supervisor says READY once all N processes have, and
#: each imports the frontend, slowly on a loaded 2-core machine.
START = 120.0


async def all_serving(url: str, model: str = "tiny", timeout: float = START) -> str:
    """Wait until every process of the group has a router for ``model`` that follows its
    sibling (``dynamo_router_replica_peers`` per ``http_worker``, on the merged page)."""
    async def each_follows_the_other() -> bool:
        page = await metrics_page(url)
        return all(sample(page, "dynamo_router_replica_peers", model=model,
                          http_worker=str(i)) == N - 1 for i in range(N))

    await eventually(each_follows_the_other, timeout, f"{N} http workers serving {model}")
    return url


def served_per_process(page: str) -> list[float]:
    """Generation requests each process has answered, by ``http_worker``."""
    return [sample(page, "dynamo_frontend_requests_total", http_worker=str(i)) or 0.0
            for i in range(N)]


def complete(url: str) -> dict[str, Any]:
    """One unary completion on a connection of its own (urllib opens one per call)."""
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()
    status, answer = post(f"{url}/v1/completions", body)
    assert status == 200, answer
    return dict(json.loads(answer))


async def group(spawn, groups, namespace: str, model_dir: Path, *extra: str,
                speedup: str = "1000", workers: int = 1) -> tuple[Proc, str]:
    fleet = await mocker_fleet(spawn, namespace, model_dir, workers, speedup=speedup,
                               frontend_args=("--http-workers", str(N), *extra), timeout=START)
    groups(fleet.front)
    return fleet.front, await all_serving(fleet.url)


async def test_two_http_workers_serve_streaming_and_unary_requests(
        spawn, groups, namespace, tiny_model):
    front, url = await group(spawn, groups, namespace, tiny_model)
    assert len([p for p in children(front.pid) if _is_frontend(p)]) == N
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="tiny", messages=CHAT, stream=True, max_tokens=12)  # type: ignore[arg-type]
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        assert text and finish == "length"
        unary = await client.completions.create(model="tiny", prompt="hello", max_tokens=6)
        assert unary.choices[0].text and unary.usage and unary.usage.completion_tokens == 6


async def test_fresh_connections_reach_every_process(spawn, groups, namespace, tiny_model):
    _, url = await group(spawn, groups, namespace, tiny_model)
    before = served_per_process(await metrics_page(url))
    for _ in range(24):  # each on a connection of its own: the kernel hashes each anew
        await asyncio.to_thread(complete, url)
    after = served_per_process(await metrics_page(url))
    grew = [b - a for a, b in zip(before, after, strict=True)]
    assert sum(grew) == 24 and all(g > 0 for g in grew), grew


async def test_sigterm_drains_every_process_then_the_port_closes(
        spawn, groups, namespace, tiny_model):
    front, url = await group(spawn, groups, namespace, tiny_model, "--graceful-timeout", "60",
                             speedup="0.5")
    pids = [p for p in children(front.pid) if _is_frontend(p)]
    async with httpx.AsyncClient(timeout=120) as client:
        tasks: list[asyncio.Task[bytes]] = []
        while True:  # streams on connections of their own until each process has one open
            started = asyncio.Event()
            tasks += await open_streams(url, 2, 150, started, client)
            await asyncio.wait_for(started.wait(), 60)
            page = await metrics_page(url)
            if all(sample(page, "dynamo_frontend_inflight_requests", http_worker=str(i))
                   for i in range(N)):
                break
            assert len(tasks) < 16, "the streams all reached one process"
        front.signal(signal.SIGTERM)
        bodies = await asyncio.gather(*tasks)
    for body in bodies:
        ev = events(body)
        assert ev[-1] == b"data: [DONE]" and b'"finish_reason":"length"' in ev[-2], ev[-3:]
    assert await asyncio.to_thread(front.wait, 30) == 0, front.logs()
    assert not any(_is_frontend(p) for p in pids)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError), socket.create_connection((host, int(port)), 5):
        pass
    assert "Traceback" not in front.logs()


def complete_retrying(url: str) -> dict[str, Any]:
    """``complete``, retried (at most 5 times, as a client would) where the connection is
    refused or reset: one reaching the killed process's socket as it went away."""
    for attempt in range(5):
        try:
            return complete(url)
        except (ConnectionError, urllib.error.URLError):
            if attempt == 4:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


async def test_a_killed_process_comes_back_while_the_other_serves(
        spawn, groups, namespace, tiny_model):
    front, url = await group(spawn, groups, namespace, tiny_model)
    old = sorted(p for p in children(front.pid) if _is_frontend(p))
    killed = old[0]
    slot = re.search(rf"http worker (\d+) \(pid {killed}\) serves", full_log(front))
    assert slot, full_log(front)
    os.kill(killed, signal.SIGKILL)
    for _ in range(10):  # served all along, by the other process meanwhile
        await asyncio.to_thread(complete_retrying, url)

    async def restarted() -> int | None:
        since = full_log(front).split(f"(pid {killed}) exited")
        found = len(since) > 1 and re.search(rf"http worker {slot[1]} \(pid (\d+)\) serves",
                                             since[-1])
        return int(found[1]) if found else None

    new = await eventually(restarted, START, "the killed process restarted")
    assert new not in old and new in children(front.pid)
    await all_serving(url)
    before = served_per_process(await metrics_page(url))
    for _ in range(24):
        await asyncio.to_thread(complete_retrying, url)
    after = served_per_process(await metrics_page(url))
    assert all(b > a for a, b in zip(before, after, strict=True)), (before, after)


def supervisor_directory(child: int) -> str:
    """The supervisor's temporary directory, from a child's environment (``WORKER_ENV``)."""
    environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
    value = next(v for v in environ if v.startswith(WORKER_ENV.encode() + b"="))
    return value.decode().split(":", 2)[2]


async def test_a_killed_supervisor_leaves_no_process_behind(spawn, groups, namespace, tiny_model):
    front, _ = await group(spawn, groups, namespace, tiny_model)
    pids = [p for p in children(front.pid) if _is_frontend(p)]
    assert len(pids) == N
    directory = supervisor_directory(pids[0])
    assert await asyncio.to_thread(os.path.isdir, directory)
    front.signal(signal.SIGKILL)  # the kernel sends each child SIGTERM (PR_SET_PDEATHSIG)

    async def all_gone() -> bool:
        return not any(_is_frontend(p) for p in pids)

    await eventually(all_gone, 30, "the children of a killed supervisor exiting")
    assert not await asyncio.to_thread(os.path.exists, directory)  # the children removed it


@pytest.mark.parametrize("discovery", ["mdns", "static"])
async def test_kv_processes_count_each_others_requests_in_flight(
        spawn, groups, namespace, tiny_model, discovery):
    """A stream open through one process is in the other's load view: the other's replica
    sync counts it and its blocks (``dynamo_router_replica_*``), until the stream ends. With
    static discovery the processes find each other in the supervisor's private directory."""
    if discovery == "mdns":
        front, url = await group(spawn, groups, namespace, tiny_model, speedup="0.1")
    else:
        worker = start_worker(spawn, namespace, tiny_model, "--discovery", "static",
                              speedup="0.1", ready=True)
        front = groups(start_frontend(spawn, namespace, "--http-workers", str(N),
                                      "--discovery", "static", "--static-workers",
                                      worker.address))
        url = await all_serving(await serving(front, [worker], timeout=START))

    async with httpx.AsyncClient(timeout=60) as client:
        started = asyncio.Event()
        task, = await open_streams(url, 1, 2000, started, client)
        await asyncio.wait_for(started.wait(), 60)
        page = await metrics_page(url)
        serving_it = [i for i in range(N)
                      if sample(page, "dynamo_frontend_inflight_requests", http_worker=str(i))]
        assert len(serving_it) == 1, page
        other = str(1 - serving_it[0])

        async def counted_by_the_other() -> str | None:
            page = await metrics_page(url)
            return page if sample(page, "dynamo_router_replica_requests",
                                  http_worker=other) == 1 else None

        page = await eventually(counted_by_the_other, 15, "the other process counting it")
        assert sample(page, "dynamo_router_replica_requests",
                      http_worker=str(serving_it[0])) == 0, page
        assert sample(page, "dynamo_router_replica_active_blocks", http_worker=other), page
        task.cancel()  # the client goes away: the request ends, and with it the other's count
        await asyncio.gather(task, return_exceptions=True)

    async def released_by_the_other() -> bool:
        return sample(await metrics_page(url), "dynamo_router_replica_requests",
                      http_worker=other) == 0

    await eventually(released_by_the_other, 15, "the other process releasing it")


def test_http_workers_below_one_is_refused() -> None:
    result = run_cli("-m", "dynamo_zmq.frontend", "--http-workers", "0", "--http-port", "0",
                     timeout=60)
    assert result.returncode == 2, result
    assert "--http-workers must be >= 1, got 0" in result.stderr


def test_merged_page_has_each_family_once_with_every_process_labelled() -> None:
    pages = {}
    for index in range(N):
        metrics = FrontendMetrics()
        metrics.requests.labels("tiny", "chat", "stream", "success").inc(index + 1)
        metrics.token_metrics("tiny")[0].observe(0.01)
        pages[index] = metrics.render()
    page = merge_pages(pages).decode()
    assert page.count("# TYPE dynamo_frontend_requests_total counter") == 1
    assert page.count("# TYPE dynamo_frontend_time_to_first_token_seconds histogram") == 1
    assert [sample(page, "dynamo_frontend_requests_total", http_worker=str(i))
            for i in range(N)] == [1.0, 2.0]
    assert sample(page, "dynamo_frontend_time_to_first_token_seconds_count") == N
