"""Snapshots of a router replica's in-flight requests (``router/replica_sync.py``).

A SUB socket gives no sign of when its subscription has reached the peer's PUB (ZeroMQ's slow
joiner), and what the peer publishes before then is lost. So a replica that starts following a
peer, or finds a gap in the peer's sequence numbers, asks the peer's replica endpoint for a
snapshot: the requests it routed that are still in flight, and ``seq``, the sequence number of
the last event it had published then. Reconciled with what the events already did (``Peer``):

- a request the snapshot lacks whose ADD came at or before ``seq`` ended before the snapshot
  (its FREE was missed): it is released;
- a request of the snapshot the events did not add is added, unless its FREE came after
  ``seq``, and without its prefill tokens if its PREFILLED did;
- events up to ``seq`` are then duplicates of what the snapshot holds.

A FREE lost with no later event from that peer shows no gap, so a replica also asks again when
one of a peer's requests has counted ``resync_interval(ttl)`` seconds (at most once per that
interval): the snapshot releases it if it ended, where the TTL alone would take ``ttl``. A
snapshot older than an event heard before it was asked for cannot come from a live peer (it
answers as of its latest event) and is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dynamo_zmq.resources import Resources

from ._replica_sessions import parse_pins
from ._replica_wire import MAX_HASHES
from .scheduler import Candidate, Route

__all__ = [
    "SNAPSHOT_KEY", "OwnRequests", "Peer", "PeerRequest", "Snapshot", "SnapshotError",
    "fetch_snapshot", "resync_interval",
]

#: The replica endpoint answers a request ``{SNAPSHOT_KEY: True}`` with a snapshot.
SNAPSHOT_KEY = "snapshot"
#: Seconds a peer's request counts before its replica is asked for a snapshot again (at most).
RESYNC_AFTER = 60.0


def resync_interval(ttl: float) -> float:
    """Seconds after which a peer's counted request prompts a new snapshot: ``RESYNC_AFTER``,
    or a tenth of the TTL if that is shorter."""
    return min(RESYNC_AFTER, ttl / 10)

#: One request of a snapshot: worker, dp rank, packed block hashes, extra blocks, prefill tokens.
Entry = tuple[int, int, bytes, int, int]


class SnapshotError(ValueError):
    """A peer's answer is not a snapshot (malformed, or a replica too old to send one)."""


class Snapshot:
    """A peer's in-flight requests (``requests``: id -> ``Entry``) as of its event ``seq``, and
    its session pins (``sessions``: (session, (worker, rank), seconds since last use))."""

    __slots__ = ("requests", "seq", "sessions")

    def __init__(self, seq: int, requests: dict[int, Entry],
                 sessions: list[tuple[str, Candidate, float]] | None = None) -> None:
        self.seq = seq
        self.requests = requests
        self.sessions = sessions or []

    @classmethod
    def parse(cls, answer: Any) -> Snapshot:
        """The snapshot in a replica endpoint's answer; ``SnapshotError`` if there is none."""
        if not isinstance(answer, dict) or not isinstance(answer.get("requests"), list):
            raise SnapshotError("the answer is not a snapshot")
        seq = answer.get("seq")
        if type(seq) is not int:
            raise SnapshotError(f"snapshot seq {seq!r}")
        requests: dict[int, Entry] = {}
        for item in answer["requests"]:
            if (not isinstance(item, list) or len(item) != 6
                    or not all(type(x) is int for x in (*item[:3], *item[4:]))
                    or not isinstance(item[3], bytes) or len(item[3]) % 8
                    or len(item[3]) > 8 * MAX_HASHES):
                raise SnapshotError(f"snapshot entry {item!r:.80}")
            rid, worker, rank, hashes, extra, prefill = item
            requests[rid] = (worker, rank, hashes, extra, prefill)
        sessions = parse_pins(answer.get("sessions"))
        if sessions is None:
            raise SnapshotError(f"snapshot sessions {answer.get('sessions')!r:.80}")
        return cls(seq, requests, sessions)


async def fetch_snapshot(client: Any, iid: int, timeout: float, heard: int | None = None
                         ) -> Snapshot:
    """Ask the replica ``iid`` for its snapshot through ``client`` (of the replica endpoint);
    ``heard``: the last of its events heard before asking.

    Raises:
        DynamoError: the request failed; SnapshotError: the answer is not a snapshot, or one
        older than ``heard``.
    """
    stream = await client.direct({SNAPSHOT_KEY: True}, iid, timeout=timeout)
    answers = [item.data() async for item in stream]
    snap = Snapshot.parse(answers[0] if answers else None)
    if heard is not None and snap.seq < heard:
        raise SnapshotError(f"snapshot as of event {snap.seq}, older than event {heard} heard")
    return snap


