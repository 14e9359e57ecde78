"""Engines for tests, loaded with ``--engine tests.support.engines:CLASS``: a small
third-party-style engine (``EchoEngine``) and a mocker whose health a test breaks from outside
(``FlakyMocker``)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from dynamo_zmq.context import Context
from dynamo_zmq.llm import (
    EngineConfig,
    LLMEngine,
    LLMEngineOutput,
    PreprocessedRequest,
    Usage,
    error_output,
)
from engines.mocker import MockerEngine
from engines.mocker._config import MockerConfig, config_from_args


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
    def from_args(cls, args: argparse.Namespace) -> EchoEngine:
        return cls(args.echo_delay, args.echo_kv_events_endpoint, args.echo_kv_replay_endpoint,
                   args.echo_data_parallel_size)

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
    def from_args(cls, args: argparse.Namespace) -> FlakyMocker:
        return cls(config_from_args(args), args.flaky_file)

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        if self.flaky_file.exists():
            yield error_output("broken by the test switch", Usage(len(request.token_ids)))
            return
        async for out in super().generate(request, ctx):
            yield out
