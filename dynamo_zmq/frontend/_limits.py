"""What the frontend refuses before doing work, and where heavy preprocessing runs.

``HttpLimits`` holds the HTTP-side limits (``--max-body-bytes``, ``--body-timeout``).
``prompt_chars`` measures the text a request would tokenize and refuses, with 413 before any
template or tokenizer runs, a prompt longer than ``Preprocessor.max_prompt_chars`` (the model's
context length times its longest vocabulary entry: no tokenization of a longer text fits).
``Offload`` runs the preprocessing of a request whose body is over ``OFFLOAD_CHARS`` bytes (no
fewer than the characters of text it holds, tools and template arguments included) in a small
thread pool, so a big prompt does not stall the event loop; smaller requests stay on the loop,
as cheap as before. ``Rejections`` counts a refused request and logs it as
one rate-limited line (never a traceback).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from ..tracing import span
from .errors import HttpError, prompt_too_long
from .protocol import ChatCompletionRequest, CompletionRequest, prompts

if TYPE_CHECKING:
    from .metrics import FrontendMetrics

__all__ = [
    "OFFLOAD_CHARS",
    "HttpLimits",
    "Offload",
    "PromptBound",
    "Rejections",
    "chat_chars",
    "prompt_chars",
    "text_chars",
]

log = logging.getLogger("dynamo_zmq.frontend")
T = TypeVar("T")

#: Requests with a body of more bytes than this are preprocessed in a thread, and texts of more
#: characters than this tokenized with the tokenizer call that releases the GIL; a thread hop
#: costs more than tokenizing a text this short on the loop (docs/benchmarks.md measures it:
#: ``DYN_PREPROCESS_OFFLOAD_BYTES=0`` sends every request through the thread pool).
def _offload_bytes(default: int = 8192) -> int:
    value = os.environ.get("DYN_PREPROCESS_OFFLOAD_BYTES")
    if value is None:
        return default
    try:
        return max(0, int(value))
    except ValueError:
        log.warning("DYN_PREPROCESS_OFFLOAD_BYTES=%r is not a number of bytes: using %d",
                    value, default)
        return default


OFFLOAD_CHARS = _offload_bytes()
#: Seconds between two log lines about refused requests (the counter counts every one).
_LOG_EVERY = 10.0


@dataclass(frozen=True)
class HttpLimits:
    """Limits on reading a request.

    Attributes:
        max_body: largest request body, in bytes (413 beyond; a larger ``Content-Length`` is
            refused before anything is read).
        body_timeout: seconds a request's body may take to arrive (408 after; None: forever).
    """

    max_body: int = 32 * 1024 * 1024
    body_timeout: float | None = 30.0


class PromptBound(Protocol):
    """The model's bounds a prompt is checked against (a ``Preprocessor`` has them)."""

    @property
    def context_length(self) -> int: ...

    @property
    def max_prompt_chars(self) -> int: ...


def text_chars(pre: PromptBound, texts: list[tuple[str, str]]) -> int:
    """The characters of ``texts`` (``(param, text)`` pairs), each checked against the model's
    prompt bound.

    Raises:
        HttpError: 413 for a text no tokenization of which fits the model's context.
    """
    bound = pre.max_prompt_chars
    total = 0
    for param, text in texts:
        size = len(text)
        if bound and size > bound:
            raise prompt_too_long(
                f"This model's maximum context length is {pre.context_length} tokens, and no "
                f"text longer than {bound} characters fits in it; the {param} has {size} "
                "characters. Please reduce its length.", param=param,
            )
        total += size
    return total


def chat_chars(pre: PromptBound, req: ChatCompletionRequest) -> int:
    """The characters of a chat request's messages (their text content), checked as a whole."""
    total = 0
    for message in req.messages:
        content = message.content
        if isinstance(content, str):
            total += len(content)
        elif content is not None:
            total += sum(len(part.text or "") for part in content)
    bound = pre.max_prompt_chars
    if bound and total > bound:
        raise prompt_too_long(
            f"This model's maximum context length is {pre.context_length} tokens, and no text "
            f"longer than {bound} characters fits in it; the messages have {total} characters. "
            "Please reduce the length of the messages.", param="messages",
        )
    return total


def prompt_chars(pre: PromptBound, req: ChatCompletionRequest | CompletionRequest) -> int:
    """The characters of text ``req`` would have tokenized (token-id prompts count none).

    Raises:
        HttpError: 413 for messages or a prompt longer than the model's prompt bound.
    """
    if isinstance(req, ChatCompletionRequest):
        return chat_chars(pre, req)
    batch = prompts(req)
    texts = [
        ("prompt" if len(batch) == 1 else f"prompt[{i}]", p)
        for i, p in enumerate(batch) if isinstance(p, str)
    ]
    return text_chars(pre, texts)


class Offload:
    """A small thread pool for CPU-heavy preprocessing (chat template, tokenization)."""

    def __init__(self, workers: int | None = None) -> None:
        self._workers = workers or min(4, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, size: int, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``: on the loop for a request body of ``size`` bytes up to
        ``OFFLOAD_CHARS``, else in the pool; under a ``preprocess`` span with tracing on."""
        offloaded = size > OFFLOAD_CHARS
        with span("preprocess", step=getattr(fn, "__name__", ""), body_bytes=size,
                  offloaded=offloaded):
            if not offloaded:
                return fn(*args)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="preprocess")
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Drop queued work and let running work finish on its own (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class Rejections:
    """Counts refused requests (``dynamo_frontend_rejected_requests_total``) and logs one line
    about them at most every ``_LOG_EVERY`` seconds, saying how many went unlogged."""

    def __init__(self, metrics: FrontendMetrics) -> None:
        self._counter = metrics.rejected
        self._last_log = -_LOG_EVERY
        self._unlogged = 0

    def note(self, endpoint: str, exc: HttpError) -> None:
        """Count ``exc``, answered to a request on ``endpoint``; log it unless one was lately."""
        self._counter.labels(endpoint, str(exc.status)).inc()
        now = time.monotonic()
        if now - self._last_log < _LOG_EVERY:
            self._unlogged += 1
            return
        more = f" (and {self._unlogged} more since the last such line)" if self._unlogged else ""
        log.info("refused a %s request: %d %s: %.200s%s", endpoint, exc.status,
                 exc.code or exc.type, exc.message, more)
        self._last_log, self._unlogged = now, 0
