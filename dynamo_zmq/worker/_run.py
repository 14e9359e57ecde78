"""``run(engine, config)``: the one entry point that serves an engine (Dynamo's
``dynamo_backend_common::run``), and ``run_async`` for a caller that owns its event loop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Sequence

from .. import tracing
from ..llm import LLMEngine
from ..runtime import run_main, setup_logging
from ._config import WorkerConfig
from ._worker import Worker

__all__ = ["run", "run_async", "run_many", "run_many_async"]


def run(engine: LLMEngine, config: WorkerConfig) -> int:
    """Start ``engine`` (not started yet), serve it until SIGTERM/SIGINT, shut down in order;
    blocks, and returns the exit status (0, or 1 when the start failed).

        engine, config = MockerEngine.from_args(["--model-path", "/models/llama"])
        sys.exit(run(engine, config))
    """
    setup_logging()
    tracing.setup("dynamo-worker")
    try:
        return run_main(run_async(engine, config))
    finally:
        tracing.shutdown()  # flush the spans not exported yet


async def run_async(engine: LLMEngine, config: WorkerConfig) -> int:
    """``run`` on the running event loop (it installs the SIGTERM/SIGINT handlers there)."""
    return await Worker(engine, config).run()


def run_many(workers: Sequence[tuple[LLMEngine, WorkerConfig]]) -> int:
    """``run`` for several workers in one process (``--workers-per-process``): each its own
    engine, runtime, sockets, instance id and advert; SIGTERM/SIGINT shut them all down.
    Returns the worst exit status."""
    setup_logging()
    tracing.setup("dynamo-worker")
    try:
        return run_main(run_many_async(workers))
    finally:
        tracing.shutdown()


async def run_many_async(workers: Sequence[tuple[LLMEngine, WorkerConfig]]) -> int:
    """``run_many`` on the running event loop."""
    served = [Worker(engine, config) for engine, config in workers]
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        for worker in served:
            worker.on_signal()

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)
    codes = await asyncio.gather(*(worker.run(signals=False) for worker in served))
    return max(codes, default=0)
