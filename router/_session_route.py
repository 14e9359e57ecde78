"""Session pins in the KV router's decisions (``RouteOptions.session_id``, ``--router-sessions``).

A session's pinned (worker, rank) is the only candidate while it is live, allowed and not busy
(``select_pinned``); wherever a session's request goes, the session is pinned there from now,
its outcome counted and the peer routers told (``record_pin``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from dynamo_zmq.llm import SessionPins, pin_outcome

from .replica_sync import ReplicaSync
from .scheduler import Candidate, Scheduler, Selection

__all__ = ["record_pin", "select_pinned"]


def select_pinned(
    scheduler: Scheduler,
    candidates: Sequence[Candidate],
    prompt_blocks: int,
    matches: Mapping[Candidate, int],
    values: Sequence[float],
    pinned: Candidate | None,
) -> Selection:
    """``scheduler``'s choice among ``candidates`` (loads ``values``), but ``pinned`` alone
    when it is among them (a session's, live and not busy)."""
    if pinned is not None and pinned in candidates:
        i = candidates.index(pinned)
        return scheduler.select([pinned], prompt_blocks, matches, [values[i]])
    return scheduler.select(candidates, prompt_blocks, matches, values)


def record_pin(
    pins: SessionPins | None,
    replicas: ReplicaSync | None,
    session: str | None,
    pinned: Candidate | None,
    chosen: Candidate,
    eligible: Callable[[], bool],
) -> None:
    """Pin ``session`` where its request went (``chosen``), counting the outcome against
    ``pinned`` (``eligible``: whether ``pinned`` could have been taken), and tell the peers."""
    if pins is not None and session is not None:
        pins.routed(session, chosen, pin_outcome(pinned, chosen, eligible))
        if replicas is not None:
            replicas.pins.pinned(session, chosen)
