"""Small third-party-style engines, loaded with ``--engine tests.support.engines:NAME``:
``EchoEngine``, and test engines built on it (and on the mocker) that record their lifecycle,
fail to start, crash mid-request or stall the event loop, for the worker's lifecycle and error
tests, a mocker whose health a test breaks from outside (``FlakyMocker``), one whose engine
stops producing while its process lives (``StopsProducingMocker``), one whose requests
end with ``EngineShutdown`` part-way (``ShuttingDownMocker``), an echo engine with
deterministic log-probabilities (``ScoredEchoEngine``, for ``best_of``), and one that emits
scripted text token by token (``ScriptedEngine``, for the worker's tool-call and reasoning
parsing), and one that ends on a stop by raising ``CancelledError`` as the cancellation
document's handler does (``DocumentStopPatternEngine``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import time
from pathlib import Path

from tokenizers import Tokenizer

from dynamo_zmq.context import Context
from dynamo_zmq.errors import EngineShutdown
from dynamo_zmq.llm import (
    Capability,
    EngineConfig,
    LLMEngine,
    LLMEngineOutput,
    PreprocessedRequest,
    Usage,
    error_output,
)
from engines.mocker import MockerConfig, MockerEngine
from engines.mocker._config import config_from_args
from engines.mocker._kv_events import KvEvent


class EchoEngine(LLMEngine):
    """Streams the prompt's tokens back, one per chunk, ``--echo-delay`` seconds apart, and ends
    with ``--echo-finish`` (``length`` by default; ``stop`` carries the last token in the
    terminal chunk, as engines report the token that stopped them). The worker's health canary
    always gets ``length``: an engine that fails every canary would leave routing."""

    name = "echo"

    def __init__(self, delay: float = 0.0, events: str | None = None, replay: str | None = None,
                 dp_size: int = 1, finish: str = "length") -> None:
        self.delay = delay
        self.events, self.replay, self.dp_size = events, replay, dp_size
        self.finish = finish
        self.aborted: list[str] = []
        self.first_delay = 0.0

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        parser.add_argument("--echo-delay", type=float, default=0.0)
        # Advertised only (the echo engine publishes and answers nothing there).
        parser.add_argument("--echo-kv-events-endpoint", default=None)
        parser.add_argument("--echo-kv-replay-endpoint", default=None)
        parser.add_argument("--echo-data-parallel-size", type=int, default=1)
        parser.add_argument("--echo-finish", default="length",
                            choices=["length", "stop", "cancelled", "error"])
        # Seconds before the first token (a long prefill), health canaries excepted.
        parser.add_argument("--echo-first-delay", type=float, default=0.0)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> EchoEngine:
        engine = cls(args.echo_delay, args.echo_kv_events_endpoint, args.echo_kv_replay_endpoint,
                     args.echo_data_parallel_size, args.echo_finish)
        engine.configure(args)
        return engine

    def configure(self, args: argparse.Namespace) -> None:
        """Test engines below read their own flags here."""
        self.first_delay = args.echo_first_delay

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model_name="echo", context_length=4096, kv_block_size=16,
                            kv_events_endpoint=self.events, kv_replay_endpoint=self.replay,
                            data_parallel_size=self.dp_size)

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        limit = request.stop.max_tokens or len(request.token_ids)
        tokens = (request.token_ids * (limit // max(1, len(request.token_ids)) + 1))[:limit]
        last: list[int] = []
        finish = "length" if ctx.id().startswith("health-") else self.finish
        if finish == "stop":
            tokens, last = tokens[:-1], tokens[-1:]
        if self.first_delay and not ctx.id().startswith("health-"):
            await asyncio.sleep(self.first_delay)
        for i, tok in enumerate(tokens):
            if ctx.is_stopped():
                yield LLMEngineOutput(
                    finish_reason="cancelled", usage=Usage(len(request.token_ids), i)
                )
                return
            yield LLMEngineOutput([tok])
            if self.delay:
                await asyncio.sleep(self.delay)
        yield LLMEngineOutput(
            last, finish_reason=finish,
            usage=Usage(len(request.token_ids), len(tokens) + len(last)),
            error="the echo engine fails on purpose" if finish == "error" else None,
        )

    async def abort(self, ctx: Context) -> None:
        self.aborted.append(ctx.id())

    async def cleanup(self) -> None:
        pass


# -- test engines (the worker's lifecycle and error taxonomy) ---------------------------------

lifecycle_log = logging.getLogger("tests.lifecycle")


class LifecycleTestEngine(EchoEngine):
    """Test engine: logs ``LIFECYCLE <event>`` lines (to the worker's stderr, in order with the
    worker's own log) for start, each request's end, drain and abort (with the requests in
    flight then) and cleanup."""

    name = "lifecycle"

    def configure(self, args: argparse.Namespace) -> None:
        self.inflight = 0

    async def start(self, worker_id: int) -> EngineConfig:
        lifecycle_log.info("LIFECYCLE start")
        return await super().start(worker_id)

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        self.inflight += 1
        try:
            async for out in super().generate(request, ctx):
                yield out
        finally:
            self.inflight -= 1
            if not ctx.id().startswith("health-"):
                lifecycle_log.info("LIFECYCLE end inflight=%d", self.inflight)

    async def drain(self) -> None:
        lifecycle_log.info("LIFECYCLE drain inflight=%d", self.inflight)

    async def abort(self, ctx: Context) -> None:
        lifecycle_log.info("LIFECYCLE abort inflight=%d", self.inflight)
        await super().abort(ctx)

    async def cleanup(self) -> None:
        lifecycle_log.info("LIFECYCLE cleanup inflight=%d", self.inflight)


class FailingStartTestEngine(EchoEngine):
    """Test engine whose ``start`` fails as a real one does when its device is missing."""

    name = "failing-start"

    async def start(self, worker_id: int) -> EngineConfig:
        raise RuntimeError("no accelerator found (test engine)")


class CrashingTestEngine(EchoEngine):
    """Test engine that crashes mid-request: after ``--crash-after`` tokens it declares itself
    dead (``dead_reason``) and ``generate`` raises a plain exception. A prompt holding
    ``--bug-token`` raises while the engine stays alive (an ordinary bug, not a crash)."""

    name = "crashing"

    def configure(self, args: argparse.Namespace) -> None:
        self.crash_after: int | None = args.crash_after
        self.bug_token: int | None = args.bug_token
        self.dead: str | None = None

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        super().add_args(parser)
        parser.add_argument("--crash-after", type=int, default=None)
        parser.add_argument("--bug-token", type=int, default=None)

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        if self.bug_token is not None and self.bug_token in request.token_ids:
            raise ValueError("a bug in the test engine")
        sent = 0
        async for out in super().generate(request, ctx):
            if self.dead is not None or (
                self.crash_after is not None and sent >= self.crash_after
                and not ctx.id().startswith("health-")
            ):
                self.dead = "the test engine's core process is gone"
                raise ConnectionResetError("engine core connection lost")
            sent += len(out.token_ids)
            yield out

    def dead_reason(self) -> str | None:
        return self.dead


class CrashingMockerTestEngine(MockerEngine):
    """Test engine: the real mocker whose KV-event publishing fails at the
    ``--crash-at-publish``-th batch, which kills the rank's scheduler task (a mocker crash)."""

    name = "crashing-mocker"

    def __init__(self, config: MockerConfig, crash_at: int) -> None:
        super().__init__(config)
        self.crash_at = crash_at
        self.published = 0

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        super().add_args(parser)
        parser.add_argument("--crash-at-publish", type=int, default=1)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> CrashingMockerTestEngine:
        return cls(config_from_args(args), args.crash_at_publish)

    def _publish(self, events: list[KvEvent], dp_rank: int) -> None:
        self.published += 1
        if self.published >= self.crash_at:
            raise OSError("simulated failure of the KV-event socket")
        super()._publish(events, dp_rank)


class NativeEchoTestEngine(EchoEngine):
    """Test engine that supports native processing: it reports the flag in its config."""

    name = "native-echo"
    supports_native_processing = True

    def configure(self, args: argparse.Namespace) -> None:
        self.native_processing = bool(args.native_processing)

    async def start(self, worker_id: int) -> EngineConfig:
        config = await super().start(worker_id)
        config.extra["native_processing"] = self.native_processing
        return config


class FlakyMocker(MockerEngine):
    """TEST ONLY: the mocker, broken from outside while ``--flaky-file PATH`` exists: every
    request (the health canary's too) then ends with ``finish_reason="error"``; removing the
    file repairs it."""

    name = "flaky-mocker"

    def __init__(self, config: MockerConfig, flaky_file: str) -> None:
        super().__init__(config)
        self.flaky_file = Path(flaky_file)

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        super().add_args(parser)
        parser.add_argument("--flaky-file", required=True, help="broken while this file exists")

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> FlakyMocker:
        return cls(config_from_args(args), args.flaky_file)

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        if self.flaky_file.exists():
            yield error_output("broken by the test switch", Usage(len(request.token_ids)))
            return
        async for out in super().generate(request, ctx):
            yield out


class StallingTestEngine(EchoEngine):
    """``EchoEngine`` whose first request blocks the worker's event loop for ``--stall-for``
    seconds after ``--stall-after`` tokens (a stuck loop: ZMQ's I/O thread still answers the
    connection's heartbeats, but no ping is answered), once per process."""

    def configure(self, args: argparse.Namespace) -> None:
        self.stall_after: int = args.stall_after
        self.stall_for: float = args.stall_for
        self.stalled = False

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        super().add_args(parser)
        parser.add_argument("--stall-after", type=int, default=5)
        parser.add_argument("--stall-for", type=float, default=4.0)

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        sent = 0
        async for out in super().generate(request, ctx):
            yield out
            sent += len(out.token_ids)
            if self.stalled or sent < self.stall_after or ctx.id().startswith("health-"):
                continue
            self.stalled = True
            time.sleep(self.stall_for)  # noqa: ASYNC251 (blocks the whole event loop on purpose)


class StopsProducingMocker(MockerEngine):
    """TEST ONLY: the mocker, whose engine stops producing for good once it has streamed
    ``--stop-producing-after`` tokens in all (health canaries not counted): every request, a
    canary's too, then waits for ever at its next output, while the process, its event loop and
    its connections live on (a stuck kernel, a deadlock: liveness sees nothing wrong)."""

    name = "stops-producing-mocker"

    def __init__(self, config: MockerConfig, after: int) -> None:
        super().__init__(config)
        self.after = after
        self.streamed = 0

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        super().add_args(parser)
        parser.add_argument("--stop-producing-after", type=int, default=20)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> StopsProducingMocker:
        return cls(config_from_args(args), args.stop_producing_after)

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        canary = ctx.id().startswith("health-")
        async for out in super().generate(request, ctx):
            if self.streamed >= self.after:
                await asyncio.Event().wait()  # never set: stuck (cancellable, as a task is)
            if not canary:
                self.streamed += len(out.token_ids)
            yield out


class ShuttingDownMocker(MockerEngine):
    """TEST ONLY: the mocker, whose requests end with ``EngineShutdown`` (retryable: the
    engine is going away) after ``--shutdown-after`` tokens, as a worker that cannot finish a
    stream before it stops; a migrated request (``request.resume``) is served in full."""

    name = "shutting-down-mocker"

    def __init__(self, config: MockerConfig, after: int) -> None:
        super().__init__(config)
        self.after = after

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        super().add_args(parser)
        parser.add_argument("--shutdown-after", type=int, default=10)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ShuttingDownMocker:
        return cls(config_from_args(args), args.shutdown_after)

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        sent = 0
        async for out in super().generate(request, ctx):
            if sent >= self.after and request.resume is None and not ctx.id().startswith("health-"):
                raise EngineShutdown("the test engine is shutting down")
            sent += len(out.token_ids)
            yield out


class ScoredEchoEngine(EchoEngine):
    """Test engine with ``Capability.LOGPROBS`` and deterministic scores (for ``best_of``): it
    streams ``max_tokens`` of the prompt's tokens, cyclically from offset ``seed % len(prompt)``,
    and, when the request asks for log-probabilities (``output.logprobs`` set), gives every
    token the log-probability ``-((seed * 37) % 11 + 1) / 10`` (``token_logprob``)."""

    name = "scored-echo"

    def capabilities(self) -> frozenset[str]:
        return frozenset({Capability.LOGPROBS})

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        prompt = request.token_ids
        seed = request.sampling.seed or 0
        limit = request.stop.max_tokens or len(prompt)
        start = seed % len(prompt)
        tokens = [prompt[(start + i) % len(prompt)] for i in range(limit)]
        want = request.output.logprobs is not None
        for tok in tokens[:-1]:
            yield LLMEngineOutput([tok], log_probs=[token_logprob(seed)] if want else None)
        yield LLMEngineOutput(
            tokens[-1:], finish_reason="length", usage=Usage(len(prompt), len(tokens)),
            log_probs=[token_logprob(seed)] if want else None,
        )


def token_logprob(seed: int) -> float:
    """The log-probability ``ScoredEchoEngine`` gives each token of a sequence seeded ``seed``."""
    return -((seed * 37) % 11 + 1) / 10


class ScriptedEngine(LLMEngine):
    """Emits a script, tokenized with the model's tokenizer, one token per chunk, so the
    worker's real detokenizer and parsers see it as a model's output. ``--script-file`` is a
    JSON object of named scripts; a request gets the one its prompt names last as
    ``script=NAME`` (else ``default``). The script ends with the model's end-of-sequence token
    (``stop``), or ``length`` where ``max_tokens`` cuts it short. ``--scripted-structured``
    declares structured outputs (the scripts are what a constrained model would write);
    ``--script-delay`` sleeps that many seconds after each token. A migrated request
    (``resume``) goes on with the script after the tokens already generated."""

    name = "scripted"

    def __init__(self, model_path: str, scripts: dict[str, str], structured: bool = False,
                 delay: float = 0.0) -> None:
        tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
        self.tokenizer = tokenizer
        self.scripts = {
            key: tokenizer.encode(text, add_special_tokens=False).ids
            for key, text in scripts.items()
        }
        self.structured = structured
        self.delay = delay

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        parser.add_argument("--script-file", required=True)
        parser.add_argument("--scripted-structured", action="store_true")
        parser.add_argument("--script-delay", type=float, default=0.0)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ScriptedEngine:
        scripts = json.loads(Path(args.script_file).read_text(encoding="utf-8"))
        return cls(args.model_path, scripts, args.scripted_structured, args.script_delay)

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model_name="scripted", context_length=4096, kv_block_size=16)

    def capabilities(self) -> frozenset[str]:
        return frozenset({Capability.STRUCTURED_OUTPUTS} if self.structured else ())

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        done = request.resume.generated if request.resume is not None else 0
        prompt = self.tokenizer.decode(request.token_ids[: len(request.token_ids) - done])
        names = re.findall(r"script=(\w+)", prompt)
        ids = self.scripts[names[-1] if names else "default"][done:]
        limit = request.stop.max_tokens or len(ids)
        for tok in ids[:limit - 1] if limit < len(ids) else ids:
            yield LLMEngineOutput([tok])
            await asyncio.sleep(self.delay)
        usage = Usage(len(request.token_ids), min(limit, len(ids) + 1))
        if limit < len(ids):
            yield LLMEngineOutput([ids[limit - 1]], finish_reason="length", usage=usage)
        else:
            yield LLMEngineOutput(request.eos_token_ids[:1], finish_reason="stop", usage=usage)

    async def cleanup(self) -> None:
        pass


class DocumentStopPatternEngine(EchoEngine):
    """Echo, but ends on a stop the way the cancellation document's handler does:
    ``if context.is_stopped(): raise asyncio.CancelledError`` between outputs."""

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        for tok in request.token_ids * 100:
            if ctx.is_stopped():
                raise asyncio.CancelledError
            yield LLMEngineOutput([tok])
            await asyncio.sleep(self.delay or 0.02)
        yield LLMEngineOutput([], finish_reason="length")


class SpanningMocker(MockerEngine):
    """TEST ONLY: the mocker, opening a span of its own (``engine_span``, named at run time)
    around each request's first output, as an engine instrumenting itself would."""

    name = "spanning-mocker"

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        from dynamo_zmq.tracing import engine_span

        stream = super().generate(request, ctx)
        with engine_span(f"engine.first_output_{len(request.token_ids)}", blocks=8) as span:
            first = await stream.__anext__()
            if span is not None:
                span.set_attribute("first_tokens", len(first.token_ids))
        yield first
        async for out in stream:
            yield out
