"""The frontend's SIGTERM (issue 33 item 7): open requests get ``--graceful-timeout`` to finish;
streams still open when it is up end with a retryable 503 SSE error event and ``[DONE]`` (a
complete chunked body, never a cut one), and the frontend exits 0 without a traceback. Before
this, uvicorn's fixed 5 s cancelled such streams mid-body and logged a traceback per stream."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import httpx

from tests.support.mocker_fleet import mocker_fleet
from tests.support.sse import events, open_streams


async def sigterm_mid_stream(spawn, namespace, tiny_model, grace: str, streams: int,
                             max_tokens: int) -> tuple[list[bytes], Any]:
    """A frontend with ``--graceful-timeout grace`` over one slow mocker; SIGTERM once each of
    ``streams`` streams has content. The bodies as received, and the frontend."""
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 1, mode=None, speedup="0.5",
                               frontend_args=("--graceful-timeout", grace))
    started = asyncio.Event()
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = await open_streams(fleet.url, streams, max_tokens, started, client)
        await asyncio.wait_for(started.wait(), 60)
        fleet.front.signal(signal.SIGTERM)
        try:
            return list(await asyncio.gather(*tasks)), fleet.front
        except Exception:
            await asyncio.to_thread(fleet.front.wait, 30)
            print("frontend log:", fleet.front.logs())
            raise


async def test_streams_open_when_the_grace_ends_get_a_retryable_error_and_done(
        spawn, namespace, tiny_model):
    bodies, front = await sigterm_mid_stream(spawn, namespace, tiny_model, "2", 4, 1500)
    for body in bodies:
        ev = events(body)
        assert ev[-1] == b"data: [DONE]", ev[-3:]
        error = json.loads(ev[-2].removeprefix(b"data: "))["error"]
        assert error["type"] == "service_unavailable_error", error
        assert error["code"] == "frontend_shutdown", error
        assert not any(b'"finish_reason":"length"' in e for e in ev)  # cut short, not finished
    assert await asyncio.to_thread(front.wait, 30) == 0
    logs = front.logs()
    assert "Traceback" not in logs and "ended 4 open requests" in logs, logs


async def test_streams_that_finish_within_the_grace_end_normally(spawn, namespace, tiny_model):
    bodies, front = await sigterm_mid_stream(spawn, namespace, tiny_model, "60", 3, 60)
    for body in bodies:
        ev = events(body)
        assert ev[-1] == b"data: [DONE]" and b'"finish_reason":"length"' in ev[-2], ev[-3:]
        assert not any(b'"error"' in e for e in ev)
    assert await asyncio.to_thread(front.wait, 30) == 0
    assert "Traceback" not in front.logs()
