"""A small third-party-style engine loaded with ``--engine tests.support.engines:EchoEngine``."""

from __future__ import annotations

import argparse
import asyncio

from dynamo_zmq.context import Context
from dynamo_zmq.llm import EngineConfig, LLMEngine, LLMEngineOutput, PreprocessedRequest, Usage


class EchoEngine(LLMEngine):
    """Streams the prompt's tokens back, one per chunk, ``--echo-delay`` seconds apart, and ends
    with ``--echo-finish`` (``length`` by default; ``stop`` carries the last token in the
    terminal chunk, as engines report the token that stopped them)."""

    name = "echo"

    def __init__(self, delay: float = 0.0, events: str | None = None, replay: str | None = None,
                 dp_size: int = 1, finish: str = "length") -> None:
        self.delay = delay
        self.events, self.replay, self.dp_size = events, replay, dp_size
        self.finish = finish
        self.aborted: list[str] = []

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        parser.add_argument("--echo-delay", type=float, default=0.0)
        # Advertised only (the echo engine publishes and answers nothing there).
        parser.add_argument("--echo-kv-events-endpoint", default=None)
        parser.add_argument("--echo-kv-replay-endpoint", default=None)
        parser.add_argument("--echo-data-parallel-size", type=int, default=1)
        parser.add_argument("--echo-finish", default="length",
                            choices=["length", "stop", "cancelled", "error"])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EchoEngine:
        return cls(args.echo_delay, args.echo_kv_events_endpoint, args.echo_kv_replay_endpoint,
                   args.echo_data_parallel_size, args.echo_finish)

    async def start(self, worker_id: int) -> EngineConfig:
        return EngineConfig(model_name="echo", context_length=4096, kv_block_size=16,
                            kv_events_endpoint=self.events, kv_replay_endpoint=self.replay,
                            data_parallel_size=self.dp_size)

    async def generate(self, request: PreprocessedRequest, ctx: Context):
        limit = request.stop.max_tokens or len(request.token_ids)
        tokens = (request.token_ids * (limit // max(1, len(request.token_ids)) + 1))[:limit]
        last: list[int] = []
        if self.finish == "stop":
            tokens, last = tokens[:-1], tokens[-1:]
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
            last, finish_reason=self.finish,
            usage=Usage(len(request.token_ids), len(tokens) + len(last)),
            error="the echo engine fails on purpose" if self.finish == "error" else None,
        )

    async def abort(self, ctx: Context) -> None:
        self.aborted.append(ctx.id())

    async def cleanup(self) -> None:
        pass
