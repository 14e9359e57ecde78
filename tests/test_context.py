"""Context: stop/kill levels, waiting, linked children, listeners."""

from __future__ import annotations

import asyncio

import pytest

from dynamo_zmq.context import Context


def test_ids_are_unique_or_given():
    assert Context().id() != Context().id()
    assert Context("abc").id() == "abc"


def test_kill_implies_stop_and_levels_are_one_way():
    ctx = Context()
    assert not ctx.is_stopped() and not ctx.is_killed()
    ctx.stop_generating()
    assert ctx.is_stopped() and not ctx.is_killed()
    ctx.kill()
    assert ctx.is_stopped() and ctx.is_killed()
    ctx.stop()
    assert ctx.is_killed()


async def test_waiters_wake():
    ctx = Context()
    stopped = asyncio.create_task(ctx.stopped())
    killed = asyncio.create_task(ctx.killed())
    either = asyncio.create_task(ctx.async_killed_or_stopped())
    await asyncio.sleep(0)
    ctx.stop()
    assert await asyncio.wait_for(either, 1) is True
    await asyncio.wait_for(stopped, 1)
    assert not killed.done()
    ctx.kill()
    await asyncio.wait_for(killed, 1)


def test_children_follow_in_link_order():
    order: list[str] = []
    parent = Context("p")
    kids = [Context(f"c{i}") for i in range(3)]
    for kid in kids:
        parent.link_child(kid)
        kid.add_listener(
            lambda killed, k=kid: order.append(f"{k.id()}:{'kill' if killed else 'stop'}")
        )
    parent.stop()
    assert order == ["c0:stop", "c1:stop", "c2:stop"]
    parent.kill()
    assert order[3:] == ["c0:kill", "c1:kill", "c2:kill"]
    assert all(k.is_killed() for k in kids)


def test_linking_to_a_stopped_parent_stops_the_child_at_once():
    parent = Context()
    parent.kill()
    child = Context()
    parent.link_child(child)
    assert child.is_killed()


def test_grandchildren_and_self_link():
    a, b, c = Context(), Context(), Context()
    a.link_child(b)
    b.link_child(c)
    a.stop()
    assert c.is_stopped() and not c.is_killed()
    with pytest.raises(ValueError):
        a.link_child(a)


def test_listener_removal():
    ctx = Context()
    calls: list[bool] = []
    remove = ctx.add_listener(calls.append)
    remove()
    remove()
    ctx.kill()
    assert calls == []
