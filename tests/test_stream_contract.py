"""The stream contract: ``validate_stream`` against a reference model of the document's rules,
and the transport's terminal rules and cancellation, explored with random handlers and callers.

``validate_stream`` (the backend-common document's validator): random engine streams (chunks,
terminal chunks with good and bad finish reasons, things that are not chunks, typed errors and
crashes, anything after a terminal, no terminal at all), read fully or closed early; what the
validator yields and raises equals ``reference_verdict``, a direct reading of the rules.

Transport: one real server and client (in process, over TCP) per test; each example is one
request. The handler yields ``k`` items and then returns, raises, or hangs until cancelled; the
caller reads everything, or after ``j`` items stops, kills, closes or drops the stream. Whatever
happens:

- the caller sees items ``0..m-1`` in order, each once, then exactly one outcome: a clean end,
  the handler's typed error with its kind and message, or Cancelled after a kill;
- nothing hangs (every example runs under a deadline);
- afterwards neither side keeps any state of the stream.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dynamo_zmq import errors
from dynamo_zmq.llm import FinishReason, LLMEngineOutput
from dynamo_zmq.resources import Resources
from dynamo_zmq.runtime import Context
from dynamo_zmq.testing import (
    BadFinishReason,
    ChunkAfterTerminal,
    MultipleTerminals,
    NotAnOutput,
    NoTerminalChunk,
    validate_stream,
)
from dynamo_zmq.transport import PeerConnection, Server, plain_items
from dynamo_zmq.wire import encode_item

# The pair fixture is deliberately shared by the examples of a test: each example is one request
# and leaves nothing behind (which the test checks).
SETTINGS = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
EXAMPLE_TIMEOUT = 5.0

ENDINGS = ["return", "value", "invalid", "surrogate", "hang"]
ACTIONS = ["read", "stop", "kill", "aclose", "drop"]


async def behave(request: dict[str, Any], context: Context):
    """Yield ``k`` items, then end as ``end`` says; honours STOP between items."""
    for i in range(request["k"]):
        if context.is_stopped():
            return
        yield i
        if request["delay"]:
            await asyncio.sleep(request["delay"])
    if context.is_stopped():
        return
    end, msg = request["end"], request["msg"]
    if end == "value":
        raise ValueError(msg)
    if end == "invalid":
        raise errors.InvalidArgument(msg)
    if end == "surrogate":
        # Text decoded with surrogateescape (file names, subprocess output) is not valid UTF-8.
        raise ValueError(msg.encode().decode("ascii", "surrogateescape"))
    if end == "hang":
        await context.stopped()  # until the caller stops it; a kill cancels the task


@dataclass
class Pair:
    server: Server
    conn: PeerConnection
    path: str


@pytest.fixture
async def pair(make_runtime, namespace: str) -> AsyncIterator[Pair]:
    """A runtime serving ``behave`` and a bare transport connection to it."""
    path = f"{namespace}.worker.behave"
    srv = make_runtime(static=())
    await srv.endpoint(path).start_serving(behave)
    assert srv._server is not None
    res = Resources("test")
    conn = PeerConnection(res, srv.address)
    conn.start()
    try:
        await conn.wait_described(10)
        yield Pair(srv._server, conn, path)
    finally:
        await conn.close()
        await res.close()


async def eventually(condition: Callable[[], bool], what: str, timeout: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.005)


@dataclass
class Seen:
    items: list[Any]
    outcome: Any  # "end", a DynamoError, or None when the caller left early
    acted: bool  # the caller's action happened (the stream had at least j items)
    done_when_acted: bool  # ... after the stream's terminal had already arrived
    again: Any = None  # what reading once more after the outcome gave


async def _next(stream: Any) -> Any:
    try:
        return ("item", await stream.__anext__())
    except StopAsyncIteration:
        return "end"
    except errors.DynamoError as exc:
        return exc


async def call(pair: Pair, request: dict[str, Any], window: int, action: str, j: int) -> Seen:
    ctx = Context()
    stream = await pair.conn.open_stream(
        pair.path, encode_item(request), ctx, window=window, decode=plain_items
    )
    got: list[Any] = []
    acted = done_when_acted = False
    while True:
        if action != "read" and not acted and len(got) == j:
            acted, done_when_acted = True, stream._st.done
            if action == "stop":
                ctx.stop()
            elif action == "kill":
                ctx.kill()
            elif action == "aclose":
                await stream.aclose()
                return Seen(got, None, acted, done_when_acted)
            else:  # drop it on the floor, unfinished
                del stream
                gc.collect()
                return Seen(got, None, acted, done_when_acted)
        outcome = await _next(stream)
        if isinstance(outcome, tuple):
            got.append(outcome[1])
        else:
            return Seen(got, outcome, acted, done_when_acted, again=await _next(stream))


def assert_natural_outcome(outcome: Any, end: str, msg: str) -> None:
    """The handler ran to its end: its own terminal reached the caller intact."""
    if end == "return":
        assert outcome == "end"
    elif end == "value":
        assert type(outcome) is errors.Unknown, outcome
        assert outcome.message == f"ValueError: {msg}"
    elif end == "invalid":
        assert type(outcome) is errors.InvalidArgument, outcome
        assert outcome.message == msg
    elif end == "surrogate":
        assert type(outcome) is errors.Unknown, outcome
        assert outcome.message.startswith("ValueError: ")
    else:
        raise AssertionError(f"a hanging handler ended by itself: {outcome!r}")


requests = st.fixed_dictionaries(
    {
        "k": st.integers(0, 40),
        "end": st.sampled_from(ENDINGS),
        "msg": st.text(max_size=20),
        "delay": st.sampled_from([0, 0, 0.001]),
    }
)
windows = st.sampled_from([1, 2, 3, 7, 1024])


@SETTINGS
@given(request=requests, window=windows, action=st.sampled_from(ACTIONS), data=st.data())
async def test_terminal_rules_and_cancellation(
    pair: Pair, request: dict[str, Any], window: int, action: str, data: st.DataObject
) -> None:
    k, end = request["k"], request["end"]
    if end == "hang" and action == "read":
        action = "kill"  # reading a hanging stream to its end would hang by design
    # A hanging handler is only ever left by the caller, so act on or before its last item.
    j = data.draw(st.integers(0, k if end == "hang" else k + 2), label="j")

    try:
        seen = await asyncio.wait_for(call(pair, request, window, action, j), EXAMPLE_TIMEOUT)
    except asyncio.TimeoutError:
        raise AssertionError(
            f"the stream hung: {request}, window={window}, {action} at {j}"
        ) from None

    m = len(seen.items)
    assert seen.items == list(range(m))  # in order, no duplicates, nothing invented
    assert m <= k
    if not seen.acted or (action in ("stop", "kill") and seen.done_when_acted):
        # The action came too late to matter: the stream completed by itself.
        assert m == k
        assert_natural_outcome(seen.outcome, end, request["msg"])
    elif action == "kill":
        assert type(seen.outcome) is errors.Cancelled, seen.outcome
        assert m >= j
    elif action == "stop":
        assert m >= j
        if seen.outcome != "end":  # the STOP arrived after the handler had finished
            assert m == k
            assert_natural_outcome(seen.outcome, end, request["msg"])
    else:  # aclose / drop
        assert (m, seen.outcome) == (j, None)
    if seen.outcome is not None:  # one outcome only: reading on repeats it, never a late item
        assert seen.again is seen.outcome or seen.again == seen.outcome == "end", seen.again

    # Neither side keeps the stream.
    await eventually(lambda: not pair.server._streams, "the server forgets the stream")
    await eventually(lambda: not pair.conn._streams, "the client forgets the stream")


async def test_kill_reaches_a_hanging_handler(pair: Pair) -> None:
    ctx = Context()
    request = {"k": 2, "end": "hang", "msg": "", "delay": 0}
    stream = await pair.conn.open_stream(pair.path, encode_item(request), ctx, decode=plain_items)
    assert [await stream.__anext__(), await stream.__anext__()] == [0, 1]
    await eventually(lambda: len(pair.server._streams) == 1, "the server holds the stream")
    ctx.kill()
    with pytest.raises(errors.Cancelled):
        await asyncio.wait_for(stream.__anext__(), EXAMPLE_TIMEOUT)
    await eventually(lambda: not pair.server._streams, "the kill cancels the handler")


async def test_a_finished_stream_dropped_unread_is_forgotten(pair: Pair) -> None:
    request = {"k": 5, "end": "return", "msg": "", "delay": 0}
    stream = await pair.conn.open_stream(
        pair.path, encode_item(request), Context(), decode=plain_items
    )
    assert await stream.__anext__() == 0
    state = stream._st
    await eventually(lambda: state.done, "the END arrives")
    del stream  # four items and the END never read
    gc.collect()
    assert not pair.conn._streams


# --- validate_stream against a reference model of the rules -----------------------------------

TYPED_ERRORS = [
    errors.InvalidArgument,
    errors.EngineShutdown,
    errors.Cancelled,
    errors.StreamIncomplete,
    errors.Unknown,
]

tokens = st.builds(lambda ids: LLMEngineOutput(ids), st.lists(st.integers(0, 2**31), max_size=3))
terminals = st.builds(
    lambda ids, reason: LLMEngineOutput(ids, finish_reason=reason),
    st.lists(st.integers(0, 2**31), max_size=2),
    st.sampled_from(sorted(FinishReason.ALL)),
)
bad_terminals = st.builds(
    lambda reason: LLMEngineOutput(finish_reason=reason),
    st.text(max_size=8).filter(lambda r: r not in FinishReason.ALL),
)
not_outputs = st.sampled_from(
    [None, 7, "stop", [1, 2], {"token_ids": [1], "finish_reason": "stop"},
     errors.EngineShutdown("yielded, not raised")]
)  # fmt: skip
stream_items = st.one_of(tokens, tokens, terminals, terminals, bad_terminals, not_outputs)
#: How the engine's stream ends after its items: returns, raises a typed error, or crashes.
endings = st.one_of(
    st.just("return"),
    st.builds(lambda cls, msg: cls(msg), st.sampled_from(TYPED_ERRORS), st.text(max_size=8)),
    st.builds(lambda msg: RuntimeError(msg), st.text(max_size=8)),
)


def reference_verdict(items: list[Any], ending: Any) -> tuple[list[Any], Any]:
    """What the document's rules say a validator must do with this stream: the items it passes
    on, and the exception it ends with (``None``: a clean end).

    Rules: every item is an ``LLMEngineOutput``; a terminal is a chunk with a finish_reason
    (one of ``FinishReason.ALL``) or a typed error the stream raises; there is exactly one, and
    nothing follows it; any other exception is the engine's crash and passes through. The
    first rule broken decides, and everything before the breaking item passes through.
    """

    def is_terminal(item: Any) -> bool:
        return isinstance(item, LLMEngineOutput) and item.finish_reason is not None

    for i, item in enumerate(items):
        before = items[:i]
        if not isinstance(item, LLMEngineOutput):
            return before, NotAnOutput
        if any(is_terminal(x) for x in before):
            return before, MultipleTerminals if is_terminal(item) else ChunkAfterTerminal
        if is_terminal(item) and item.finish_reason not in FinishReason.ALL:
            return before, BadFinishReason
    ended = any(is_terminal(x) for x in items)
    if isinstance(ending, errors.DynamoError):
        return items, MultipleTerminals if ended else ending
    if isinstance(ending, Exception):
        return items, ending
    return items, None if ended else NoTerminalChunk


def engine_stream(items: list[Any], ending: Any, closed: list[bool], pause: bool):
    """An engine's ``generate`` stream: ``items``, then ``ending``; notes when it is closed."""

    async def gen():
        try:
            for item in items:
                if pause:
                    await asyncio.sleep(0)
                yield item
            if isinstance(ending, Exception):
                raise ending
        finally:
            closed.append(True)

    return gen()


