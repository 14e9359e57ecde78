"""The stream contract of ``LLMEngine.generate``, checked chunk by chunk.

``validate_stream`` wraps one ``generate`` stream and raises as soon as it breaks the contract
(every chunk an ``LLMEngineOutput``, exactly one terminal chunk, last, with a known
``finish_reason``). The worker wraps engine streams with it in debug mode; the conformance kit
(``dynamo_zmq.testing``) and the tests wrap every engine stream with it. Its errors are
``ConformanceError``s, the base of the kit's typed failures.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator, AsyncIterator

from ._engine import FinishReason, LLMEngineOutput

__all__ = [
    "BadFinishReason",
    "ChunkAfterTerminal",
    "ConformanceError",
    "MultipleTerminals",
    "NoTerminal",
    "NotAStream",
    "NotAnOutput",
    "StreamContractError",
    "validate_stream",
]


class ConformanceError(AssertionError):
    """Base of every conformance failure; the message says what the engine did."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class StreamContractError(ConformanceError):
    """A ``generate`` stream broke the stream contract."""


class NotAStream(StreamContractError):
    """``generate`` returned something that is not an async iterator."""


class NotAnOutput(StreamContractError):
    """The stream yielded something other than an ``LLMEngineOutput``."""


class NoTerminal(StreamContractError):
    """The stream ended, or stopped producing, without a terminal chunk."""


class ChunkAfterTerminal(StreamContractError):
    """A non-terminal chunk followed the terminal chunk."""


class MultipleTerminals(StreamContractError):
    """A second terminal chunk followed the terminal chunk."""


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
    ``stream``.

    Args:
        stream: what ``engine.generate(request, ctx)`` returned.

    Raises:
        NotAStream: ``stream`` is not an async iterator (e.g. a coroutine).
        NotAnOutput: the stream yielded something other than ``LLMEngineOutput``.
        BadFinishReason: a ``finish_reason`` outside ``FinishReason.ALL``.
        ChunkAfterTerminal: a non-terminal chunk came after the terminal.
        MultipleTerminals: a second terminal came after the terminal.
        NoTerminal: the stream ended without a terminal chunk.
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
        async for chunk in stream:
            if not isinstance(chunk, LLMEngineOutput):
                raise NotAnOutput(
                    f"chunk {index} is {type(chunk).__name__}, not LLMEngineOutput: "
                    f"{_describe(chunk)}"
                )
            if terminal is not None:
                first, last = terminal
                where = f"after the terminal chunk {first} (finish_reason={last.finish_reason!r})"
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
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
    if terminal is None:
        raise NoTerminal(f"the stream ended after {index} chunk(s) without a terminal chunk")
