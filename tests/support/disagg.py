"""Disaggregated serving for tests: mocker workers in the prefill or decode role (started through
the ``spawn`` fixture), a wait for a frontend that follows the prefill pool, and prompts on
either side of a prefill threshold."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.support.http_calls import get
from tests.support.metrics import metrics_page, sample
from tests.support.mocker_fleet import Spawn, start_worker
from tests.support.procs import Proc, system_port

#: A prompt well over the prefill thresholds the tests set, in the tiny model's tokens.
LONG = "hello " * 600
#: A prompt under them.
SHORT = "Hi"


class Worker:
    """A mocker worker serving 'tiny' in one role (``--disaggregation-mode``), with its system
    port's metrics; started and READY on construction."""

    def __init__(self, spawn: Spawn, namespace: str, model_dir: Path | str, role: str,
                 speedup: str = "1000") -> None:
        self.proc: Proc = start_worker(spawn, namespace, model_dir, "--disaggregation-mode",
                                       role, speedup=speedup, env={"DYN_SYSTEM_PORT": "0"},
                                       ready=True)
        self.port = system_port(self.proc)

    async def metric(self, name: str) -> float:
        """``dynamo_component_NAME`` of model 'tiny' (0.0 if absent)."""
        page = await metrics_page(f"http://127.0.0.1:{self.port}")
        return sample(page, f"dynamo_component_{name}", model="tiny") or 0.0

    async def engine_metric(self, name: str) -> float:
        """One of the mocker engine's own counters (``mocker_*``, no labels)."""
        return sample(await metrics_page(f"http://127.0.0.1:{self.port}"), name) or 0.0

    async def wait_metric(self, name: str, value: float, timeout: float = 30.0) -> None:
        """Until ``metric(name)`` is ``value``; fails the test after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (got := await self.metric(name)) != value:
            assert loop.time() < deadline, f"{name} is {got}, not {value}"
            await asyncio.sleep(0.05)


async def wait_pools(url: str, prefill: int, timeout: float = 30.0) -> None:
    """Until the frontend at ``url`` serves 'tiny' and, if ``prefill`` is not 0, follows its
    prefill pool (its remote-prefill counter exists once it does); fails the test after
    ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        status, body = await asyncio.to_thread(get, f"{url}/v1/models")
        listed = status == 200 and "tiny" in {m["id"] for m in json.loads(body)["data"]}
        _, page = await asyncio.to_thread(get, f"{url}/metrics")
        followed = b"dynamo_frontend_remote_prefills_total" in page
        if listed and (followed or not prefill):
            return
        assert loop.time() < deadline, f"model or prefill pool not followed: {body!r}"
        await asyncio.sleep(0.1)
