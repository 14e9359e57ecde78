"""Small third-party-style engines, loaded with ``--engine tests.support.engines:NAME``:
``EchoEngine``, and test engines built on it that record their lifecycle, for the worker's
lifecycle tests."""

from __future__ import annotations

import argparse
import asyncio
import logging

from dynamo_zmq.context import Context
from dynamo_zmq.llm import EngineConfig, LLMEngine, LLMEngineOutput, PreprocessedRequest, Usage


class EchoEngine(LLMEngine):
    """Streams the prompt's tokens back, one per chunk, ``--echo-delay`` seconds apart."""

    name = "echo"

    def __init__(self, delay: float = 0.0, events: str | None = None, replay: str | None = None,
                 dp_size: int = 1) -> None:
        self.delay = delay
        self.events, self.replay, self.dp_size = events, replay, dp_size
        self.aborted: list[str] = []

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        parser.add_argument("--echo-delay", type=float, default=0.0)
        # Advertised only (the echo engine publishes and answers nothing there).
        parser.add_argument("--echo-kv-events-endpoint", default=None)
        parser.add_argument("--echo-kv-replay-endpoint", default=None)
        parser.add_argument("--echo-data-parallel-size", type=int, default=1)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> EchoEngine:
        engine = cls(args.echo_delay, args.echo_kv_events_endpoint, args.echo_kv_replay_endpoint,
                     args.echo_data_parallel_size)
        engine.configure(args)
        return engine

    def configure(self, args: argparse.Namespace) -> None:
        """Test engines below read their own flags here."""

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model_name="echo", context_length=4096, kv_block_size=16,
                            kv_events_endpoint=self.events, kv_replay_endpoint=self.replay,
                            data_parallel_size=self.dp_size)

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        limit = request.stop.max_tokens or len(request.token_ids)
        tokens = (request.token_ids * (limit // max(1, len(request.token_ids)) + 1))[:limit]
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
            finish_reason="length", usage=Usage(len(request.token_ids), len(tokens))
        )

    async def abort(self, ctx: Context) -> None:
        self.aborted.append(ctx.id())

    async def cleanup(self) -> None:
        pass


# -- test engines (the worker's lifecycle) ----------------------------------------------------

lifecycle_log = logging.getLogger("tests.lifecycle")


class LifecycleTestEngine(EchoEngine):
    """Test engine: logs ``LIFECYCLE <event>`` lines (to the worker's stderr, in order with the
    worker's own log) for start, each request's end, drain (with the requests in flight then)
    and cleanup."""

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

    async def cleanup(self) -> None:
        lifecycle_log.info("LIFECYCLE cleanup inflight=%d", self.inflight)
