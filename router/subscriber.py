"""``KvEventSubscriber``: one worker's KV events into the router's index, gap-free or not at all.

A worker's engine publishes ``[topic, seq (u64 BE), payload]`` on a PUB socket and keeps recent
batches for replay on a ROUTER socket (vLLM's protocol: a DEALER sends ``[b"", start_seq]`` and
gets ``[b"", topic, seq, payload]`` per kept batch, then ``seq = 0xffffffffffffffff``).

Policy:

* **Baseline.** With a replay endpoint, the SUB socket connects first (nothing published from
  then on is missed), then it asks for a full dump (``SNAPSHOT_SEQ``): our publishers answer
  with batches storing every block they hold now, all carrying the seq ``S`` of their last
  batch; they replace the worker's state and ``S`` is the baseline. A router (re)started after
  the engine cached prefixes knows all of them at once, and none that were removed. Without
  dumps (vLLM's publisher answers the end marker alone) it replays from seq 0; if the engine no
  longer keeps seq 0 the state is rebuilt from the batches it does get. Without a replay
  endpoint the first message seen is the baseline. Without a dump the index may miss blocks
  stored before what it saw (fewer matches, never wrong ones).
* **Gaps.** Live batch ``seq > last + 1``: replay from ``last + 1`` and apply the missed batches
  in order before the live one. If that fails (no replay endpoint, timeout, the engine's buffer
  no longer reaches back) the state is dropped (``indexer.remove_worker``) and rebuilt from
  what arrives; a missed ``BlockRemoved`` would otherwise leave blocks the engine no longer
  holds in the index forever.
* **Duplicates.** ``seq <= last`` (live batches already replayed) are skipped. A restarted engine
  is a new worker instance (new id), so seqs never go back within one subscriber.
* Undecodable batches are counted and skipped (their seq still counts as seen).

The receive loop drains the socket with non-blocking reads and awaits readiness only when it is
empty. ``close`` (the worker left discovery or liveness) stops it and drops the worker's state.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Protocol

import zmq

from dynamo_zmq import errors
from dynamo_zmq.resources import Resources, wait_event
from dynamo_zmq.transport import AsyncSocket, BadInput, make_socket, peer_key

from ._own_events import pick_decoder
from ._replay import END_SEQ, SNAPSHOT_SEQ, MalformedReplay, fetch_replay
from .events import EventBatch, EventDecodeError, OwnBatch
from .metrics import RouterMetrics

__all__ = ["END_SEQ", "SNAPSHOT_SEQ", "KvEventSubscriber", "SubscriberStats"]

log = logging.getLogger(__name__)

#: Receive high-water mark: PUB drops silently beyond it (vLLM's publisher uses 100k too).
SUB_HWM = 200_000
#: Largest KV-event batch decoded, in bytes. A batch storing a 1M-token prompt is ~5 MiB; a
#: bigger one is skipped like an undecodable one (its blocks are not indexed, which only costs
#: cache hits), so a runaway publisher cannot make the router decode gigabytes into Python ints.
#: (ZMQ_MAXMSGSIZE is no substitute: libzmq then drops the connection for good, no reconnect.)
MAX_BATCH_BYTES = 32 << 20
#: Most bytes one replay may bring (vLLM keeps 10k batches for replay); beyond it the replay
#: counts as failed, like one that times out.
MAX_REPLAY_BYTES = 256 << 20
#: Seconds a replay may take before it counts as failed.
REPLAY_TIMEOUT = 3.0
#: Messages handled between two yields to the event loop under a flood.
YIELD_EVERY = 2000


class Index(Protocol):
    def apply_batch(self, worker_id: int, batch: EventBatch | OwnBatch) -> object: ...
    def remove_worker(self, worker_id: int) -> object: ...


class SubscriberStats:
    """Plain counters of one subscriber (the Prometheus ones aggregate per model)."""

    __slots__ = ("applied", "decode_errors", "duplicates", "edge_hashed_blocks", "gaps",
                 "received", "replays_failed", "replays_ok", "snapshots", "state_drops")

    def __init__(self) -> None:
        self.received = 0  # live messages received on the SUB socket
        self.applied = 0  # batches applied to the index (live or replayed)
        self.decode_errors = self.duplicates = self.gaps = 0
        self.replays_ok = self.replays_failed = self.state_drops = 0
        self.snapshots = 0  # full dumps applied (the baseline at start)
        self.edge_hashed_blocks = 0  # blocks stored with their worker's own hashes, tokens unread

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)}" for k in self.__slots__)
        return f"SubscriberStats({fields})"


class KvEventSubscriber:
    """Follows one publisher (worker instance) and applies its batches to ``indexer``.

    Args:
        owner: the resources this subscriber's task and sockets hang under (the router's).
        worker_id: the worker's instance id (the index key's first half).
        events_endpoint: the engine's ``kv_events_endpoint`` (PUB).
        indexer: the index to feed (``apply_batch``, ``remove_worker``).
        replay_endpoint: the engine's ``kv_replay_endpoint`` (ROUTER), if any.
        metrics: shared router metrics; ``model`` labels them.
        replay_timeout: seconds before a replay counts as failed.
        max_batch_bytes: batches with a bigger payload (live or replayed) are skipped, counted
            as decode errors.
        max_replay_bytes: a replay bringing more counts as failed.
        edge_hashed: the worker declared the router's hash scheme: take the ``own_hashes`` of
            its events (``decode_edge_batch``) instead of hashing their tokens.
        deltas: with ``edge_hashed``, its payloads are own-hash deltas (``decode_own_batch``).
    """

    def __init__(
        self,
        owner: Resources,
        worker_id: int,
        events_endpoint: str,
        indexer: Index,
        *,
        replay_endpoint: str | None = None,
        metrics: RouterMetrics | None = None,
        model: str = "",
        replay_timeout: float = REPLAY_TIMEOUT,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        max_replay_bytes: int = MAX_REPLAY_BYTES,
        edge_hashed: bool = False,
        deltas: bool = False,
    ) -> None:
        self._owner = owner
        self._res: Resources | None = None
        self._max_batch_bytes = max_batch_bytes
        self._max_replay_bytes = max_replay_bytes
        self.worker_id = worker_id
        self.edge_hashed, self.deltas = edge_hashed, deltas
        self._decode = pick_decoder(edge_hashed, deltas)
        self.events_endpoint = events_endpoint
        self.replay_endpoint = replay_endpoint
        self._indexer = indexer
        self._metrics = metrics
        self._model = model
        self._replay_timeout = replay_timeout
        #: Seq of the last batch accounted for; None: no baseline yet.
        self.last_seq: int | None = None
        self.stats = SubscriberStats()
        #: Undecodable input from the worker: logged at most once per 10 s per kind.
        self._bad_input = BadInput(log)
        self._sock: AsyncSocket | None = None
        self._task: asyncio.Task[None] | None = None
        self._progress = asyncio.Event()
        self._closed = False

    def __repr__(self) -> str:
        return (f"KvEventSubscriber({self.worker_id:x}, {self.events_endpoint}, "
                f"last_seq={self.last_seq})")

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Connect and start following (needs a running event loop; returns at once)."""
        if self._sock is not None or self._closed:
            raise RuntimeError("subscriber already started or closed")
        sock = make_socket(self._owner.zctx, zmq.SUB, hwm=SUB_HWM, heartbeat_ms=0,
                           server_key=peer_key(self.worker_id))
        try:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(self.events_endpoint)
            self._sock = async_sock = AsyncSocket(sock)
        except BaseException:
            sock.close(linger=0)
            raise
        self._res = res = self._owner.child(f"kv-events {self.worker_id:x}")
        res.on_close(async_sock.close)  # after the task has ended
        self._task = res.spawn(self._run(), f"kv-events-{self.worker_id:x}")

    async def close(self, drop_state: bool = True) -> None:
        """Stop following; with ``drop_state`` the worker's blocks leave the index. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._task = None
        try:
            if self._res is not None:
                await self._res.close()
        finally:
            self._progress.set()
            if drop_state:
                self._indexer.remove_worker(self.worker_id)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def wait_for_seq(self, seq: int, timeout: float = 5.0) -> bool:
        """True once every batch up to ``seq`` is accounted for; False after ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.last_seq is None or self.last_seq < seq:
            remaining = deadline - loop.time()
            if remaining <= 0 or self._closed:
                return False
            self._progress.clear()
            await wait_event(self._progress, remaining)
        return True

    # -- the receive loop ------------------------------------------------------------------

    async def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        try:
            if self.replay_endpoint is not None and not await self._snapshot():
                await self._recover(None)  # the history from seq 0 (see the module docstring)
            handled = 0
            while not sock.closed:
                frames = sock.recv_nowait()
                if frames is None:
                    self._progress.set()
                    await sock.wait_readable()
                    continue
                if not self._on_live(frames):
                    await self._recover(frames)
                handled += 1
                if handled % YIELD_EVERY == 0:
                    self._progress.set()
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV event subscriber of worker %x failed; dropping its state",
                          self.worker_id)
            self._drop_state()

    def _on_live(self, frames: list[bytes]) -> bool:
        """Handle one live message; False when it reveals a gap (left for ``_recover``)."""
        self.stats.received += 1
        seq = _seq_of(frames)
        if seq is None:
            self._count_decode_error("malformed KV event message (%d frames)", len(frames))
            return True
        last = self.last_seq
        if last is not None and seq != last + 1:
            if seq <= last:
                self.stats.duplicates += 1
                return True
            return False
        if last is None and seq > 0 and self.replay_endpoint is not None:
            return False  # history before it exists: replay from 0 first
        self._apply(seq, frames[2], live=True)
        return True

    async def _recover(self, pending: list[bytes] | None) -> None:
        """Replay from ``last_seq + 1`` (or 0), then handle ``pending`` (the live message that
        showed the gap); drop the state if the gap stays open."""
        start = 0 if self.last_seq is None else self.last_seq + 1
        pending_seq = _seq_of(pending) if pending is not None else None
        if pending is not None:
            self.stats.gaps += 1
            if self._metrics is not None:
                self._metrics.gaps.labels(self._model).inc()
            log.info("worker %x: KV events %d..%s missed; replaying", self.worker_id, start,
                     pending_seq - 1 if pending_seq is not None else "?")
        replayed = await self._replay(start) if self.replay_endpoint is not None else None
        ok = replayed is not None and _closes(replayed, start, pending_seq)
        if ok:
            self._count_replay("ok")
        elif self.replay_endpoint is not None:
            self._count_replay("failed")
        if not ok and (pending is not None or replayed):
            self._drop_state()
        for seq, payload in replayed or ():
            self._accept(seq, payload)
        if pending is not None and pending_seq is not None:
            self._accept(pending_seq, pending[2], live=True)
        self._progress.set()

    def _accept(self, seq: int, payload: bytes, live: bool = False) -> None:
        """Apply a batch in a run being rebuilt: next in line, a duplicate, or a new baseline
        after another hole (which drops the state again)."""
        last = self.last_seq
        if last is not None and seq <= last:
            self.stats.duplicates += 1
            return
        if last is not None and seq != last + 1:
            self.stats.gaps += 1
            self._drop_state()
        self._apply(seq, payload, live)

    def _apply(self, seq: int, payload: bytes, live: bool) -> None:
        self.last_seq = seq
        if len(payload) > self._max_batch_bytes:
            self._count_decode_error(
                "KV event batch %d is %d bytes, over the %d-byte limit: skipped",
                seq, len(payload), self._max_batch_bytes,
            )
            return
        try:
            batch, edge = self._decode(payload)
        except EventDecodeError as exc:
            self._count_decode_error("undecodable KV event batch %d: %s", seq, exc)
            return
        self._indexer.apply_batch(self.worker_id, batch)
        self.stats.applied += 1
        self.stats.edge_hashed_blocks += edge
        m = self._metrics
        if m is not None:
            m.event_batches.labels(self._model).inc()
            m.event_bytes.labels(self._model).inc(len(payload))
            if edge:
                m.edge_hashed_blocks.labels(self._model).inc(edge)
            lag = time.time() - batch.ts
            if live and math.isfinite(lag):  # a NaN or infinite ts would poison the sum for good
                m.event_lag.labels(self._model).observe(max(0.0, lag))

    def _drop_state(self) -> None:
        self._indexer.remove_worker(self.worker_id)
        self.last_seq = None
        self.stats.state_drops += 1
        if self._metrics is not None:
            self._metrics.state_drops.labels(self._model).inc()
        log.warning("worker %x: KV event state dropped; rebuilding from new events", self.worker_id)

    def _count_decode_error(self, msg: str, *args: object, kind: str = "kv_event") -> None:
        self.stats.decode_errors += 1
        if self._metrics is not None:
            self._metrics.decode_errors.labels(self._model).inc()
        self._bad_input.note(kind, "worker %x: " + msg, self.worker_id, *args)

    def _count_replay(self, result: str) -> None:
        if result == "ok":
            self.stats.replays_ok += 1
        else:
            self.stats.replays_failed += 1
        if self._metrics is not None:
            self._metrics.replays.labels(self._model, result).inc()

    # -- replay ----------------------------------------------------------------------------

    async def _snapshot(self) -> bool:
        """Ask for a full dump; True once one replaced the worker's state (``last_seq`` is then
        the dump's seq). False (state untouched) when the publisher has none or it failed."""
        if self.replay_endpoint is None:
            return False
        got = await self._replay(SNAPSHOT_SEQ, same_seq=True)
        if not got:
            return False
        seq = got[0][0]
        if self.last_seq is not None and seq <= self.last_seq:
            return False  # older than what is applied already: not a dump of the present
        self._indexer.remove_worker(self.worker_id)
        for _, payload in got:
            self._apply(seq, payload, live=False)
        self.stats.snapshots += 1
        if self._metrics is not None:
            self._metrics.replays.labels(self._model, "snapshot").inc()
        log.info("worker %x: KV state rebuilt from a full dump (%d batch%s, seq %d)",
                 self.worker_id, len(got), "es"[: 2 * (len(got) > 1)], seq)
        return True

    async def _replay(self, start: int, same_seq: bool = False) -> list[tuple[int, bytes]] | None:
        """The kept batches from ``start`` on, in order; None if the replay failed.
        ``same_seq``: a dump, whose batches all carry one seq."""
        assert self.replay_endpoint is not None
        # A fresh DEALER per replay: a late answer to an abandoned one can never be mistaken
        # for this one's.
        try:
            sock = AsyncSocket(make_socket(
                self._owner.zctx, zmq.DEALER, connect=self.replay_endpoint, hwm=SUB_HWM,
                heartbeat_ms=0, server_key=peer_key(self.worker_id),
            ))
        except (zmq.ZMQError, errors.CannotConnect) as exc:
            # e.g. vLLM's bind form tcp://*:N advertised by mistake, or its key not authorized
            log.warning("worker %x advertises KV replay at %r, which the router cannot connect to "
                        "(%s): following its events without replay", self.worker_id,
                        self.replay_endpoint, exc)
            self.replay_endpoint = None
            return None
        try:
            return await fetch_replay(sock, self.worker_id, start, self._replay_timeout,
                                      self._max_replay_bytes, same_seq)
        except MalformedReplay as exc:
            self._count_decode_error("malformed KV replay message (%d frames)", exc.frames,
                                     kind="kv_replay")
            return None
        finally:
            sock.close()


def _closes(replayed: list[tuple[int, bytes]], start: int, pending_seq: int | None) -> bool:
    """Does a (contiguous) replay reach back to ``start`` and forward to the live message?"""
    if not replayed:
        return pending_seq is None  # nothing kept and nothing known to be missing
    return replayed[0][0] == start and (pending_seq is None or replayed[-1][0] >= pending_seq - 1)


def _seq_of(frames: list[bytes] | None) -> int | None:
    if frames is None or len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big")
