"""``Resources``: one owner for a component's tasks, closers and children."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from dynamo_zmq.resources import Resources, cancel_and_wait, process_zmq_context, wait_event


async def test_close_cancels_tasks_then_runs_closers_newest_first_then_is_idempotent() -> None:
    res = Resources("owner")
    order: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            order.append(f"task {name} ended")

    res.spawn(forever("a"), "a")
    res.spawn(forever("b"), "b")
    res.on_close(lambda: order.append("sync closer (first registered)"))

    async def async_closer() -> None:
        order.append("async closer (last registered)")

    res.on_close(async_closer)
    await asyncio.sleep(0)  # both tasks are running
    await res.close()
    assert sorted(order[:2]) == ["task a ended", "task b ended"]
    assert order[2:] == ["async closer (last registered)", "sync closer (first registered)"]
    await res.close()  # a second close does nothing
    assert len(order) == 4 and res.closed


async def test_children_close_before_their_parent_and_leave_it_when_closed_alone() -> None:
    parent = Resources("parent")
    order: list[str] = []
    first, second = parent.child("first"), parent.child("second")
    parent.on_close(lambda: order.append("parent"))
    first.on_close(lambda: order.append("first"))
    second.on_close(lambda: order.append("second"))
    third = parent.child("third")
    third.on_close(lambda: order.append("third"))
    await third.close()  # on its own, earlier
    assert order == ["third"] and "third" not in repr(parent._children)
    await parent.close()
    assert order == ["third", "second", "first", "parent"]
    assert first.closed and second.closed


async def test_spawning_on_a_closed_owner_is_refused_and_the_coroutine_closed() -> None:
    res = Resources("closed")
    await res.close()
    ran = False

    async def never() -> None:
        nonlocal ran
        ran = True

    coro = never()
    with pytest.raises(RuntimeError, match="closed"):
        res.spawn(coro, "late")
    assert coro.cr_frame is None and not ran  # closed, never started
    with pytest.raises(RuntimeError):
        res.on_close(lambda: None)
    with pytest.raises(RuntimeError):
        res.child("late")


async def test_the_closers_own_cancellation_propagates() -> None:
    """A task slow to end after its cancel does not swallow the closing caller's cancel
    (``suppress(BaseException): await task`` would)."""
    res = Resources("slow")
    release = asyncio.Event()

    async def slow_to_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()  # cleans up for a while
            raise

    res.spawn(slow_to_cancel(), "slow")
    await asyncio.sleep(0)
    closer = asyncio.create_task(res.close())
    await asyncio.sleep(0.05)
    assert not closer.done()
    closer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closer
    release.set()
    await asyncio.sleep(0.01)


async def test_a_failed_task_is_logged_and_close_still_runs_every_closer(caplog) -> None:
    res = Resources("failing")
    ran: list[str] = []

    async def boom() -> None:
        raise ValueError("boom")

    def bad_closer() -> None:
        raise OSError("closer failed")

    res.on_close(lambda: ran.append("first"))
    res.on_close(bad_closer)
    task = res.spawn(boom(), "boom")
    await asyncio.wait({task})
    await res.close()
    assert ran == ["first"]
    messages = [r.getMessage() for r in caplog.records]
    assert any("task boom failed" in m for m in messages)
    assert any("a closer failed" in m for m in messages)


async def test_a_component_closing_from_its_own_task_does_not_cancel_itself() -> None:
    res = Resources("self")

    async def closes_its_owner() -> str:
        await res.close()
        return "finished"

    task = res.spawn(closes_its_owner(), "closer")
    assert await task == "finished" and res.closed


def test_tasks_of_another_event_loop_are_refused_not_waited_for_ever() -> None:
    other = asyncio.new_event_loop()
    try:
        foreign = other.create_task(asyncio.sleep(3600), name="foreign")

        async def close_here() -> None:
            await cancel_and_wait([foreign])

        with pytest.raises(RuntimeError, match="another event loop"):
            asyncio.run(close_here())
        foreign.cancel()
        other.run_until_complete(asyncio.gather(foreign, return_exceptions=True))
    finally:
        other.close()


def test_one_zmq_context_per_process() -> None:
    seen: list[zmq.Context[zmq.Socket[bytes]]] = []
    thread = threading.Thread(target=lambda: seen.append(process_zmq_context()))
    thread.start()
    thread.join()
    assert seen == [process_zmq_context()] and Resources("a").zctx is Resources("b").zctx
    assert process_zmq_context() is zmq.Context.instance()
    assert process_zmq_context().get(zmq.MAX_SOCKETS) >= 32768


async def test_wait_event_never_loses_a_cancellation_that_comes_as_the_event_is_set():
    # asyncio.wait_for (Python 3.10/3.11) returns instead of raising here, and a loop around it
    # runs on: the frontend's shutdown hung on such a loop (issue 20, CI flake).
    event = asyncio.Event()
    waiting = asyncio.ensure_future(wait_event(event, 10))
    await asyncio.sleep(0.01)
    event.set()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_wait_event_says_whether_the_event_was_set():
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 10) is True
    assert await wait_event(event, 0) is True
