"""Router replica snapshots (``router/_replica_snapshot.py``): a replica that starts hearing a
peer's events late, and gets the peer's snapshot at any point, counts exactly the peer's
requests in flight, neither missing one nor counting one twice; and a snapshot's parser takes
any answer without raising anything but ``SnapshotError``.

The property test drives ``ReplicaSync.handle`` and ``ReplicaSync.apply_snapshot`` (the code a
running router calls) with a peer's real event encoding and the snapshots of the publisher's own
bookkeeping (``OwnRequests``); tests/test_router_replicas.py shows the same through processes."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_zmq.resources import Resources
from router._replica_snapshot import OwnRequests, Peer, Snapshot, SnapshotError
from router._replica_wire import (
    ADD,
    FREE,
    PREFILLED,
    REPLICA_TOPIC,
    REPLICA_VERSION,
    ReplicaEvent,
    encode_event,
    pack_hashes,
)
from router.busy import PrefillTokens
from router.metrics import RouterMetrics
from router.replica_sync import ReplicaSync
from router.scheduler import LoadTracker

PEER = 0xABC
WORKERS = (11, 12)

# An op: ("add", worker index, blocks, extra blocks, prefill tokens), or ("prefilled" | "free",
# which earlier add it names, as an index into the adds so far).
_add = st.tuples(st.just("add"), st.integers(0, 1), st.integers(1, 4), st.integers(0, 3),
                 st.sampled_from([0, 0, 16, 64]))
_ref = st.tuples(st.sampled_from(["prefilled", "free"]), st.integers(0, 30))


def _events(ops: list[tuple[Any, ...]]) -> tuple[list[ReplicaEvent], list[Snapshot],
                                                   OwnRequests]:
    """The peer's events (seq 0..n-1) and its snapshot as of each (index i: seq i - 1)."""
    own = OwnRequests()
    events: list[ReplicaEvent] = []
    snaps = [Snapshot.parse(own.snapshot(-1))]
    adds: list[int] = []
    live: set[int] = set()
    for op in ops:
        seq = len(events)
        if op[0] == "add":
            rid = 100 + seq
            _, w, blocks, extra, prefill = op
            hashes = pack_hashes([rid * 1000 + b for b in range(blocks)])
            entry = (WORKERS[w], 0, hashes, extra, prefill)
            own.add(rid, entry)
            adds.append(rid)
            live.add(rid)
            events.append(ReplicaEvent(REPLICA_VERSION, ADD, PEER, seq, rid, *entry))
        else:
            if not adds:
                continue
            rid = adds[op[1] % len(adds)]
            if rid not in live:
                continue
            if op[0] == "free":
                own.free(rid)
                live.discard(rid)
                events.append(ReplicaEvent(REPLICA_VERSION, FREE, PEER, seq, rid))
            else:
                own.prefilled(rid)
                events.append(ReplicaEvent(REPLICA_VERSION, PREFILLED, PEER, seq, rid))
        snaps.append(Snapshot.parse(own.snapshot(seq)))
    return events, snaps, own


def _sync(known: set[int] | None = None) -> tuple[ReplicaSync, LoadTracker, PrefillTokens]:
    """A replica following ``PEER``, with ``known`` the workers it has found (default: all)."""
    loads, prefill = LoadTracker(), PrefillTokens()
    found = set(WORKERS) if known is None else known
    sync = ReplicaSync(None, Resources("test"), "dyn://ns.backend.generate",  # type: ignore[arg-type]
                       "tiny", loads, prefill, found.__contains__, RouterMetrics())
    sync._peers[PEER] = Peer(PEER, "tcp://127.0.0.1:1")
    return sync, loads, prefill


def _send(sync: ReplicaSync, ev: ReplicaEvent) -> None:
    sync.handle(PEER, [REPLICA_TOPIC, encode_event(ev)])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(_add, _ref), max_size=30), data=st.data())