class OwnRequests:
    """This replica's in-flight requests as its events describe them, for its snapshots."""

    def __init__(self) -> None:
        self._live: dict[int, list[Any]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def add(self, rid: int, entry: Entry) -> None:
        self._live[rid] = list(entry)

    def prefilled(self, rid: int) -> None:
        live = self._live.get(rid)
        if live is not None:
            live[4] = 0

    def free(self, rid: int) -> None:
        self._live.pop(rid, None)

    def snapshot(self, seq: int) -> dict[str, Any]:
        """The snapshot as the replica endpoint sends it; ``seq``: the last event published."""
        return {"seq": seq, "requests": [[rid, *entry] for rid, entry in self._live.items()]}


class PeerRequest:
    """A peer's in-flight request as this replica counts it."""

    __slots__ = ("at", "prefill", "route", "seq")

    def __init__(self, route: Route, prefill: tuple[Candidate, int] | None, at: float,
                 seq: int) -> None:
        self.route = route
        self.prefill = prefill
        self.at = at
        self.seq = seq  # the event (ADD, or a snapshot's last) it was counted from


class Peer:
    """One other replica: its in-flight requests and what its events said since a snapshot
    was asked for."""

    def __init__(self, iid: int, endpoint: str) -> None:
        self.iid = iid
        self.endpoint = endpoint
        self.res: Resources | None = None  # the SUB socket, the receiver
        self.requests: dict[int, PeerRequest] = {}
        self.last_seq: int | None = None
        self.asking = False  # a snapshot is asked for: note FREEs and PREFILLEDs of unknown ids
        self.asked_at = -float("inf")  # when one was last asked for (monotonic seconds)
        self.asked_seq: int | None = None  # the last event heard then
        self.freed: dict[int, int] = {}  # request id -> seq of its FREE
        self.prefilled: dict[int, int] = {}  # request id -> seq of its PREFILLED
        #: Requests (from an ADD or a snapshot) on a worker this router has not found yet: a
        #: peer can know a worker first. id -> (entry, seq, when heard); counted once the
        #: worker is known (``take_known``), dropped on their FREE or past the TTL.
        self.waiting: dict[int, tuple[Entry, int, float]] = {}

    def wait(self, rid: int, entry: Entry, seq: int, now: float) -> None:
        """Hold ``rid`` until its worker is known."""
        self.waiting[rid] = (entry, seq, now)

    def take_known(self, known: Callable[[int], bool]) -> list[tuple[int, Entry, int]]:
        """Take out the waiting requests whose worker is ``known`` now: (id, entry, seq)."""
        ready = [rid for rid, (entry, _, _) in self.waiting.items() if known(entry[0])]
        return [(rid, *self.waiting.pop(rid)[:2]) for rid in ready]

    def ended(self, rid: int) -> None:
        """``rid``'s FREE: it no longer waits for its worker."""
        self.waiting.pop(rid, None)

    def prefill_done(self, rid: int) -> None:
        """``rid``'s PREFILLED while it waits for its worker: it counts no prefill tokens."""
        held = self.waiting.get(rid)
        if held is not None:
            entry, seq, at = held
            self.waiting[rid] = ((*entry[:4], 0), seq, at)

    def ask(self, now: float) -> None:
        """A snapshot is asked for now."""
        self.asking, self.asked_at, self.asked_seq = True, now, self.last_seq

    def resync_due(self, now: float, after: float) -> bool:
        """Whether to ask for a snapshot again: one of the requests has counted ``after``
        seconds (its FREE may be lost) and none was asked for in the last ``after`` seconds."""
        return (not self.asking and now - self.asked_at >= after
                and any(req.at <= now - after for req in self.requests.values()))

    def expire(self, horizon: float) -> list[PeerRequest]:
        """Take out and return the requests counted before ``horizon`` (the TTL's)."""
        for rid in [rid for rid, (_, _, at) in self.waiting.items() if at < horizon]:
            del self.waiting[rid]
        old = [rid for rid, req in self.requests.items() if req.at < horizon]
        return [self.requests.pop(rid) for rid in old]

    def heard(self, kind: str, rid: int, seq: int) -> None:
        """A FREE or PREFILLED heard: noted while a snapshot is asked for (it may be older)."""
        if self.asking:
            (self.freed if kind == "free" else self.prefilled)[rid] = seq

    def give_up(self) -> None:
        """No snapshot is coming: count from the events alone."""
        self.asking = False
        self.freed.clear()
        self.prefilled.clear()

    def reconcile(self, snap: Snapshot
                  ) -> tuple[list[PeerRequest], list[PeerRequest], dict[int, Entry]]:
        """What ``snap`` changes (module docstring): the requests to release (already taken out
        of ``requests``), those whose prefill is done (their PREFILLED was missed), and those
        to add (their prefill zeroed if it was done since)."""
        gone = [rid for rid, req in self.requests.items()
                if req.seq <= snap.seq and rid not in snap.requests]
        released = [self.requests.pop(rid) for rid in gone]
        for rid in [rid for rid, (_, seq, _) in self.waiting.items()
                    if seq <= snap.seq and rid not in snap.requests]:
            del self.waiting[rid]
        prefilled: list[PeerRequest] = []
        new: dict[int, Entry] = {}
        for rid, entry in snap.requests.items():
            known = self.requests.get(rid)
            if known is not None:
                if known.prefill is not None and entry[4] == 0:
                    prefilled.append(known)
                continue
            if self.freed.get(rid, -1) > snap.seq:
                continue
            if self.prefilled.get(rid, -1) > snap.seq:
                entry = (*entry[:4], 0)
            new[rid] = entry
        self.give_up()  # (the snapshot is in)
        if self.last_seq is None or self.last_seq < snap.seq:
            self.last_seq = snap.seq
        return released, prefilled, new
