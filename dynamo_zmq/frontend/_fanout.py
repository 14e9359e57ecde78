"""A generation request's output side: its sequences sent, read and answered as OpenAI SSE
chunks (streaming) or one JSON body (not), with the frontend's token metrics.

Every chat and completion request comes here as a list of sub-requests (``_subrequests.py``):
a plain request is one (its ``PreprocessedRequest`` as preprocessing made it), and a request
of several sequences (``n > 1``, ``best_of``, a batch of prompts, ``echo``) one per sequence
(``sampling.n = 1``), each routed on its own (so KV routing sends each where its prompt is
cached) under a child of the request's context: a client that goes away, or the deadline, kills
them all. With a ``seed``, sequence ``j`` of a prompt uses ``seed + j``. Each sub-request's
outputs are pulled by a ``SubStream`` (with its own migration): by a task of its own when there
are several, merged by the request's loop into one response, choice ``j`` of prompt ``p`` being
index ``p * n + j`` (OpenAI's rule); a single one is read by the request's loop itself (no task,
no queue: the common case pays nothing for the others). ``best_of > n`` keeps, per prompt, the
``n`` sequences with the highest cumulative log-probability of their sampled tokens (the
engine's ``LLMEngineOutput.log_probs``). Usage counts each prompt once and every generated
token. Logprobs, when asked for, are written per choice (``ChoiceLogprobs``), and so are the
reasoning and tool calls the worker parsed (chat). The outputs arrive decoded (the worker made
their text); what arrived together is written in one send, a choice's content (and logprobs) as
one multi-token event, as vLLM's server does when the client is behind: nothing waits for more.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from .. import errors
from ..context import Context
from ..llm import (
    FinishReason,
    LLMEngineOutput,
    Migration,
    ModelRouter,
    PreprocessedRequest,
    RouteOptions,
)
from ..resources import Resources
from . import errors as http_errors
from ._asgi import JSON, SSE, ClientGone, Send, error, reply, send_message
from ._logprobs import ChoiceLogprobs
from ._sse_chunks import (
    Failed,
    SseChunks,
    gathered_logprobs,
    take_logprobs,
    take_prompt_logprobs,
)
from ._sub_stream import SubStream
from ._subrequests import SubRequest, best_choices
from .errors import HttpError
from .metrics import FrontendMetrics
from .responses import (
    DONE,
    ChatFormatter,
    CompletionFormatter,
    add_tool_call,
    openai_finish_reason,
    sse_error,
)

__all__ = ["FanOut"]

#: What a sub-request's reader hands the merge loop: outputs, the error that ended it, or
#: None when its stream was cancelled (the client went away, or the deadline passed).
_Event = tuple["SubRequest", "list[LLMEngineOutput] | HttpError | None"]


class FanOut:
    """The sub-requests of one request (one, or one per sequence): sends them, merges their
    outputs (streamed or aggregated).

    Args:
        metrics / model: the frontend's metrics and the model's label.
        fmt: the chat or completion formatter.
        subs: the sub-requests (``fan_out``).
        n: choices per prompt (``best_of`` is ``len(subs) // prompts``).
        prompt_tokens: the prompts' tokens, each prompt counted once (usage).
        started: when the request arrived (``time.monotonic()``).
        ending: why the frontend itself ended the request (``RequestScope.ending``: its
            deadline's 504, the shutdown's 503), or None.
        migration: a sub-request's migration (None: off).
    """

    def __init__(
        self,
        metrics: FrontendMetrics,
        model: str,
        fmt: ChatFormatter | CompletionFormatter,
        subs: list[SubRequest],
        n: int,
        prompt_tokens: int,
        started: float,
        ending: Callable[[], HttpError | None],
        migration: Callable[[PreprocessedRequest], Migration | None],
    ) -> None:
        self.metrics, self.model, self.fmt = metrics, model, fmt
        self.subs = subs
        self.n = n
        self.best_of = sum(1 for s in subs if s.prompt == 0)
        self.prompt_tokens = prompt_tokens
        self.started = started
        self._ending = ending
        self._migration = migration
        self._children: list[Context] = []
        self._readers: list[SubStream] = []
        #: The readers' tasks and what they hand the merge loop (several sub-requests only).
        self._queue: asyncio.Queue[_Event] | None = None
        self._resources: Resources | None = None
        self.completion_tokens = 0
        self.first = True
        #: Seconds from arrival to the first token (None: none came).
        self.ttft: float | None = None
        #: Outputs carry the worker's reasoning and tool-call parsing (chat only).
        pre = subs[0].pre
        self.parsed = isinstance(fmt, ChatFormatter) and (pre.tools is not None or pre.reasoning)

    # -- sending ---------------------------------------------------------------------------

    async def open(
        self, router: ModelRouter, ctx: Context, options: RouteOptions
    ) -> HttpError | None:
        """Send every sub-request; the error the client gets if one cannot be sent (the others
        are killed then).

        Raises:
            ClientGone: the client went away while they were being sent.
        """
        if len(self.subs) == 1:  # the request's own context: nothing else to kill
            contexts = [ctx]
        else:
            contexts = self._children = [
                Context(f"{ctx.id()}-{s.prompt}-{s.number}") for s in self.subs
            ]
            for child in contexts:
                ctx.link_child(child)
        results = await asyncio.gather(
            *(
                router.generate(s.pre, child, options)
                for s, child in zip(self.subs, contexts, strict=True)
            ),
            return_exceptions=True,
        )
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            self.kill()
            if not isinstance(failure, errors.DynamoError):
                raise failure
            if (why := self._ending()) is not None:
                return why
            if ctx.is_killed():
                raise ClientGone from None
            return http_errors.from_dynamo(failure)
        top = self.fmt.logprobs
        for sub, stream in zip(self.subs, results, strict=True):
            assert not isinstance(stream, BaseException)
            if top is not None:
                sub.logprobs = ChoiceLogprobs(top)
            self._readers.append(SubStream(sub, stream, self._migration(sub.pre)))
        return None

    def served_by(self) -> bytes:
        """The instances serving the sub-requests (``x-dynamo-worker``: ``<instance>`` or
        ``<instance>/<dp rank>``), comma-separated."""
        ids = dict.fromkeys(r.served_by() for r in self._readers)
        return ",".join(ids).encode()

    def kill(self) -> None:
        """Kill every sub-request that has not finished (a single one needs nothing: it runs
        under the request's own context, which the request scope kills)."""
        for sub, child in zip(self.subs, self._children, strict=False):
            if sub.finish is None:
                child.kill()

    async def close(self) -> None:
        self.kill()
        if self._resources is not None:
            await self._resources.close()

    def _start_readers(self) -> None:
        """With several sub-requests: a task each that hands its reader's batches to the
        merge loop (one is read by the loop itself, ``_next``)."""
        if len(self._readers) > 1:
            queue: asyncio.Queue[_Event] = asyncio.Queue()
            resources = Resources(f"fanout-{self.fmt.id}")
            self._queue, self._resources = queue, resources
            for reader in self._readers:
                sub = reader.sub
                resources.spawn(self._pump(reader, queue), f"fanout-{sub.prompt}-{sub.number}")

    @staticmethod
    async def _pump(reader: SubStream, queue: asyncio.Queue[_Event]) -> None:
        put = queue.put_nowait
        while True:
            item = await reader.next()
            put((reader.sub, item))
            if not isinstance(item, list) or item[-1].finish_reason is not None:
                return

    # -- merging ---------------------------------------------------------------------------

    def _account(self, sub: SubRequest, outs: list[LLMEngineOutput]) -> None:
        """Count a batch of ``sub``'s outputs: tokens, TTFT or inter-token latency (one
        observation per batch: its gap over its tokens), score and the worker's usage."""
        n = 0
        for out in outs:
            if out.token_ids:
                n += len(out.token_ids)
                if out.log_probs:
                    sub.score += sum(out.log_probs)
            if out.usage is not None:
                sub.usage_tokens = out.usage.completion_tokens
                sub.cached = out.usage.cached_tokens
        if n:
            now = time.monotonic()
            ttft, itl = self.metrics.token_metrics(self.model)
            if self.first:
                self.ttft = now - self.started
                ttft.observe(self.ttft)
                self.first = False
            elif sub.last:
                itl.observe((now - sub.last) / n)
            sub.last = now
            sub.tokens += n
            self.completion_tokens += n

    async def _next(self) -> list[_Event]:
        """What the readers have: at least one event, all that are there."""
        queue = self._queue
        if queue is None:
            reader = self._readers[0]
            return [(reader.sub, await reader.next())]
        events = [await queue.get()]
        while not queue.empty():
            events.append(queue.get_nowait())
        return events

    def _failure(self, item: HttpError | None) -> HttpError:
        # Past the deadline, whatever ended the stream (the worker's own ResponseTimeout may
        # come before the frontend's timer has run) the client gets the deadline's 504; at
        # shutdown, the retryable 503.
        if (why := self._ending()) is not None:
            return why
        if item is None:
            raise ClientGone from None
        return item

    def _usage(self) -> tuple[int, int, int | None]:
        completion = sum(s.completion_tokens for s in self.subs)
        cached = [s.cached for s in self.subs if s.number == 0 and s.cached is not None]
        self.metrics.osl.labels(self.model).observe(completion)
        return self.prompt_tokens, completion, sum(cached) if cached else None

    async def batches(self) -> AsyncIterator[list[LLMEngineOutput]]:
        """A single sub-request's outputs, a batch at a time, counted (metrics, usage), up to
        the batch with its finish (``/v1/responses`` writes them its own way).

        Raises:
            Failed: the error that ended it.
        """
        (sub,) = self.subs
        while True:
            ((_, item),) = await self._next()
            if not isinstance(item, list):
                raise Failed(self._failure(item))
            self._account(sub, item)
            yield item
            if item[-1].finish_reason is not None:
                sub.finish = item[-1].finish_reason
                return

    def usage(self) -> tuple[int, int, int | None]:
        """Prompt, completion and cached tokens (observes the output length)."""
        return self._usage()

    async def stream_sse(self, send: Send, headers: list[tuple[bytes, bytes]],
                         include_usage: bool) -> str:
        """Write every choice's outputs as SSE chunks, interleaved as they come (each chunk's
        ``choices[0].index`` names its choice); returns the status for the metrics."""
        fmt = self.fmt
        continuous = fmt.continuous_usage
        chunks = SseChunks(fmt, self.prompt_tokens, self.parsed)
        self._start_readers()
        await send_message(send, {"type": "http.response.start", "status": 200,
                                  "headers": SSE + headers})
        parts: list[bytes] = []
        for sub in self.subs:
            head = fmt.role_chunk(sub.index)
            if sub.echo and sub.logprobs is None:  # with logprobs: with the first output
                head += fmt.content_chunk_at(sub.index, sub.echo)
                sub.echo_sent = True
            if head and continuous:
                head = fmt.with_usage(head, self.prompt_tokens, 0)
            if head:
                parts.append(head)
        pending = len(self.subs)
        try:
            while pending:
                for sub, item in await self._next():
                    if not isinstance(item, list):
                        raise Failed(self._failure(item))
                    self._account(sub, item)
                    if chunks.batch(sub, item, parts, self.completion_tokens):
                        pending -= 1
                if pending:
                    await send_message(send, {"type": "http.response.body",
                                              "body": b"".join(parts), "more_body": True})
                    parts = []
        except Failed as failed:
            parts += [sse_error(failed.error.to_json()), DONE]
            await send_message(send, {"type": "http.response.body", "body": b"".join(parts),
                                      "more_body": False})
            return "error"
        prompt, completion, cached = self._usage()
        if include_usage:
            parts.append(fmt.usage_chunk(prompt, completion, cached))
        parts.append(DONE)
        await send_message(send, {"type": "http.response.body", "body": b"".join(parts),
                                  "more_body": False})
        return "success"

    async def respond_once(self, send: Send, headers: list[tuple[bytes, bytes]]) -> str:
        """Gather every choice into one JSON response (``best_of``: the best ``n`` per prompt);
        returns the status for the metrics."""
        self._start_readers()
        pending = len(self.subs)
        try:
            while pending:
                for sub, item in await self._next():
                    if not isinstance(item, list):
                        raise Failed(self._failure(item))
                    self._account(sub, item)
                    for out in item:
                        sub.texts.append(out.text or "")
                        if out.prompt_logprobs is not None:
                            take_prompt_logprobs(sub, out)
                        if sub.logprobs is not None:
                            take_logprobs(self.fmt, sub, out)
                        if out.reasoning:
                            sub.thoughts.append(out.reasoning)
                        for delta in out.tool_calls or ():
                            add_tool_call(sub.calls, delta)
                        if out.finish_reason is not None:
                            if out.finish_reason == FinishReason.ERROR:
                                raise Failed(http_errors.engine_error(out.error or "engine error"))
                            sub.finish, sub.stop_reason = out.finish_reason, out.stop_reason
                            pending -= 1
                            break
        except Failed as failed:
            await error(send, failed.error)
            return "error"
        fmt = self.fmt
        chosen = sorted(best_choices(self.subs, self.n, self.best_of), key=lambda s: s.index)
        choices = [
            fmt.choice(
                s.index, s.echo + "".join(s.texts),
                openai_finish_reason(s.finish or FinishReason.STOP), s.stop_reason,
                gathered_logprobs(fmt, s),
                reasoning="".join(s.thoughts) if s.thoughts else None,
                tool_calls=[s.calls[i] for i in sorted(s.calls)] or None,
            )
            for s in chosen
        ]
        extra = None
        if self.subs[0].pre.output.prompt_logprobs is not None:  # vLLM's places for them
            if isinstance(fmt, ChatFormatter):
                extra = {"prompt_logprobs": self.subs[0].prompt_logprobs}
            else:
                for choice, s in zip(choices, chosen, strict=True):
                    choice["prompt_logprobs"] = s.prompt_logprobs
        prompt, completion, cached = self._usage()
        await reply(send, 200, fmt.full_choices(choices, prompt, completion, cached, extra),
                    JSON + headers)
        return "success"