def test_a_late_joiner_counts_exactly_the_peers_requests(ops, data) -> None:
    events, snaps, own = _events(ops)
    n = len(events)
    # The joiner hears events from ``first`` on (the earlier ones went before its subscription
    # was live); the snapshot is as of event ``at`` - 1, never older than the first event heard
    # minus one (else what lies between is lost: a gap, and another snapshot); it is applied
    # after the events up to ``applied`` - 1 arrived (earlier or later than ``at``).
    first = data.draw(st.integers(0, n), label="first")
    at = data.draw(st.integers(max(first, 0), n), label="snapshot as of")
    applied = data.draw(st.integers(first, n), label="applied after")
    sync, loads, prefill = _sync()
    peer = sync._peers[PEER]
    peer.asking = True  # as _ask_snapshot sets it when it subscribes
    for ev in events[first:applied]:
        _send(sync, ev)
    sync.apply_snapshot(PEER, snaps[at])
    for ev in events[applied:]:
        _send(sync, ev)

    _assert_counts_exactly(sync, loads, prefill, own, n)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(_add, _ref), max_size=30), data=st.data())
def test_a_joiner_that_finds_a_worker_after_its_peer_still_counts_its_requests(ops, data) -> None:
    """The race behind the late-join flake: the peer's requests on a worker this replica has
    not found yet (from the snapshot or from ADDs) wait for it, and count once it is found,
    whenever that is; those that ended meanwhile never count."""
    events, snaps, own = _events(ops)
    n = len(events)
    at = data.draw(st.integers(0, n), label="snapshot as of")
    found_after = data.draw(st.integers(0, n), label="worker found after event")
    known: set[int] = {WORKERS[1]}  # WORKERS[0] is found late
    sync, loads, prefill = _sync(known)
    peer = sync._peers[PEER]
    peer.asking = True
    for i, ev in enumerate(events[at:], start=at):
        if i == found_after:
            known.add(WORKERS[0])
            sync.count_found()
        if i == at:
            sync.apply_snapshot(PEER, snaps[at])
        _send(sync, ev)
    if at == n:
        sync.apply_snapshot(PEER, snaps[at])
    known.add(WORKERS[0])
    sync.count_found()

    _assert_counts_exactly(sync, loads, prefill, own, n)


