"""``Placement``: the load one routed request holds, from its routing to its end."""

from __future__ import annotations

import weakref

from dynamo_zmq.llm import LLMEngineOutput
from dynamo_zmq.transport import ResponseStream

from .busy import PrefillTokens
from .replica_sync import ReplicaSync
from .scheduler import Candidate, LoadTracker, Route

__all__ = ["AllBusy", "Placement"]


class AllBusy(Exception):
    """Every candidate is busy (the request waits in the admission queue)."""


class Placement:
    """The load one routed request holds: the route of its current attempt, released once, and
    (with a prefill bound) its prompt tokens not yet prefilled, until its first output."""

    __slots__ = ("_loads", "_prefill", "_prefilling", "_rid", "_route", "_sync", "stream")

    def __init__(
        self, loads: LoadTracker, prefill: PrefillTokens, sync: ReplicaSync | None = None
    ) -> None:
        self._loads = loads
        self._prefill = prefill
        #: Router replica sync: each hold, prefill and release is told to the peers.
        self._sync = sync
        self._rid = 0
        self._route: Route | None = None
        self._prefilling: tuple[Candidate, int] | None = None
        self.stream: weakref.ref[ResponseStream[LLMEngineOutput]] | None = None

    def hold(self, route: Route, prefill_tokens: int = 0, lora: str | None = None) -> None:
        self.release()
        self._route = route
        if self._sync is not None:
            self._rid = self._sync.added(route, max(0, prefill_tokens), lora)
        if prefill_tokens > 0:
            self._prefilling = (route.candidate, prefill_tokens)
            self._prefill.add(route.candidate, prefill_tokens)

    def prefilled(self) -> None:
        held, self._prefilling = self._prefilling, None
        if held is not None:
            self._prefill.done(*held)
            if self._sync is not None:
                self._sync.prefilled(self._rid)
            notify = self._loads.on_change
            if notify is not None:
                notify()

    def release(self) -> None:
        self.prefilled()
        route, self._route = self._route, None
        if route is not None:
            self._loads.release(route)
            if self._sync is not None:
                self._sync.freed(self._rid)

    def on_output(self, out: LLMEngineOutput) -> None:
        if out.finish_reason is not None:
            self.release()

    def on_first_output(self, out: LLMEngineOutput) -> None:
        """The first output: the prompt is prefilled; later outputs go to ``on_output``."""
        self.prefilled()
        stream = None if self.stream is None else self.stream()
        if stream is not None:
            stream.set_on_item(self.on_output)
        self.on_output(out)
