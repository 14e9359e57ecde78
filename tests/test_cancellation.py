"""Cancellation as the cancellation document describes it, through real processes and runtimes.

- A handler ending on a stop with the document's ``raise asyncio.CancelledError`` ends the
  caller's stream; never ``EngineShutdown``, never a retry elsewhere.
- Stop, then drop the stream (the usual client code): the handler at every hop of caller ->
  middle -> server sees the stop at its next check instead of being cancelled where it waits; one
  that never looks is still cancelled, after the kill grace.
- Stop and kill from a thread (an engine's), on either side, through a real caller.

The handlers (``tests/support/cancel_app.py``) note what they observed in a journal that the
test reads back through another endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from typing import Any

import pytest

from dynamo_zmq import errors
from dynamo_zmq.runtime import Context

#: Kill grace of the serving processes here: far longer than any handler needs to look, so a
#: loaded machine cannot make a handler miss it.
GRACE = "5"


def cancel_app(namespace: str, *extra: str) -> list[str]:
    return [
        "-m", "tests.support.cancel_app", "--namespace", namespace, "--host", "127.0.0.1",
        "--discovery", "static", *extra,
    ]


async def journal(client, context_id: str, instance_id: int | None = None) -> list[Any]:
    request = {"context_id": context_id}
    if instance_id is None:
        stream = await client.generate(request, annotated=False)
    else:
        stream = await client.direct(request, instance_id, annotated=False)
    return [entry async for entry in stream]


async def journal_until(client, context_id: str, done, instance_id: int | None = None,
                        timeout: float = 15.0) -> list[Any]:
    """The journal of ``context_id`` once ``done(entries)`` holds (or as it is at the deadline)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        entries = await journal(client, context_id, instance_id)
        if done(entries) or loop.time() > deadline:
            return entries
        await asyncio.sleep(0.05)


def looked(entries: list[Any]) -> bool:
    return any(isinstance(e, str) and (e.startswith("saw ") or e.startswith("cancelled"))
               for e in entries)


@pytest.fixture
async def chain(namespace, spawn, make_runtime):
    """A server and a middle process that relays to it; the clients of both, and the caller's."""
    server = spawn(*cancel_app(namespace, "--kill-grace", GRACE))
    middle = spawn(*cancel_app(namespace, "--role", "middle", "--kill-grace", GRACE,
                               "--static-workers", server.address))
    rt = make_runtime(static=(server.address, middle.address))
    clients = {}
    for name in ("backend.work", "backend.journal", "middle.relay", "middle.journal"):
        clients[name] = await rt.endpoint(f"{namespace}.{name}").client()
        await clients[name].wait_for_instances(timeout=15)
    return clients


@pytest.mark.parametrize("hops", [1, 2])
async def test_the_documents_stop_pattern_ends_the_stream(chain, hops):
    """``if context.is_stopped(): raise asyncio.CancelledError`` at every hop: the caller's
    stream simply ends after the items before the stop."""
    target = chain["backend.work"] if hops == 1 else chain["middle.relay"]
    ctx = Context()
    stream = await target.generate({"raise": True, "delay": 0.01}, annotated=False, context=ctx)
    items = []
    async for item in stream:  # bounded: the stop ends it
        items.append(item["i"])
        if len(items) == 3:
            ctx.stop_generating()
        assert len(items) < 1000
    assert items == list(range(len(items))) and len(items) >= 3
    hops_journals = ["backend.journal"] + (["middle.journal"] if hops == 2 else [])
    for hop in hops_journals:
        entries = await journal(chain[hop], ctx.id())
        # (the server may see the middle's KILL too: the middle drops its call once it is done)
        assert any(str(e).startswith("saw stop") for e in entries), (hop, entries)
        assert "cancelled at an await" not in entries, (hop, entries)


async def test_a_stop_before_the_first_item_is_not_retried(namespace, spawn, make_runtime):
    """The handler raises CancelledError on the stop before yielding anything: the stream ends
    empty, and the other instance never sees the request."""
    a = spawn(*cancel_app(namespace))
    b = spawn(*cancel_app(namespace))
    rt = make_runtime(static=(a.address, b.address))
    work = await rt.endpoint(f"{namespace}.backend.work").client()
    notes = await rt.endpoint(f"{namespace}.backend.journal").client()
    for client in (work, notes):
        await client.wait_for_instances(timeout=15)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while len(client.instance_ids()) < 2:
            assert loop.time() < deadline, "both instances were never live"
            await asyncio.sleep(0.05)

    for _ in range(2):  # round-robin: once on each instance
        ctx = Context()
        stream = await work.generate({"silent": True, "raise": True}, annotated=False, context=ctx)
        serving = stream.instance_id
        other = a.instance_id if serving == b.instance_id else b.instance_id
        started = await journal_until(notes, ctx.id(), lambda e: "started" in e, serving)
        assert "started" in started
        ctx.stop_generating()
        assert [item async for item in stream] == []
        assert stream.instance_id == serving
        assert "saw stop" in await journal(notes, ctx.id(), serving)
        assert await journal(notes, ctx.id(), other) == []