def _assert_counts_exactly(sync: ReplicaSync, loads: LoadTracker, prefill: PrefillTokens,
                           own: OwnRequests, n: int) -> None:
    """The replica counts exactly the peer's requests in flight after its ``n`` events, once
    each, with their prefill state and load; their FREEs then leave nothing counted."""
    peer = sync._peers[PEER]
    truth = own.snapshot(n - 1)["requests"]
    assert set(peer.requests) == {r[0] for r in truth}
    for rid, worker, rank, _, _, tokens in truth:
        req = peer.requests[rid]
        assert req.route.candidate == (worker, rank)
        assert (req.prefill is not None) == (tokens > 0)
    # The load and prefill counts are those of exactly these requests, each counted once.
    expected, pending = LoadTracker(), PrefillTokens()
    for rid, worker, rank, hashes, extra, tokens in truth:
        expected.add((worker, rank), [rid * 1000 + b for b in range(len(hashes) // 8)], extra)
        pending.add((worker, rank), tokens)
    for c in ((w, 0) for w in WORKERS):
        assert loads.total_blocks(c) == expected.total_blocks(c)
        assert prefill.get(c) == pending.get(c)
    # Their FREEs leave nothing counted.
    for i, r in enumerate(truth):
        _send(sync, ReplicaEvent(REPLICA_VERSION, FREE, PEER, n + i, r[0]))
    assert not peer.requests and not sync._blocks
    assert all(loads.total_blocks((w, 0)) == 0 and prefill.get((w, 0)) == 0 for w in WORKERS)


def test_a_snapshot_older_than_a_heard_free_does_not_count_it_again() -> None:
    """The FREE of a request the joiner never saw added arrives before a snapshot taken while
    that request was still in flight: the snapshot must not bring it back."""
    ops = [("add", 0, 2, 1, 16), ("free", 0)]
    events, snaps, _ = _events(ops)
    sync, loads, _ = _sync()
    peer = sync._peers[PEER]
    peer.asking = True
    _send(sync, events[1])  # the FREE (seq 1); the ADD (seq 0) was missed
    sync.apply_snapshot(PEER, snaps[1])  # as of seq 0: the request in flight
    assert not peer.requests and loads.total_blocks((WORKERS[0], 0)) == 0
    assert peer.last_seq == 1 and not peer.asking


def test_a_snapshot_releases_a_request_whose_free_was_missed() -> None:
    ops = [("add", 1, 3, 0, 0), ("add", 0, 1, 0, 0), ("free", 0)]
    events, snaps, _ = _events(ops)
    sync, loads, _ = _sync()
    peer = sync._peers[PEER]
    for ev in events[:2]:
        _send(sync, ev)
    assert set(peer.requests) == {100, 101}
    sync.apply_snapshot(PEER, snaps[3])  # as of the lost FREE (seq 2)
    assert set(peer.requests) == {101} and loads.total_blocks((WORKERS[1], 0)) == 0


_answer = st.recursive(
    st.none() | st.booleans() | st.integers() | st.binary(max_size=24) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=7) | st.dictionaries(
        st.sampled_from(["seq", "requests", "x"]), inner, max_size=3),
    max_leaves=20)


@settings(max_examples=500, deadline=None)
@given(_answer)
def test_any_answer_parses_or_raises_snapshot_error(answer: Any) -> None:
    try:
        snap = Snapshot.parse(answer)
    except SnapshotError:
        return
    assert type(snap.seq) is int
    for entry in snap.requests.values():
        assert len(entry) == 5 and len(entry[2]) % 8 == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(_add, _ref), max_size=30), data=st.data())
def test_a_resync_after_lost_events_counts_exactly_the_peers_requests(ops, data) -> None:
    """A replica following a peer loses a run of its events (a FREE with no later event shows
    no gap); the snapshot it asks for later, applied whenever it comes, restores the count."""
    events, snaps, own = _events(ops)
    n = len(events)
    lost_from = data.draw(st.integers(0, n), label="lost from")
    lost_to = data.draw(st.integers(lost_from, n), label="lost up to")
    at = data.draw(st.integers(lost_to, n), label="snapshot as of")
    applied = data.draw(st.integers(lost_to, n), label="applied after")
    sync, loads, prefill = _sync()
    peer = sync._peers[PEER]
    for ev in events[:lost_from]:
        _send(sync, ev)
    peer.ask(0.0)  # the resync: asked after the last event heard
    for ev in events[lost_to:applied]:
        _send(sync, ev)
    sync.apply_snapshot(PEER, snaps[at])
    for ev in events[applied:]:
        _send(sync, ev)
    _assert_counts_exactly(sync, loads, prefill, own, n)


def test_a_request_counted_long_prompts_one_resync_per_interval() -> None:
    ops = [("add", 0, 2, 0, 0)]
    events, _, _ = _events(ops)
    sync, _, _ = _sync()
    peer = sync._peers[PEER]
    assert not peer.resync_due(1e9, 60.0)  # nothing counted
    _send(sync, events[0])
    at = peer.requests[100].at
    assert not peer.resync_due(at + 59.0, 60.0)
    assert peer.resync_due(at + 60.0, 60.0)
    peer.ask(at + 60.0)
    assert not peer.resync_due(at + 200.0, 60.0)  # one is asked for
    peer.give_up()
    assert not peer.resync_due(at + 119.0, 60.0) and peer.resync_due(at + 120.0, 60.0)
    assert peer.expire(at) == [] and len(peer.expire(at + 1.0)) == 1 and not peer.requests
