"""The conformance kit: a correct engine passes, each broken engine fails with its named error.

Also ``validate_stream`` on hand-made streams. Every check is bounded, so hanging engines run
with tiny timeouts; only the engine that ignores cancel waits out ``CANCEL_DEADLINE``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynamo_zmq.context import Context
from dynamo_zmq.llm import (
    EngineConfig,
    FinishReason,
    LLMEngine,
    LLMEngineOutput,
    PreprocessedRequest,
    StopConditions,
    Usage,
    cancelled_output,
    error_output,
    length_output,
    stop_output,
)
from dynamo_zmq.testing import (
    CANCEL_DEADLINE,
    AbortFailed,
    BadFinishReason,
    CancelIgnored,
    ChunkAfterTerminal,
    CleanupBeforeStartFailed,
    CleanupFailed,
    CleanupNotIdempotent,
    ConcurrentGenerateFailed,
    ConformanceError,
    EmptyModelName,
    GenerateFailed,
    MultipleTerminals,
    NotAnOutput,
    NotAStream,
    NoTerminal,
    StartFailed,
    StreamContractError,
    default_request,
    run_conformance,
    validate_stream,
)


class RefEngine(LLMEngine):
    """A small correct engine: echoes token ids, honours max_tokens, stop and abort."""

    name = "ref"

    def __init__(self) -> None:
        self.started = False
        self.live: dict[str, Context] = {}

    async def start(self, worker_id: int) -> EngineConfig:
        if self.started:
            raise RuntimeError("start called twice")
        self.started = True
        return EngineConfig(model_name="ref-model", context_length=4096)

    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        if not self.started:
            raise RuntimeError("generate before start")
        self.live[ctx.id()] = ctx
        max_tokens = request.stop.max_tokens or 16
        prompt = len(request.token_ids)
        try:
            for i in range(max_tokens):
                await asyncio.sleep(0.001)
                if ctx.is_stopped():
                    yield cancelled_output(Usage(prompt, i))
                    return
                token = request.token_ids[i % prompt] if prompt else 0
                if i == max_tokens - 1:
                    yield length_output(Usage(prompt, max_tokens), [token])
                else:
                    yield LLMEngineOutput([token])
        finally:
            self.live.pop(ctx.id(), None)

    async def abort(self, ctx: Context) -> None:
        ctx.stop()

    async def cleanup(self) -> None:
        self.started = False
        self.live.clear()


async def test_reference_engine_passes():
    report = await run_conformance(RefEngine, timeout=5)
    assert report.passed == [
        "start",
        "stream",
        "concurrent",
        "cancel",
        "cleanup_twice",
        "cleanup_before_start",
    ]
    assert report.config is not None and report.config.model_name == "ref-model"
    assert set(report.seconds) == set(report.passed)
    assert "cancel: ok" in str(report)


async def test_async_factory_and_custom_request():
    made: list[RefEngine] = []

    async def factory() -> LLMEngine:
        await asyncio.sleep(0)
        made.append(RefEngine())
        return made[-1]

    def request() -> PreprocessedRequest:
        return PreprocessedRequest(token_ids=[7, 8], stop=StopConditions(max_tokens=3))

    report = await run_conformance(factory, request_factory=request, timeout=5, concurrency=3)
    assert len(report.passed) == 6
    # One fresh engine per check, none left running.
    assert len(made) == 6
    assert not any(e.started for e in made)
    assert not any(e.live for e in made)


async def test_cancel_request_fills_the_context():
    seen: list[PreprocessedRequest] = []

    class Recording(RefEngine):
        def generate(self, request, ctx):
            seen.append(request)
            return super().generate(request, ctx)

    await run_conformance(Recording, timeout=5, concurrency=2)
    long = [r for r in seen if r.request_id == "conformance-cancel"]
    assert len(long) == 1 and long[0].stop.ignore_eos
    assert long[0].stop.max_tokens == 4096 - len(default_request().token_ids)
    assert sorted(r.request_id for r in seen if r.request_id.startswith("conformance-")) == [
        "conformance-0",
        "conformance-1",
        "conformance-cancel",
    ]


# --- broken engines: each fails with its named error ----------------------------------------


class EmptyName(RefEngine):
    async def start(self, worker_id: int) -> EngineConfig:
        await super().start(worker_id)
        return EngineConfig(model_name="")


class StartRaises(RefEngine):
    async def start(self, worker_id: int) -> EngineConfig:
        raise OSError("no such model")


class StartHangs(RefEngine):
    async def start(self, worker_id: int) -> EngineConfig:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class StartReturnsDict(RefEngine):
    async def start(self, worker_id: int) -> Any:
        return {"model_name": "dict"}


class NoTerminalEngine(RefEngine):
    async def generate(self, request, ctx):
        for i in range(3):
            yield LLMEngineOutput([i])


class HangingStream(RefEngine):
    async def generate(self, request, ctx):
        yield LLMEngineOutput([1])
        await asyncio.Event().wait()


class ChunkAfterTerminalEngine(RefEngine):
    async def generate(self, request, ctx):
        yield LLMEngineOutput([1])
        yield stop_output()
        yield LLMEngineOutput([2])


class TwoTerminals(RefEngine):
    async def generate(self, request, ctx):
        yield length_output(token_ids=[1])
        yield stop_output()


class UnknownReason(RefEngine):
    async def generate(self, request, ctx):
        yield LLMEngineOutput([1], finish_reason="eos")


class YieldsDicts(RefEngine):
    async def generate(self, request, ctx):
        yield {"token_ids": [1], "finish_reason": "stop"}


class CoroutineGenerate(RefEngine):
    async def generate(self, request, ctx):  # type: ignore[override]
        return [stop_output()]


class GenerateRaises(RefEngine):
    async def generate(self, request, ctx):
        yield LLMEngineOutput([1])
        raise RuntimeError("CUDA out of memory")


class SyncGenerateRaises(RefEngine):
    def generate(self, request, ctx):
        raise ValueError("unsupported sampling")


class FinishesAtOnce(RefEngine):
    async def generate(self, request, ctx):
        yield length_output(token_ids=[1])


class ErrorTerminal(RefEngine):
    async def generate(self, request, ctx):
        yield error_output("bad request")


class NotThreadSafe(RefEngine):
    """Keeps the current request in shared state: fine alone, corrupt under concurrency."""

    current: str | None = None

    async def generate(self, request, ctx):
        self.current = request.request_id
        for i in range(4):
            await asyncio.sleep(0.001)
            if self.current != request.request_id:
                raise RuntimeError(f"state of {self.current!r} overwrote {request.request_id!r}")
            yield LLMEngineOutput([i])
        yield stop_output()


class IgnoresCancelForever(RefEngine):
    async def generate(self, request, ctx):
        i = 0
        while True:
            await asyncio.sleep(0.005)
            yield LLMEngineOutput([i])
            i += 1
            if i >= (request.stop.max_tokens or 16) and request.stop.max_tokens < 1000:
                yield stop_output()
                return


class IgnoresCancelFinishes(RefEngine):
    """Ignores the stop and finishes normally (an engine capping max_tokens, say)."""

    async def generate(self, request, ctx):
        for i in range(5):
            await asyncio.sleep(0.001)
            yield LLMEngineOutput([i])
        yield length_output()


class EndsSilentlyOnCancel(RefEngine):
    async def generate(self, request, ctx):
        for i in range(request.stop.max_tokens or 16):
            await asyncio.sleep(0.001)
            if ctx.is_stopped():
                return
            yield LLMEngineOutput([i])
        yield length_output()


class AbortRaises(RefEngine):
    async def abort(self, ctx: Context) -> None:
        raise KeyError(ctx.id())


class AbortHangs(RefEngine):
    async def abort(self, ctx: Context) -> None:
        await asyncio.Event().wait()


class CleanupOnce(RefEngine):
    def __init__(self) -> None:
        super().__init__()
        self.cleaned = False

    async def cleanup(self) -> None:
        if self.cleaned:
            raise RuntimeError("already closed")
        self.cleaned = True
        await super().cleanup()


class CleanupNeedsStart(RefEngine):
    handle: object = None

    async def start(self, worker_id: int) -> EngineConfig:
        self.handle = object()
        return await super().start(worker_id)

    async def cleanup(self) -> None:
        if self.handle is None:
            raise AttributeError("'NoneType' object has no attribute 'shutdown'")
        await super().cleanup()


class CleanupHangsSecondTime(CleanupOnce):
    async def cleanup(self) -> None:
        if self.cleaned:
            await asyncio.Event().wait()
        await super().cleanup()


class CleanupRaises(RefEngine):
    async def cleanup(self) -> None:
        raise RuntimeError("leaked sockets")


@pytest.mark.parametrize(
    ("engine", "error", "words"),
    [
        (EmptyName, EmptyModelName, "model_name=''"),
        (StartRaises, StartFailed, "no such model"),
        (StartHangs, StartFailed, "did not return"),
        (StartReturnsDict, StartFailed, "dict"),
        (NoTerminalEngine, NoTerminal, "after 3 chunk(s) without a terminal"),
        (HangingStream, NoTerminal, "hung after 1 chunk(s)"),
        (ChunkAfterTerminalEngine, ChunkAfterTerminal, "chunk 2 came after the terminal chunk 1"),
        (TwoTerminals, MultipleTerminals, "second terminal"),
        (UnknownReason, BadFinishReason, "'eos'"),
        (YieldsDicts, NotAnOutput, "dict"),
        (CoroutineGenerate, NotAStream, "coroutine"),
        (GenerateRaises, GenerateFailed, "CUDA out of memory"),
        (SyncGenerateRaises, GenerateFailed, "unsupported sampling"),
        (ErrorTerminal, GenerateFailed, "'error'"),
        (FinishesAtOnce, CancelIgnored, "nothing was left to cancel"),
        (NotThreadSafe, ConcurrentGenerateFailed, "overwrote"),
        (IgnoresCancelFinishes, CancelIgnored, "finish_reason='length'"),
        (EndsSilentlyOnCancel, NoTerminal, "without a terminal"),
        (AbortRaises, AbortFailed, "KeyError"),
        (AbortHangs, AbortFailed, "did not return"),
        (CleanupOnce, CleanupNotIdempotent, "already closed"),
        (CleanupHangsSecondTime, CleanupNotIdempotent, "did not return"),
        (CleanupNeedsStart, CleanupBeforeStartFailed, "never-started"),
        (CleanupRaises, CleanupFailed, "leaked sockets"),
    ],
)
async def test_broken_engine_fails_with_its_error(engine, error, words):
    with pytest.raises(error) as info:
        await run_conformance(engine, timeout=2.0)  # generous: CI machines are busy
    assert isinstance(info.value, ConformanceError) and isinstance(info.value, AssertionError)
    assert words in str(info.value)
    assert type(info.value).__name__ in repr(info.value)


async def test_engine_ignoring_cancel_fails_within_the_deadline():
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(CancelIgnored, match=r"still open 2 s after ctx\.stop"):
        await run_conformance(IgnoresCancelForever, timeout=5)
    assert loop.time() - began < CANCEL_DEADLINE + 3


async def test_concurrency_failure_keeps_the_cause():
    with pytest.raises(ConcurrentGenerateFailed) as info:
        await run_conformance(NotThreadSafe, timeout=1, concurrency=4)
    assert isinstance(info.value.__cause__, GenerateFailed)
    assert "of 4 concurrent generates failed" in str(info.value)


def test_error_tree():
    for cls in (NoTerminal, ChunkAfterTerminal, MultipleTerminals, BadFinishReason, NotAnOutput):
        assert issubclass(cls, StreamContractError)
    assert issubclass(StreamContractError, ConformanceError)
    assert issubclass(ConformanceError, AssertionError)


def test_default_request():
    req = default_request()
    assert req.token_ids[:3] == [1, 2, 3]
    assert req.stop.max_tokens == 8


# --- validate_stream on hand-made streams -----------------------------------------------------


async def chunks_of(*items: Any) -> AsyncIterator[Any]:
    for item in items:
        yield item


async def read_all(stream: AsyncIterator[LLMEngineOutput]) -> list[LLMEngineOutput]:
    return [chunk async for chunk in validate_stream(stream)]


@pytest.mark.parametrize("reason", sorted(FinishReason.ALL))
async def test_validate_passes_chunks_through(reason):
    items = [
        LLMEngineOutput([1]),
        LLMEngineOutput([2], text="b"),
        LLMEngineOutput(finish_reason=reason),
    ]
    assert await read_all(chunks_of(*items)) == items


async def test_validate_terminal_only():
    assert await read_all(chunks_of(stop_output())) == [stop_output()]


@pytest.mark.parametrize(
    ("items", "error", "words"),
    [
        ([], NoTerminal, "after 0 chunk(s)"),
        ([LLMEngineOutput([1])], NoTerminal, "after 1 chunk(s)"),
        ([stop_output(), LLMEngineOutput([1])], ChunkAfterTerminal, "chunk 1 came after"),
        ([stop_output(), stop_output()], MultipleTerminals, "second terminal"),
        ([stop_output(), cancelled_output()], MultipleTerminals, "finish_reason='stop'"),
        ([LLMEngineOutput(finish_reason="")], BadFinishReason, "finish_reason=''"),
        ([LLMEngineOutput(finish_reason="abort")], BadFinishReason, "'abort'"),
        ([LLMEngineOutput([1]), [1, 2]], NotAnOutput, "chunk 1 is list"),
        ([None], NotAnOutput, "NoneType"),
    ],
)
async def test_validate_raises(items, error, words):
    with pytest.raises(error) as info:
        await read_all(chunks_of(*items))
    assert words in str(info.value)


async def test_validate_yields_terminal_before_raising_on_what_follows():
    seen: list[LLMEngineOutput] = []
    with pytest.raises(ChunkAfterTerminal):
        async for chunk in validate_stream(
            chunks_of(LLMEngineOutput([1]), stop_output(), LLMEngineOutput([2]))
        ):
            seen.append(chunk)
    assert seen == [LLMEngineOutput([1]), stop_output()]


async def test_validate_rejects_non_streams():
    async def coro() -> list[LLMEngineOutput]:
        return [stop_output()]

    with pytest.raises(NotAStream, match="coroutine"):
        await read_all(coro())  # type: ignore[arg-type]
    with pytest.raises(NotAStream, match="list"):
        await read_all([stop_output()])  # type: ignore[arg-type]


async def test_validate_closes_the_inner_stream():
    closed = asyncio.Event()

    async def engine_stream() -> AsyncIterator[LLMEngineOutput]:
        try:
            for i in range(100):
                yield LLMEngineOutput([i])
            yield stop_output()
        finally:
            closed.set()

    wrapped = validate_stream(engine_stream())
    assert await wrapped.__anext__() == LLMEngineOutput([0])
    await wrapped.aclose()
    assert closed.is_set()

    # And when validation fails mid-stream.
    closed.clear()

    async def bad_stream() -> AsyncIterator[Any]:
        try:
            yield stop_output()
            yield LLMEngineOutput([1])
            yield LLMEngineOutput([2])
        finally:
            closed.set()

    with pytest.raises(ChunkAfterTerminal):
        await read_all(bad_stream())
    assert closed.is_set()


async def test_validate_propagates_engine_errors():
    async def failing() -> AsyncIterator[LLMEngineOutput]:
        yield LLMEngineOutput([1])
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await read_all(failing())
