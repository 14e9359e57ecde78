"""A mocker engine for ``bench_liveness.py``: each SIGUSR1 switches it between producing and
stuck (every request's next output waits, the canary's too, while the worker process and its
event loop run on: a stuck kernel, a deadlock). Loaded by the benchmark's worker process as
``--engine _bench_stuck_mocker:SwitchedStuckMocker`` (this directory on ``PYTHONPATH``)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

from dynamo_zmq.context import Context
from dynamo_zmq.llm import EngineConfig, LLMEngineOutput, PreprocessedRequest
from engines.mocker import MockerEngine


class SwitchedStuckMocker(MockerEngine):
    """The mocker, stuck between an odd and an even SIGUSR1."""

    name = "switched-stuck-mocker"

    async def start(self, worker_id: int) -> EngineConfig:
        config = await super().start(worker_id)
        self._producing = asyncio.Event()
        self._producing.set()
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, self._switch)
        return config

    def _switch(self) -> None:
        if self._producing.is_set():
            self._producing.clear()
        else:
            self._producing.set()

    async def generate(
        self, request: PreprocessedRequest, ctx: Context
    ) -> AsyncIterator[LLMEngineOutput]:
        async for out in super().generate(request, ctx):
            await self._producing.wait()
            yield out
