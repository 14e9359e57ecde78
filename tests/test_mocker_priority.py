"""The mocker's priority scheduling (``--scheduling-policy priority``, vLLM's flag): with one
running slot, queued requests start in priority order (lower first, then arrival), a preempted
sequence keeps its place, and the engine advertises ``Capability.PRIORITY`` only then. Real
engine, no mocks; nothing asserts timing."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from dynamo_zmq.context import Context
from dynamo_zmq.llm import Capability, PreprocessedRequest, SamplingOptions, StopConditions
from engines.mocker import MockerConfig, MockerEngine
from engines.mocker._config import add_mocker_args, config_from_args
from engines.mocker._sequence import Sequence
from engines.mocker._waiting import PriorityWaiting

#: Requests queued behind the running one: (name, priority), in arrival order.
QUEUED = [("a", 3), ("b", 1), ("c", 2), ("d", 0), ("e", 1), ("f", -5)]


async def _start_order(policy: str) -> list[str]:
    """Start a long request on a one-slot mocker, queue ``QUEUED`` behind it, and return the
    order in which the queued ones produced their first token."""
    engine = MockerEngine(MockerConfig(
        speedup_ratio=1e6, enable_kv_events=False, block_size=16, num_gpu_blocks=512,
        max_num_seqs=1, host="127.0.0.1", scheduling_policy=policy))
    await engine.start(worker_id=1)
    order: list[str] = []

    def request(i: int, priority: int, max_tokens: int) -> PreprocessedRequest:
        return PreprocessedRequest([1 + i, 2, 3, 4] * 8, sampling=SamplingOptions(seed=i),
                                   stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
                                   priority=priority)

    async def run(name: str, req: PreprocessedRequest, started: asyncio.Event | None) -> None:
        async for chunk in engine.generate(req, Context()):
            if chunk.token_ids and started is not None:
                started.set()
                started = None
            if name not in order:
                order.append(name)

    try:
        running = asyncio.Event()
        # The long one takes the only slot (its priority is the worst: it is running already).
        first = asyncio.create_task(run("long", request(0, 100, 500), running))
        await asyncio.wait_for(running.wait(), 10)
        rest = [asyncio.create_task(run(name, request(i + 1, p, 3), None))
                for i, (name, p) in enumerate(QUEUED)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(engine.ranks[0].waiting) == len(QUEUED)  # all queued behind the long one
        await asyncio.wait_for(asyncio.gather(first, *rest), 30)
    finally:
        await engine.cleanup()
    assert order[0] == "long"
    return order[1:]


async def test_a_one_slot_mocker_starts_queued_requests_in_priority_order() -> None:
    by_priority = sorted(QUEUED, key=lambda q: q[1])  # stable: arrival breaks ties
    assert await _start_order("priority") == [name for name, _ in by_priority]
    assert await _start_order("fcfs") == [name for name, _ in QUEUED]  # the default: arrival


def test_a_preempted_sequence_keeps_its_place() -> None:
    def seq(priority: int) -> Sequence:
        s = Sequence([1, 2, 3], block_size=16, vocab_size=100, seed=0, max_tokens=4)
        s.priority = priority
        return s

    queue = PriorityWaiting()
    early, late, other = seq(1), seq(1), seq(2)
    for s in (early, late, other):
        queue.append(s)
    assert queue.popleft() is early
    queue.appendleft(early)  # preempted: before ``late`` (same priority, earlier arrival)
    assert list(queue) == [early, late, other] and queue[0] is early
    queue.remove(late)
    assert [queue.popleft(), queue.popleft()] == [early, other] and not queue


async def test_priority_capability_only_under_the_priority_policy() -> None:
    fcfs = MockerEngine(MockerConfig(enable_kv_events=False))
    prio = MockerEngine(MockerConfig(enable_kv_events=False, scheduling_policy="priority"))
    assert Capability.PRIORITY not in fcfs.capabilities()
    assert Capability.PRIORITY in prio.capabilities()
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        MockerConfig(scheduling_policy="lifo")


def test_the_scheduling_policy_flag_and_its_variable(monkeypatch) -> None:
    parser = argparse.ArgumentParser()
    add_mocker_args(parser)
    assert config_from_args(parser.parse_args([])).scheduling_policy == "fcfs"
    got = parser.parse_args(["--scheduling-policy", "priority"])
    assert config_from_args(got).scheduling_policy == "priority"
    monkeypatch.setenv("DYN_SCHEDULING_POLICY", "priority")
    parser = argparse.ArgumentParser()
    add_mocker_args(parser)
    assert config_from_args(parser.parse_args([])).scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])
