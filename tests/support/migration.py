"""Slow mocker workers for tests that lose a worker mid-stream (request migration), started
through the ``spawn`` fixture, and the chat request they stream."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.support.mocker_fleet import Fleet, Spawn, mocker_fleet, start_mocker
from tests.support.procs import Proc

#: About 29 ms a token (the mocker's decode step at speedup 0.2): a stream of LONG tokens lasts
#: a few seconds, so a worker can be lost in its middle.
SLOW = "0.2"
#: Every mocker worker's flags: a metrics port of its own.
WORKER = ("--metrics-port", "0")
LONG = 80
MESSAGES = [{"role": "user", "content": "Tell me a long story about moving house"}]
#: LONG tokens, whatever the text: the stream does not end early.
PARAMS = {"max_tokens": LONG, "extra_body": {"ignore_eos": True}}


def mocker(spawn: Spawn, namespace: str, model_dir: Path, *extra: str) -> Proc:
    """A slow mocker worker (``extra`` flags), READY."""
    return start_mocker(spawn, namespace, model_dir, *WORKER, *extra, speedup=SLOW).wait_ready()


async def fleet(spawn: Spawn, namespace: str, model_dir: Path, n: int, *extra: str,
                mode: str | None = None, frontend_args: tuple[str, ...] = ()) -> Fleet:
    """``n`` slow mocker workers (``extra`` flags each) and a frontend (round-robin unless
    ``mode``) that lists them all."""
    return await mocker_fleet(spawn, namespace, model_dir, n, mode=mode, speedup=SLOW,
                              worker_args=(*WORKER, *extra), frontend_args=frontend_args)


def client_for(url: str) -> openai.AsyncOpenAI:
    """An openai client of the frontend at ``url``: no retries, a 60 s timeout."""
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def serving_worker(workers: list[Proc], header: str) -> Proc:
    """The worker of ``workers`` that an ``x-dynamo-worker`` header names."""
    iid = int(header.split("/")[0], 16)
    return next(w for w in workers if w.instance_id == iid)
