"""Faults across hosts (issue 14 items 3-5), on the multi-host harness.

Three hosts, each a network namespace on one bridge: a frontend on A (no discovery flag, a
whole-request deadline), slow mocker workers on B and C. Streams are started through A with the
real ``openai`` client; then the host serving some of them fails: its worker is killed, its
link is cut, the whole host is frozen, or its worker is asked to stop (SIGTERM). Every stream
must end within its deadline as one complete stream, the text an undisturbed stream has (every
request has the same prompt and the mocker's output is a function of it), with the right usage
and finish reason: the frontend migrates what the lost worker was serving (item 3), a stopping
worker hands its streams over (item 4), and nothing hangs (item 5). Each test leaves the
cluster as it found it: B's worker alive and routed to.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from dynamo_zmq.tools.child_process import ChildProcess
from tests.support.cluster import (
    Cluster,
    cluster,
    complete,
    frontend,
    mocker_worker,
    served_by,
    wait_until,
)

#: The frontend's whole-request deadline: every stream ends before it (plus a margin).
DEADLINE = 40.0
MARGIN = 5.0
#: About 25 ms a token: the streams outlive every fault window below.
SLOW = ("--speedup-ratio", "0.25", "--graceful-timeout", "1", "--grace-period", "0.2")
TOKENS = 200
STREAMS = 6


@dataclass
class Outcome:
    served_by: int = 0
    text: str = ""
    finish: str | None = None
    usage: Any = None
    error: str | None = None
    seconds: float = 0.0


@dataclass
class Deployment:
    cluster: Cluster
    workers: dict[str, ChildProcess]
    model_dir: Path
    client: Any = None
    model: str = ""
    reference: str = field(default="")

    def start_worker(self, host: str) -> None:
        self.workers[host] = mocker_worker(self.cluster[host], self.model_dir, *SLOW)

    def serves_both(self, timeout: float) -> bool:
        seen: set[int] = set()
        want = {w.instance_id for w in self.workers.values()}

        def step() -> bool:
            seen.add(complete(self.client, self.model))
            return seen >= want

        return wait_until(step, timeout, step=0.0)


@pytest.fixture(scope="module")
def deployment(tiny_model: Path) -> Iterator[Deployment]:
    with cluster("a", "b", "c") as built:
        dep = Deployment(built, {}, tiny_model)
        for h in ("b", "c"):
            dep.start_worker(h)
        frontend(built["a"], "--request-timeout", str(DEADLINE))
        dep.client = built["a"].openai_client(8000, timeout=DEADLINE + MARGIN)
        models = lambda: [m.id for m in dep.client.models.list().data]  # noqa: E731
        assert wait_until(lambda: bool(models()), 30), "no model discovered through A"
        dep.model = models()[0]
        assert dep.serves_both(30)
        yield dep


def stream(dep: Deployment, first: Any) -> Outcome:
    """One streamed completion read to its end; ``first`` (an Event) is set at its first text."""
    out = Outcome()
    t0 = time.monotonic()
    try:
        raw = dep.client.completions.with_raw_response.create(
            model=dep.model, prompt="Once upon", max_tokens=TOKENS, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        out.served_by = served_by(raw)
        for chunk in raw.parse():
            if chunk.usage is not None:
                out.usage = chunk.usage
            if chunk.choices:
                out.text += chunk.choices[0].text
                out.finish = chunk.choices[0].finish_reason or out.finish
                first.set()
    except openai.APIError as exc:
        out.error = repr(exc)
        first.set()
    out.seconds = time.monotonic() - t0
    return out


def run_with_fault(dep: Deployment, fault: Callable[[], None]) -> list[Outcome]:
    """Start ``STREAMS`` streams, wait for each one's first text, apply ``fault``, and return
    how each stream ended."""
    firsts = [threading.Event() for _ in range(STREAMS)]
    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(stream, dep, ev) for ev in firsts]
        for ev in firsts:
            assert ev.wait(30), "a stream did not start"
        fault()
        return [f.result(timeout=DEADLINE + 2 * MARGIN) for f in futures]


def assert_complete_and_unchanged(dep: Deployment, outcomes: list[Outcome]) -> None:
    b = dep.workers["b"].instance_id
    assert any(o.served_by == b for o in outcomes), f"no stream was on B: {outcomes}"
    for out in outcomes:
        assert out.error is None, out
        assert out.seconds < DEADLINE + MARGIN, out
        assert out.finish == "length", out
        assert out.usage is not None and out.usage.completion_tokens == TOKENS, out
        assert out.usage.prompt_tokens == outcomes[0].usage.prompt_tokens, out
    texts = {o.text for o in outcomes}
    assert len(texts) == 1, f"streams differ: {[len(t) for t in texts]}"


def test_a_killed_worker_host_loses_no_stream(deployment: Deployment) -> None:
    dep = deployment
    victim = dep.workers["b"]
    outcomes = run_with_fault(dep, lambda: victim.signal(signal.SIGKILL))
    assert_complete_and_unchanged(dep, outcomes)
    victim.wait(10)
    dep.start_worker("b")
    assert dep.serves_both(15)


@pytest.mark.parametrize("silent", [False, True], ids=["link-down", "silent-drop"])
def test_a_cut_worker_host_loses_no_stream(deployment: Deployment, silent: bool) -> None:
    dep = deployment
    b = dep.cluster["b"]
    try:
        outcomes = run_with_fault(dep, lambda: dep.cluster.cut(b, silent=silent))
    finally:
        dep.cluster.heal(b)
    assert_complete_and_unchanged(dep, outcomes)
    assert dep.serves_both(15)


def test_a_frozen_worker_host_loses_no_stream(deployment: Deployment) -> None:
    dep = deployment
    b = dep.cluster["b"]
    try:
        outcomes = run_with_fault(dep, lambda: dep.cluster.freeze(b))
    finally:
        dep.cluster.thaw(b)
    assert_complete_and_unchanged(dep, outcomes)
    assert dep.serves_both(15)


def test_a_worker_host_asked_to_stop_hands_its_streams_over(deployment: Deployment) -> None:
    dep = deployment
    leaving = dep.workers["b"]
    outcomes = run_with_fault(dep, lambda: leaving.signal(signal.SIGTERM))
    assert_complete_and_unchanged(dep, outcomes)
    assert leaving.wait(30) == 0
    handed = re.search(r"handed over (\d+) requests", leaving.logs())
    assert handed and int(handed.group(1)) > 0, leaving.logs()[-2000:]  # not all finished in time
    dep.start_worker("b")
    assert dep.serves_both(15)