@settings(max_examples=400, deadline=None)
# The rules' corners, always tried: a typed error as the terminal, and after one; a crash after
# one; a chunk and a second terminal after one; no terminal at all.
@example([LLMEngineOutput([1])], errors.EngineShutdown("died"), False, None)
@example([LLMEngineOutput(finish_reason="cancelled")], errors.InvalidArgument(""), False, None)
@example([LLMEngineOutput(finish_reason="stop")], RuntimeError("late crash"), True, None)
@example([LLMEngineOutput(finish_reason="length"), LLMEngineOutput([2])], "return", False, None)
@example([LLMEngineOutput(finish_reason="stop")] * 2, "return", False, 1)
@example([LLMEngineOutput([1]), LLMEngineOutput([2])], "return", True, None)
@given(
    items=st.lists(stream_items, max_size=8),
    ending=endings,
    pause=st.booleans(),
    leave_after=st.none() | st.integers(1, 8),
)
async def test_validate_stream_matches_the_reference_model(
    items: list[Any], ending: Any, pause: bool, leave_after: int | None
) -> None:
    closed: list[bool] = []
    wrapped = validate_stream(engine_stream(items, ending, closed, pause))
    got: list[Any] = []
    outcome: BaseException | None = None
    try:
        async for chunk in wrapped:
            got.append(chunk)
            if leave_after is not None and len(got) == leave_after:
                await wrapped.aclose()  # the reader leaves early
                break
    except Exception as exc:
        outcome = exc

    want, verdict = reference_verdict(items, ending)
    if leave_after is not None and len(want) >= leave_after:
        # The reader left after ``leave_after`` items: nothing more, and no verdict, reaches it.
        assert got == want[:leave_after]
        assert outcome is None, repr(outcome)
    else:
        assert got == want
        if verdict is None:
            assert outcome is None, repr(outcome)
        elif isinstance(verdict, type):
            assert type(outcome) is verdict, (repr(outcome), verdict)
        else:
            assert outcome is verdict, repr(outcome)  # the engine's own exception, unchanged
    assert closed == [True]  # the engine's stream is closed, once, whatever happened
