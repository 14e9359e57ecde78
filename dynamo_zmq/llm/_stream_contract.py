"""The stream contract of ``LLMEngine.generate``, checked chunk by chunk.

``validate_stream`` wraps one ``generate`` stream and raises as soon as it breaks the contract
of the backend-common document: every chunk an ``LLMEngineOutput``; exactly one terminal item,
last. A terminal is a chunk with a ``finish_reason`` (one of ``FinishReason.ALL``) or a typed
``DynamoError`` the stream raises (the document's ``Err(DynamoError)``); nothing may follow it.
The worker wraps engine streams with it in debug mode; the conformance kit
(``dynamo_zmq.testing``) and the tests wrap every engine stream with it. Its errors are
``ConformanceError``s, the base of the kit's typed failures.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator, AsyncIterator

from ..errors import DynamoError
from ._messages import FinishReason, LLMEngineOutput

__all__ = [
    "BadFinishReason",
    "ChunkAfterTerminal",
    "ConformanceError",
    "MultipleTerminals",
    "NoTerminalChunk",
    "NotAStream",
    "NotAnOutput",
    "StreamContractError",
    "validate_stream",
]


class ConformanceError(AssertionError):
    """Base of every conformance failure; the message says what the engine did."""

    #: The ``run_conformance`` check that failed (``None`` outside the kit, e.g. raised by
    #: ``validate_stream`` in a test of one's own).
    check: str | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class StreamContractError(ConformanceError):
    """A ``generate`` stream broke the stream contract."""


class NotAStream(StreamContractError):
    """``generate`` returned something that is not an async iterator."""


class NotAnOutput(StreamContractError):
    """The stream yielded something other than an ``LLMEngineOutput``."""


class NoTerminalChunk(StreamContractError):
    """The stream ended, or stopped producing, without a terminal (the document's
    ``NoTerminalChunk``)."""


class ChunkAfterTerminal(StreamContractError):
    """Something followed the terminal (the document's ``ChunkAfterTerminal``)."""


class MultipleTerminals(ChunkAfterTerminal):
    """What followed the terminal was a second terminal: a chunk with a ``finish_reason``, or
    a typed ``DynamoError``."""


class BadFinishReason(StreamContractError):
    """A chunk carried a ``finish_reason`` outside ``FinishReason.ALL``."""


def _describe(chunk: object) -> str:
    text = repr(chunk)
    return text if len(text) <= 200 else text[:197] + "..."


async def validate_stream(
    stream: AsyncIterator[LLMEngineOutput],
) -> AsyncGenerator[LLMEngineOutput, None]:
    """Pass the chunks of ``stream`` through, raising when it breaks the stream contract.

    Read the wrapper to its end to catch chunks after the terminal; closing the wrapper closes
    ``stream``. A typed ``DynamoError`` the stream raises before its terminal chunk is its
    terminal and passes through unchanged, as does any other exception (an engine crash).

    Args:
        stream: what ``engine.generate(request, ctx)`` returned.

    Raises:
        NotAStream: ``stream`` is not an async iterator (e.g. a coroutine).
        NotAnOutput: the stream yielded something other than ``LLMEngineOutput``.
        BadFinishReason: a ``finish_reason`` outside ``FinishReason.ALL``.
        ChunkAfterTerminal: a non-terminal chunk came after the terminal.
        MultipleTerminals: a second terminal chunk, or a typed error, came after the terminal.
        NoTerminalChunk: the stream ended without a terminal.
        DynamoError: the stream's own typed terminal error.
    """
    if not isinstance(stream, AsyncIterator):
        if inspect.iscoroutine(stream):
            stream.close()
        raise NotAStream(
            f"generate returned {type(stream).__name__}, not an async iterator "
            "(define it as `async def generate(...)` that yields)"
        )
    terminal: tuple[int, LLMEngineOutput] | None = None
    index = 0
    try:
        try:
            async for chunk in stream:
                if not isinstance(chunk, LLMEngineOutput):
                    raise NotAnOutput(
                        f"chunk {index} is {type(chunk).__name__}, not LLMEngineOutput: "
                        f"{_describe(chunk)}"
                    )
                if terminal is not None:
                    where = _after(terminal)
                    if chunk.is_terminal:
                        raise MultipleTerminals(
                            f"chunk {index} is a second terminal {where}: {_describe(chunk)}"
                        )
                    raise ChunkAfterTerminal(f"chunk {index} came {where}: {_describe(chunk)}")
                if chunk.is_terminal:
                    if chunk.finish_reason not in FinishReason.ALL:
                        raise BadFinishReason(
                            f"chunk {index} has finish_reason={chunk.finish_reason!r}; "
                            f"expected one of {sorted(FinishReason.ALL)}"
                        )
                    terminal = (index, chunk)
                yield chunk
                index += 1
        except DynamoError as exc:
            if terminal is None:
                raise  # the typed terminal of a stream that ended in error
            raise MultipleTerminals(
                f"the stream raised {exc!r} (a second terminal) {_after(terminal)}"
            ) from exc
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
    if terminal is None:
        raise NoTerminalChunk(f"the stream ended after {index} chunk(s) without a terminal chunk")


def _after(terminal: tuple[int, LLMEngineOutput]) -> str:
    index, chunk = terminal
    return f"after the terminal chunk {index} (finish_reason={chunk.finish_reason!r})"
