"""The conformance kit: a correct engine passes, each broken engine fails with its named error.

Each of the backend-common document's eight checks has a broken test engine (``Broken<Name>``)
that passes every other check and fails exactly that one, under the document's name. Also the
document's ``mock_context`` / ``cancelling_context`` helpers, and ``validate_stream`` on
hand-made streams (its property tests are in ``test_stream_contract.py``). Every check is
bounded, so hanging engines run with tiny timeouts; only the engines that ignore cancel wait
out ``CANCEL_DEADLINE``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynamo_zmq import errors
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
    CancellationIgnored,
    CancellationNotObserved,
    ChunkAfterTerminal,
    CleanupFailed,
    CleanupWithoutStartFailed,
    ConcurrentGenerateFailed,
    ConformanceError,
    EmptyModelInConfig,
    GenerateFailed,
    MultipleTerminals,
    NotAnOutput,
    NotAStream,
    NoTerminalChunk,
    SecondCleanupFailed,
    StartFailed,
    StreamContractError,
    cancelling_context,
    default_request,
    mock_context,
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
        (EmptyName, EmptyModelInConfig, "model_name=''"),
        (StartRaises, StartFailed, "no such model"),
        (StartHangs, StartFailed, "did not return"),
        (StartReturnsDict, StartFailed, "dict"),
        (NoTerminalEngine, NoTerminalChunk, "after 3 chunk(s) without a terminal"),
        (HangingStream, NoTerminalChunk, "hung after 1 chunk(s)"),
        (ChunkAfterTerminalEngine, ChunkAfterTerminal, "chunk 2 came after the terminal chunk 1"),
        (TwoTerminals, MultipleTerminals, "second terminal"),
        (UnknownReason, BadFinishReason, "'eos'"),
        (YieldsDicts, NotAnOutput, "dict"),
        (CoroutineGenerate, NotAStream, "coroutine"),
        (GenerateRaises, GenerateFailed, "CUDA out of memory"),
        (SyncGenerateRaises, GenerateFailed, "unsupported sampling"),
        (ErrorTerminal, GenerateFailed, "'error'"),
        (FinishesAtOnce, CancellationIgnored, "nothing was left to cancel"),
        (NotThreadSafe, ConcurrentGenerateFailed, "overwrote"),
        (IgnoresCancelFinishes, CancellationIgnored, "finish_reason='length'"),
        (EndsSilentlyOnCancel, NoTerminalChunk, "without a terminal"),
        (AbortRaises, AbortFailed, "KeyError"),
        (AbortHangs, AbortFailed, "did not return"),
        (CleanupOnce, SecondCleanupFailed, "already closed"),
        (CleanupHangsSecondTime, SecondCleanupFailed, "did not return"),
        (CleanupNeedsStart, CleanupWithoutStartFailed, "never-started"),
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
    with pytest.raises(CancellationNotObserved, match=r"still open 2 s after ctx\.stop"):
        await run_conformance(IgnoresCancelForever, timeout=5)
    assert loop.time() - began < CANCEL_DEADLINE + 3


async def test_concurrency_failure_keeps_the_cause():
    with pytest.raises(ConcurrentGenerateFailed) as info:
        await run_conformance(NotThreadSafe, timeout=1, concurrency=4)
    assert isinstance(info.value.__cause__, GenerateFailed)
    assert "of 4 concurrent generates failed" in str(info.value)


# --- the document's eight checks: one broken test engine each --------------------------------


class BrokenEmptyModelInConfig(RefEngine):
    """Starts, but names no model."""

    async def start(self, worker_id: int) -> EngineConfig:
        await super().start(worker_id)
        return EngineConfig(model_name="", context_length=4096)


class BrokenNoTerminalChunk(RefEngine):
    """Forgets the finish_reason of a request that runs to its end (a cancelled one is fine)."""

    async def generate(self, request, ctx):
        async for chunk in super().generate(request, ctx):
            if chunk.finish_reason == FinishReason.LENGTH:
                yield LLMEngineOutput(chunk.token_ids)
                return
            yield chunk


class BrokenChunkAfterTerminal(RefEngine):
    """Flushes one more token after the terminal of a request that runs to its end."""

    async def generate(self, request, ctx):
        async for chunk in super().generate(request, ctx):
            yield chunk
            if chunk.finish_reason == FinishReason.LENGTH:
                yield LLMEngineOutput([0])


class BrokenConcurrentGenerate(RefEngine):
    """Keeps the request being generated on the engine: fine alone, corrupt when two overlap."""

    current: str | None = None

    async def generate(self, request, ctx):
        self.current = request.request_id
        async for chunk in super().generate(request, ctx):
            if self.current != request.request_id:
                raise RuntimeError(f"state of {self.current!r} overwrote {request.request_id!r}")
            yield chunk


class BrokenCancellationNotObserved(RefEngine):
    """Never looks at the context, and abort does nothing: a stopped long request runs on."""

    async def generate(self, request, ctx):
        async for chunk in super().generate(request, Context(ctx.id())):
            yield chunk

    async def abort(self, ctx: Context) -> None:
        pass


class BrokenCancellationIgnored(RefEngine):
    """Sees the stop at once but ends as if the request had finished: "stop", not "cancelled"."""

    async def generate(self, request, ctx):
        async for chunk in super().generate(request, ctx):
            if chunk.finish_reason == FinishReason.CANCELLED:
                yield stop_output(chunk.usage)
                return
            yield chunk


class BrokenSecondCleanup(RefEngine):
    """Frees its resources on the first cleanup and fails on the second."""

    async def cleanup(self) -> None:
        if getattr(self, "freed", False):
            raise RuntimeError("double free")
        self.freed = True
        await super().cleanup()


class BrokenCleanupWithoutStart(RefEngine):
    """Cleanup assumes start made a handle."""

    handle: object = None

    async def start(self, worker_id: int) -> EngineConfig:
        self.handle = object()
        return await super().start(worker_id)

    async def cleanup(self) -> None:
        if self.handle is None:
            raise AttributeError("'NoneType' object has no attribute 'close'")
        await super().cleanup()


DOCUMENT_CHECKS = [
    ("EmptyModelInConfig", BrokenEmptyModelInConfig, EmptyModelInConfig, "start"),
    ("NoTerminalChunk", BrokenNoTerminalChunk, NoTerminalChunk, "stream"),
    ("ChunkAfterTerminal", BrokenChunkAfterTerminal, ChunkAfterTerminal, "stream"),
    ("ConcurrentGenerateFailed", BrokenConcurrentGenerate, ConcurrentGenerateFailed, "concurrent"),
    ("CancellationNotObserved", BrokenCancellationNotObserved, CancellationNotObserved, "cancel"),
    ("CancellationIgnored", BrokenCancellationIgnored, CancellationIgnored, "cancel"),
    ("SecondCleanupFailed", BrokenSecondCleanup, SecondCleanupFailed, "cleanup_twice"),
    (
        "CleanupWithoutStartFailed",
        BrokenCleanupWithoutStart,
        CleanupWithoutStartFailed,
        "cleanup_before_start",
    ),
]


def test_the_document_names_eight_distinct_failures():
    names = [name for name, *_ in DOCUMENT_CHECKS]
    errors_ = [error for _, _, error, _ in DOCUMENT_CHECKS]
    assert names == [error.__name__ for error in errors_]
    assert len(set(errors_)) == 8
    # None of the eight is a kind of another: each is its own failure.
    for a in errors_:
        for b in errors_:
            assert a is b or not issubclass(a, b), (a, b)


@pytest.mark.parametrize(
    ("engine", "error", "check"),
    [pytest.param(e, err, c, id=name) for name, e, err, c in DOCUMENT_CHECKS],
)
async def test_each_document_check_fails_its_broken_engine(engine, error, check):
    """The engine passes every check before its own and fails that one, under the document's
    name (the exact class, not a relative)."""
    with pytest.raises(ConformanceError) as info:
        await run_conformance(engine, timeout=2.0)  # generous: CI machines are busy
    assert type(info.value) is error, repr(info.value)
    assert repr(info.value).startswith(f"{error.__name__}(")
    assert info.value.check == check


def test_error_tree():
    for cls in (NoTerminalChunk, ChunkAfterTerminal, BadFinishReason, NotAnOutput, NotAStream):
        assert issubclass(cls, StreamContractError)
    assert issubclass(MultipleTerminals, ChunkAfterTerminal)
    assert issubclass(StreamContractError, ConformanceError)
    assert issubclass(ConformanceError, AssertionError)
    # The document's two cancellation failures are different failures, not one merged.
    assert not issubclass(CancellationIgnored, CancellationNotObserved)
    assert not issubclass(CancellationNotObserved, CancellationIgnored)


def test_default_request():
    req = default_request()
    assert req.token_ids[:3] == [1, 2, 3]
    assert req.stop.max_tokens == 8


# --- the document's helpers for hand-written tests ---------------------------------------------


async def test_mock_context_runs_a_request_to_its_end():
    engine = RefEngine()
    await engine.start(1)
    ctx = mock_context()
    assert ctx.id() and not ctx.is_stopped() and not ctx.is_killed()
    assert mock_context("req-1").id() == "req-1"
    request = PreprocessedRequest(token_ids=[5, 6], stop=StopConditions(max_tokens=4))
    chunks = [c async for c in validate_stream(engine.generate(request, ctx))]
    assert [c.token_ids for c in chunks] == [[5], [6], [5], [6]]
    assert chunks[-1].finish_reason == FinishReason.LENGTH
    await engine.cleanup()


async def test_cancelling_context_stops_a_long_request_mid_stream():
    engine = RefEngine()
    await engine.start(1)
    ctx = cancelling_context(0.05)
    assert not ctx.is_stopped()
    request = PreprocessedRequest(token_ids=[1, 2], stop=StopConditions(max_tokens=100_000))
    chunks = await asyncio.wait_for(read_all(engine.generate(request, ctx)), CANCEL_DEADLINE + 5)
    assert ctx.is_stopped() and not ctx.is_killed()
    assert len(chunks) > 1  # some tokens came before the stop
    assert chunks[-1].finish_reason == FinishReason.CANCELLED
    await engine.cleanup()


async def test_cancelling_context_rejects_a_bad_delay():
    for after in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="after must be"):
            cancelling_context(after)


def test_cancelling_context_needs_a_running_loop():
    with pytest.raises(RuntimeError):
        cancelling_context(0.1)


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
        ([], NoTerminalChunk, "after 0 chunk(s)"),
        ([LLMEngineOutput([1])], NoTerminalChunk, "after 1 chunk(s)"),
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


async def test_validate_passes_a_typed_error_terminal_through():
    shutdown = errors.EngineShutdown("engine died")

    async def failing() -> AsyncIterator[LLMEngineOutput]:
        yield LLMEngineOutput([1])
        raise shutdown

    seen: list[LLMEngineOutput] = []
    with pytest.raises(errors.EngineShutdown) as info:
        async for chunk in validate_stream(failing()):
            seen.append(chunk)
    assert info.value is shutdown and seen == [LLMEngineOutput([1])]


async def test_validate_rejects_a_typed_error_after_the_terminal():
    async def failing() -> AsyncIterator[LLMEngineOutput]:
        yield stop_output()
        raise errors.InvalidArgument("late")

    with pytest.raises(MultipleTerminals, match="raised InvalidArgument") as info:
        await read_all(failing())
    assert isinstance(info.value, ChunkAfterTerminal)
    assert isinstance(info.value.__cause__, errors.InvalidArgument)


async def test_validate_propagates_engine_errors():
    async def failing() -> AsyncIterator[LLMEngineOutput]:
        yield LLMEngineOutput([1])
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await read_all(failing())