async def test_stop_then_drop_lets_every_hop_see_the_stop(chain):
    """caller -> middle -> server; the caller stops, then drops or closes its stream (or kills
    its context): each hop's handler sees it at its next check, none is cancelled mid-await."""
    for leave in ("break", "aclose", "kill"):
        ctx = Context()
        stream = await chain["middle.relay"].generate(
            {"delay": 0.02, "middle_delay": 0.02}, annotated=False, context=ctx
        )
        got = 0
        with pytest.raises(errors.Cancelled) if leave == "kill" else contextlib.nullcontext():
            async for _ in stream:
                got += 1
                if got == 3:
                    if leave == "kill":
                        ctx.kill()
                        continue
                    ctx.stop_generating()
                    if leave == "aclose":
                        await stream.aclose()
                    break
        del stream
        gc.collect()
        for hop in ("backend.journal", "middle.journal"):
            entries = await journal_until(chain[hop], ctx.id(), looked)
            saw = [e for e in entries if isinstance(e, str) and e.startswith(("saw", "cancel"))]
            assert saw and saw[0].startswith("saw stop"), (leave, hop, entries)
            assert "cancelled at an await" not in entries, (leave, hop, entries)


async def test_a_handler_that_ignores_the_flags_is_still_cancelled(make_runtime):
    """After the kill grace the handler's task is cancelled where it waits, and the server
    forgets the stream; the server serves on."""
    server = make_runtime(static=())
    observed: list[str] = []

    async def stubborn(request, context):
        yield 0
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            observed.append(f"cancelled, killed={context.is_killed()}")
            raise

    await server.endpoint("ns.c.stubborn").start_serving(stubborn)
    client = await make_runtime(static=(server.address,)).endpoint("ns.c.stubborn").client()
    await client.wait_for_instances(timeout=10)
    ctx = Context()
    stream = await client.generate({}, annotated=False, context=ctx)
    assert await stream.__anext__() == 0
    ctx.stop_generating()
    await stream.aclose()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while observed == [] or server._server._streams:
        assert loop.time() < deadline, "the stubborn handler was never cancelled"
        await asyncio.sleep(0.02)
    assert observed == ["cancelled, killed=True"]
    again = await client.generate({}, annotated=False)
    assert await again.__anext__() == 0
    await again.aclose()


@pytest.mark.parametrize("how", ["stop_generating", "kill"])
async def test_a_worker_thread_stops_or_kills_the_handlers_context(namespace, spawn,
                                                                  make_runtime, how):
    """The server runs in asyncio debug mode, where touching the loop from another thread
    raises: the thread's call must hand the loop's part over, and the handler must wake."""
    server = spawn(*cancel_app(namespace), env={"PYTHONASYNCIODEBUG": "1"})
    rt = make_runtime(static=(server.address,))
    threaded = await rt.endpoint(f"{namespace}.backend.threaded").client()
    notes = await rt.endpoint(f"{namespace}.backend.journal").client()
    await threaded.wait_for_instances(timeout=15)
    await notes.wait_for_instances(timeout=15)
    ctx = Context()
    stream = await threaded.generate({"how": how}, annotated=False, context=ctx)
    assert await asyncio.wait_for(stream.__anext__(), 15) == {"started": True}
    killed = how == "kill"
    want = {"woke": True, "flags_in_thread": [True, killed]}
    if killed:  # the handler abandoned its own stream: the caller sees it cancelled
        with pytest.raises(errors.Cancelled):
            await asyncio.wait_for(stream.__anext__(), 15)
    else:
        assert [item async for item in stream] == [want]
    entries = await journal_until(notes, ctx.id(), lambda e: len(e) > 0)
    assert entries == [want]


async def test_a_caller_thread_stops_and_kills_its_request(make_runtime):
    """The caller's context stopped or killed from another thread: STOP/KILL go out from the
    loop (this loop runs in debug mode, where another thread touching it raises), and the
    caller's waiting read wakes."""
    asyncio.get_running_loop().set_debug(True)
    server = make_runtime(static=())
    seen: list[str] = []

    async def hold(request, context):
        yield "started"
        await context.async_killed_or_stopped()
        seen.append("killed" if context.is_killed() else "stopped")
        if not context.is_killed():
            yield "stopped"

    await server.endpoint("ns.c.hold").start_serving(hold)
    client = await make_runtime(static=(server.address,)).endpoint("ns.c.hold").client()
    await client.wait_for_instances(timeout=10)

    for how in ("stop_generating", "kill"):
        ctx = Context()
        stream = await client.generate({}, annotated=False, context=ctx)
        assert await stream.__anext__() == "started"
        reading = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the read is waiting now
        await asyncio.to_thread(getattr(ctx, how))
        assert ctx.is_stopped() and ctx.is_killed() == (how == "kill")
        if how == "kill":
            with pytest.raises(errors.Cancelled):
                await asyncio.wait_for(reading, 10)
        else:
            assert await asyncio.wait_for(reading, 10) == "stopped"
            assert [item async for item in stream] == []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while len(seen) < 2:
        assert loop.time() < deadline, seen
        await asyncio.sleep(0.02)
    assert seen[0] == "stopped"  # (the kill's STOP and KILL may reach the handler apart)

