"""Context: stop/kill levels, waiting, linked children, listeners, threads."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# -- threads ---------------------------------------------------------------------------------


async def test_a_stop_from_another_thread_wakes_waiters_and_runs_listeners_on_the_loop():
    """Debug mode makes any call into the loop from another thread raise."""
    asyncio.get_running_loop().set_debug(True)
    loop_thread = threading.get_ident()
    ctx = Context()
    calls: list[tuple[int, bool]] = []
    ctx.add_listener(lambda killed: calls.append((threading.get_ident(), killed)))
    stopped = asyncio.ensure_future(ctx.async_killed_or_stopped())
    killed = asyncio.ensure_future(ctx.killed())
    await asyncio.sleep(0)

    def engine_thread() -> tuple[bool, bool]:
        ctx.stop_generating()
        return ctx.is_stopped(), ctx.is_killed()  # the flags read True at once, here too

    assert await asyncio.to_thread(engine_thread) == (True, False)
    assert await asyncio.wait_for(stopped, 5) is True
    assert not killed.done()
    await asyncio.to_thread(ctx.kill)
    await asyncio.wait_for(killed, 5)
    assert calls == [(loop_thread, False), (loop_thread, True)]


def test_a_context_made_outside_a_loop_binds_to_the_loop_that_waits_on_it():
    ctx = Context()

    async def main() -> bool:
        waiter = asyncio.ensure_future(ctx.stopped())
        await asyncio.sleep(0)
        await asyncio.to_thread(ctx.stop)
        await asyncio.wait_for(waiter, 5)
        return True

    assert asyncio.run(main(), debug=True)


N_CONTEXTS = 4
_index = st.integers(0, N_CONTEXTS - 1)
_op = st.one_of(
    st.tuples(st.sampled_from(["stop", "stop_generating", "kill"]), _index, st.booleans()),
    st.tuples(st.just("link"), _index, _index, st.booleans()).filter(lambda op: op[1] < op[2]),
    st.tuples(st.just("race"), _index),  # two threads at once: one stops, one kills
)


class Model:
    """What stop, kill and link_child mean, without threads or loops."""

    def __init__(self) -> None:
        self.stopped: set[int] = set()
        self.killed: set[int] = set()
        self.children: dict[int, list[int]] = {i: [] for i in range(N_CONTEXTS)}

    def stop(self, i: int) -> None:
        if i not in self.stopped:
            self.stopped.add(i)
            for child in list(self.children[i]):
                self.stop(child)

    def kill(self, i: int) -> None:
        if i not in self.killed:
            self.stop(i)
            self.killed.add(i)
            for child in list(self.children[i]):
                self.kill(child)

    def link(self, parent: int, child: int) -> None:
        self.children[parent].append(child)
        if parent in self.killed:
            self.kill(child)
        elif parent in self.stopped:
            self.stop(child)

    def flags(self) -> list[tuple[bool, bool]]:
        return [(i in self.stopped, i in self.killed) for i in range(N_CONTEXTS)]


async def _play(ops: list[tuple], outside: list[Context]) -> None:
    loop_thread = threading.get_ident()
    # Half made in the loop, half before it (those bind to it when first waited on).
    ctxs = [Context(f"in{i}") for i in range(N_CONTEXTS - len(outside))] + outside
    calls: dict[int, list[tuple[int, bool]]] = {i: [] for i in range(N_CONTEXTS)}
    for i, ctx in enumerate(ctxs):
        ctx.add_listener(lambda killed, i=i: calls[i].append((threading.get_ident(), killed)))
    waiters = {
        (i, kind): asyncio.ensure_future(getattr(ctxs[i], kind)())
        for i in range(N_CONTEXTS)
        for kind in ("stopped", "killed", "async_killed_or_stopped")
    }
    model = Model()

    def flags() -> list[tuple[bool, bool]]:
        return [(c.is_stopped(), c.is_killed()) for c in ctxs]

    for op in ops:
        if op[0] == "race":
            barrier = threading.Barrier(2)

            def racer(method: str, i: int = op[1], barrier: threading.Barrier = barrier) -> None:
                barrier.wait(5)
                getattr(ctxs[i], method)()

            await asyncio.gather(asyncio.to_thread(racer, "stop"), asyncio.to_thread(racer, "kill"))
            model.kill(op[1])
            seen = flags()
        else:
            if op[0] == "link":
                _, parent, child, in_thread = op
                model.link(parent, child)

                def act(parent: int = parent, child: int = child) -> None:
                    ctxs[parent].link_child(ctxs[child])
            else:
                method, i, in_thread = op
                (model.kill if method == "kill" else model.stop)(i)

                def act(method: str = method, i: int = i) -> None:
                    getattr(ctxs[i], method)()

            def act_and_look(act=act) -> list[tuple[bool, bool]]:
                act()
                return flags()  # read at once, in the thread that acted

            seen = await asyncio.to_thread(act_and_look) if in_thread else act_and_look()
        assert seen == model.flags(), (op, seen)
        for _ in range(3):
            await asyncio.sleep(0)  # the woken waiters run
        for (i, kind), waiter in waiters.items():
            due = i in (model.killed if kind == "killed" else model.stopped)
            if due:
                await asyncio.wait_for(waiter, 5)
            else:
                assert not waiter.done(), (op, i, kind)
        for i in range(N_CONTEXTS):
            want = [(loop_thread, False)] if i in model.stopped else []
            if i in model.killed:
                want.append((loop_thread, True))
            assert calls[i] == want, (op, i, calls[i])
    for waiter in waiters.values():
        waiter.cancel()


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(_op, max_size=10))
def test_context_from_the_loop_and_from_threads_matches_a_simple_model(ops):
    """Random stop / kill / link_child from the loop and from threads: the flags (read at once,
    in the acting thread), the waiters and the listeners (once per level, on the loop's thread)
    match ``Model``. The loop runs in debug mode: a thread touching it directly would raise."""
    outside = [Context(f"out{i}") for i in range(N_CONTEXTS // 2)]
    asyncio.run(_play(ops, outside), debug=True)
