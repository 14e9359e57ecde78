"""How an open stream ends early on the serving side: a kill (with its grace), a deadline, the
server's own cancellation, and the terminal a cancelled handler's stream ends with.

A kill from the caller (KILL, a dropped stream, the caller gone) does not cancel the handler at
once: its context's flags and waiters fire, what it buffered or yields from then on is dropped,
and it has the server's kill grace to notice and return (so a handler that cleans up on
``is_stopped()`` does, at every hop of a chain) before its task is cancelled where it waits.
The server's own kills (a deadline, an item that cannot be encoded) cancel it at once: their
caller waits for that terminal.
"""

from __future__ import annotations

import asyncio

from .. import errors
from ..wire import End, Error
from ._outbox import OpenStream

__all__ = ["cancelled_terminal", "interrupt", "on_deadline", "on_kill"]


def on_kill(st: OpenStream, grace: float) -> None:
    """``st``'s context was killed: drop what it buffered, send nothing more of it, and cancel
    its handler unless it returns within ``grace`` seconds (at once for the server's kills)."""
    st.wake.set()
    if st.timed_out or st.failure is not None:  # its caller waits for that terminal
        interrupt(st)
        return
    st.buf.clear()
    st.credit = st.room = 0  # the producer's next item finds the stream killed (make_room)
    task = st.task
    if task is None or task.done() or st.finishing:
        return
    timer = asyncio.get_running_loop().call_later(grace, interrupt, st)
    task.add_done_callback(lambda _t: timer.cancel())


def on_deadline(st: OpenStream) -> None:
    """The request's deadline passed: kill it (its handler is cancelled at once)."""
    if st.task is not None and not st.task.done():
        st.timed_out = True
        st.ctx.kill()


def interrupt(st: OpenStream) -> None:
    """Cancel ``st``'s handler where it waits (unless it is done or already finishing)."""
    if st.task is not None and not st.task.done() and not st.finishing:
        st.interrupted = True
        st.task.cancel()


def cancelled_terminal(st: OpenStream) -> End | Error:
    """The terminal of a stream whose handler ended in CancelledError, or that was killed.

    The handler's own ``CancelledError`` on a stop the caller asked for (the cancellation
    document's ``if context.is_stopped(): raise asyncio.CancelledError``) ends the stream
    normally; a stopped or killed request never ends as ``EngineShutdown`` (retryable), which
    stays for the server closing (or a handler cancelled by something else) with the request
    neither stopped nor killed.
    """
    exc: errors.DynamoError
    if st.failure is not None:
        exc = st.failure
    elif st.timed_out:
        exc = errors.ResponseTimeout("request deadline exceeded")
    elif st.ctx.is_killed():
        exc = errors.Cancelled("request killed")
    elif st.ctx.is_stopped():
        if not st.interrupted:
            return End(st.request_id, 0)
        exc = errors.Cancelled("request stopped")
    else:
        exc = errors.EngineShutdown("server closed" if st.interrupted else "handler cancelled")
    return Error(st.request_id, 0, exc.kind, exc.message)


def wire_text(text: object) -> str:
    """``text`` as a str MessagePack can carry.

    A handler's message may hold lone surrogates (text decoded with ``surrogateescape``), which
    make the terminal unencodable: the client would wait forever. Escape them instead.
    """
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")
