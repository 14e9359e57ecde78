"""The chaos run's load generator: closed-loop streaming chat with the ``openai`` client.

``python -m dynamo_zmq.tools.chaos_load SPEC OUT`` reads a JSON ``LoadSpec`` from the file
SPEC, runs it and writes a JSON ``LoadResult`` to OUT. ``scripts/chaos.py`` runs it inside a
frontend's host (``Host.python``), so requests go to ``127.0.0.1`` of that host with no
forwarder in the way; times are ``time.monotonic()`` (CLOCK_MONOTONIC, the same in every
process of the machine), so they line up with the faults the driver injects.

Each of ``concurrency`` loops takes the next request index ``i`` (prompt ``i % len(prompts)``
shifted by ``offset``) until ``duration`` has passed or ``max_requests`` were started; a
request is ``hung`` when it has not ended ``deadline + margin`` seconds after it started, and
``failed`` when an error reached the client (an HTTP error, an SSE error event, a dropped
connection). It prints ``READY load`` once imported, then waits for ``start_at``.
"""

from __future__ import annotations

import asyncio
import itertools
import resource
import sys
import time
from typing import Any

import msgspec

__all__ = ["LoadResult", "LoadSpec", "Prompt", "Record", "run_load"]


class Prompt(msgspec.Struct, frozen=True):
    """One request of the pool: a user message and its token budget (``ignore_eos``, so the
    mocker generates exactly ``max_tokens``)."""

    content: str
    max_tokens: int


class LoadSpec(msgspec.Struct, frozen=True):
    """What one load process does.

    Attributes:
        url: the frontend's base URL (``http://127.0.0.1:8000``).
        model: the served model name.
        prompts: the pool.
        concurrency: requests in flight.
        duration: seconds to start requests for (0: each prompt once, for the reference).
        start_at: ``time.monotonic()`` to start at (0: at once).
        deadline: the whole-request deadline, sent as ``x-dynamo-request-timeout``.
        margin: seconds past ``deadline`` after which a request counts as hung.
        max_requests: a bound on the requests started.
        offset: the first request index (several load processes use disjoint ones).
        stride: the step between request indexes.
    """

    url: str
    model: str
    prompts: list[Prompt]
    concurrency: int
    duration: float
    start_at: float = 0.0
    deadline: float = 30.0
    margin: float = 10.0
    max_requests: int = 1_000_000
    offset: int = 0
    stride: int = 1


class Record(msgspec.Struct):
    """One request as the client saw it. Times are monotonic seconds; ``times`` are the
    arrival times of the chunks that carried text."""

    index: int
    prompt: int
    status: str  # "ok" (ended normally; the checker may still find it wrong), "failed", "hung"
    start: float
    end: float
    text: str = ""
    times: list[float] = []
    completion_tokens: int = -1
    prompt_tokens: int = -1
    finish_reason: str | None = None
    worker: str = ""
    error: str = ""


class LoadResult(msgspec.Struct):
    """All the requests of one load process, when it started (monotonic) and its own CPU
    seconds (user + system) over its wall seconds."""

    records: list[Record]
    started: float
    cpu_seconds: float
    wall_seconds: float


async def _request(client: Any, spec: LoadSpec, index: int) -> Record:
    number = index % len(spec.prompts)
    prompt = spec.prompts[number]
    rec = Record(index=index, prompt=number, status="ok", start=time.monotonic(), end=0.0)
    parts: list[str] = []
    try:
        async with asyncio.timeout(spec.deadline + spec.margin):
            stream = await client.chat.completions.create(
                model=spec.model, messages=[{"role": "user", "content": prompt.content}],
                max_tokens=prompt.max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                extra_headers={"x-dynamo-request-timeout": str(spec.deadline)},
            )
            async with stream:  # closes the response (its connection) however the loop ends
                rec.worker = stream.response.headers.get("x-dynamo-worker", "")
                async for chunk in stream:
                    if chunk.choices:
                        choice = chunk.choices[0]
                        if choice.delta.content:
                            parts.append(choice.delta.content)
                            rec.times.append(time.monotonic())
                        if choice.finish_reason:
                            rec.finish_reason = choice.finish_reason
                    if chunk.usage:
                        rec.completion_tokens = chunk.usage.completion_tokens
                        rec.prompt_tokens = chunk.usage.prompt_tokens
    except TimeoutError:
        rec.status, rec.error = "hung", f"no end {spec.deadline + spec.margin:g}s after start"
    except Exception as exc:  # whatever reached the client is the finding
        rec.status, rec.error = "failed", f"{type(exc).__name__}: {exc}"[:500]
    rec.end = time.monotonic()
    rec.text = "".join(parts)
    return rec


async def run_load(spec: LoadSpec) -> LoadResult:
    """Run ``spec`` (see the module docstring)."""
    import openai

    print("READY load", flush=True)
    if spec.start_at:
        await asyncio.sleep(max(0.0, spec.start_at - time.monotonic()))
    cpu0, wall0 = _cpu(), time.monotonic()
    once = spec.duration <= 0
    total = len(spec.prompts) if once else spec.max_requests
    end = wall0 + spec.duration
    counter = itertools.count()
    records: list[Record] = []
    client = openai.AsyncOpenAI(
        base_url=f"{spec.url}/v1", api_key="none", max_retries=0,
        timeout=spec.deadline + spec.margin + 5,
        http_client=openai.DefaultAsyncHttpxClient(
            limits=_limits(spec.concurrency), timeout=spec.deadline + spec.margin + 5),
    )

    async def loop() -> None:
        while True:
            n = next(counter)
            if n >= total or (not once and time.monotonic() >= end):
                return
            records.append(await _request(client, spec, spec.offset + n * spec.stride))

    async with client:
        async with asyncio.TaskGroup() as group:
            for _ in range(spec.concurrency):
                group.create_task(loop())
    records.sort(key=lambda r: r.index)
    return LoadResult(records, wall0, _cpu() - cpu0, time.monotonic() - wall0)


def _limits(concurrency: int) -> Any:
    import openai

    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__
                if "openai" not in c.__module__)
    lib = sys.modules[base.__module__.split(".")[0]]
    return lib.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> None:
    """``python -m dynamo_zmq.tools.chaos_load SPEC OUT``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m dynamo_zmq.tools.chaos_load SPEC OUT")
    with open(args[0], "rb") as f:
        spec = msgspec.json.decode(f.read(), type=LoadSpec)
    result = asyncio.run(run_load(spec))
    with open(args[1], "wb") as f:
        f.write(msgspec.json.encode(result))


if __name__ == "__main__":
    main()
