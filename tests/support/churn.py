"""Helpers for tests that stop, freeze and restart real workers under load behind a frontend:
slow mocker workers, a frontend, its live-worker list, worker metrics, and one streamed
completion read to its end (its text and how it ended)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import openai

from dynamo_zmq import errors
from tests.support.http_calls import get
from tests.support.metrics import sample
from tests.support.procs import Proc

#: About 60 ms a token: a few hundred tokens outlive any fault window in these tests.
SLOW = ("--speedup-ratio", "0.1")


def worker(spawn: Callable[..., Proc], namespace: str, model: object, *extra: str,
           ready: bool = True) -> Proc:
    """A slow mocker worker serving ``tiny`` on loopback, with a metrics port."""
    return spawn("-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(model),
                 "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
                 "--metrics-port", "0", *SLOW, *extra, ready=ready)


def frontend(spawn: Callable[..., Proc], namespace: str, *flags: str) -> Proc:
    """A frontend on a free port; its ``address`` is the base URL."""
    return spawn("-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                 *flags, ready=False).wait_ready()


def openai_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


async def live_workers(url: str) -> set[str]:
    """The instance ids (hex) the frontend routes ``tiny`` to now."""
    status, body = await asyncio.to_thread(get, f"{url}/health")
    if status != 200:
        return set()
    return set(json.loads(body)["models"].get("tiny", []))


async def wait_live(url: str, want: Callable[[set[str]], bool], timeout: float = 15.0) -> set[str]:
    """Poll the frontend's live workers until ``want(ids)``; fails after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        ids = await live_workers(url)
        if want(ids):
            return ids
        assert loop.time() < deadline, f"frontend routes to {ids}"
        await asyncio.sleep(0.1)


def metrics_port(proc: Proc) -> int:
    return int(next(line.split()[-1] for line in proc.logs().splitlines()
                    if "metrics and health on port" in line))


async def worker_inflight(proc: Proc) -> float:
    """The requests the worker holds now (its ``inflight`` gauge)."""
    _, body = await asyncio.to_thread(get, f"http://127.0.0.1:{metrics_port(proc)}/metrics")
    return sample(body.decode(), "dynamo_component_inflight_requests", model="tiny") or 0.0


@dataclass
class Outcome:
    """How one streamed completion ended, as its client saw it."""

    served_by: str = ""
    text: str = ""
    chunks: int = 0
    finish: str | None = None  # the finish reason of a complete stream
    status: int | None = None  # the HTTP status of a request refused before streaming
    error: dict | None = field(default=None)  # the SSE error event's (or error body's) error
    seconds: float = 0.0
    #: ``usage.completion_tokens`` of its last chunk (with ``stream_options.include_usage``)
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.finish is not None and self.error is None


async def stream_completion(client: openai.AsyncOpenAI, max_tokens: int,
                            started: asyncio.Event | None = None, **extra: object) -> Outcome:
    """One streamed completion read to its end; ``started`` is set at its first chunk."""
    out = Outcome()
    t0 = time.monotonic()
    try:
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt="Once", max_tokens=max_tokens, stream=True, **extra)
        out.served_by = raw.headers.get("x-dynamo-worker", "")
        async for chunk in raw.parse():
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
            if chunk.choices:
                out.chunks += 1
                out.text += chunk.choices[0].text
                out.finish = chunk.choices[0].finish_reason or out.finish
            if started is not None:
                started.set()
    except openai.APIStatusError as exc:
        out.status = exc.status_code
        out.error = exc.body if isinstance(exc.body, dict) else {"message": str(exc.body)}
    except openai.APIError as exc:  # an SSE error event after the stream started
        out.error = exc.body if isinstance(exc.body, dict) else {"message": str(exc.body)}
    out.seconds = time.monotonic() - t0
    return out


async def read_stream(stream: object) -> tuple[list[dict], BaseException | None]:
    """Every output of a runtime ``Client`` stream (``Response.data()``) and the typed error it
    ended with (None: it completed)."""
    got: list[dict] = []
    try:
        async for item in stream:  # type: ignore[attr-defined]
            got.append(item.data())
    except errors.DynamoError as exc:
        return got, exc
    return got, None
