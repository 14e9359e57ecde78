"""The KV-event publisher: a PUB socket sending ``[topic, seq, payload]`` (vLLM's frames), a ring
buffer of recent batches, and a replay ROUTER that resends missed batches on request.

Replay protocol (vLLM's): a DEALER sends ``[b"", start_seq as 8-byte big-endian]``; the answer is
one message ``[b"", topic, seq, payload]`` per buffered batch with ``seq >= start_seq``, in
order, then the end marker ``[b"", b"", b"\\xff" * 8, b""]``.

Full dump (our extension): ``start_seq = SNAPSHOT_SEQ`` (``0xff..fe``) is answered with batches
that store every block the published events leave held (``KvStateMirror``), per rank, each
first clearing the rank, all carrying the seq of the last published batch (the state is the one
after it), then the end marker. Nothing published yet: only the end marker. A publisher without
the extension (vLLM's) answers the same request with the end marker alone (no kept seq reaches
that high), so a router falls back to replaying from seq 0.

Form (``KvHashScheme.form``, ``--kv-event-form``): ``"stores"`` publishes the events as given;
``"deltas"`` publishes their own-hash deltas (``OwnBatch``, ``EdgeKvState``), a batch that
changes no own hash not at all; replays and full dumps are in the same form.
"""

from __future__ import annotations

import collections
import logging

import zmq

from dynamo_zmq.llm._block_hashing import FORM_STORES
from dynamo_zmq.llm._kv_forms import EdgeKvState
from dynamo_zmq.resources import Resources
from dynamo_zmq.transport import AsyncSocket, BadInput, Domain, SendResult, make_socket

from ._kv_events import KvEvent
from ._kv_mirror import KvStateMirror

__all__ = ["END_SEQ", "SNAPSHOT_SEQ", "TOPIC", "KvEventPublisher"]

log = logging.getLogger(__name__)

TOPIC = b"kv-events"
#: Seq frame of the replay end marker (-1 as a signed 8-byte big-endian integer).
END_SEQ = b"\xff" * 8
#: Start seq of a full-dump request (-2 as u64).
SNAPSHOT_SEQ = 0xFFFFFFFFFFFFFFFE
#: PUB drops silently beyond its high-water mark; vLLM uses 100k.
PUB_HWM = 100_000
#: Seconds a replay waits for a client that does not read before giving up on it.
REPLAY_SEND_TIMEOUT = 5.0


class KvEventPublisher:
    """Publishes KV-event batches and serves replays. One owner of both sockets and the task."""

    def __init__(self, bind_host: str = "*", events_port: int = 0, replay_port: int = 0,
                 buffer_size: int = 10_000, topic: bytes = TOPIC,
                 form: str = FORM_STORES) -> None:
        self._bind_host = bind_host
        self._ports = (events_port, replay_port)
        self.topic = topic
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_size)
        self._next_seq = 0
        #: What the published events leave held, in the published form, for full dumps.
        self.state = EdgeKvState(form)
        self._res: Resources | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: AsyncSocket | None = None
        self.events_port = 0
        self.replay_port = 0
        self.dropped = 0
        #: Malformed replay requests: counted, logged at most once per 10 s.
        self.bad_input = BadInput(log)

    @property
    def mirror(self) -> KvStateMirror:
        """The held blocks (followed in the stores form only)."""
        return self.state.mirror

    @property
    def next_seq(self) -> int:
        """The seq the next published batch will carry."""
        return self._next_seq

    async def start(self) -> None:
        """Bind both sockets and start serving replays."""
        if self._res is not None:
            raise RuntimeError("publisher already started")
        self._res = res = Resources("mocker-kv-publisher")
        res.on_close(self._close_sockets)
        try:
            self._pub = make_socket(
                res.zctx, zmq.PUB, bind=self._endpoint(self._ports[0]), hwm=PUB_HWM,
                zap_domain=Domain.KV_EVENTS,
            )
            self.events_port = _bound_port(self._pub)
            replay = make_socket(
                res.zctx, zmq.ROUTER, bind=self._endpoint(self._ports[1]), hwm=PUB_HWM,
                zap_domain=Domain.KV_EVENTS,
            )
            self._replay = AsyncSocket(replay)
            self.replay_port = _bound_port(replay)
        except BaseException:
            await self.close()
            raise
        res.spawn(self._serve_replay(), "mocker-kv-replay")

    def _endpoint(self, port: int) -> str:
        return f"tcp://{self._bind_host}:{port}"

    def publish(self, events: list[KvEvent], dp_rank: int) -> int | None:
        """Send one batch now (never blocks) and keep it for replay; returns its seq (None: in
        deltas form, the events changed no own hash and nothing was sent)."""
        payload = self.state.live(events, dp_rank)
        if payload is None:
            return None
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        if self._pub is not None:
            try:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                # Subscribers see the gap in seq and recover it through replay.
                self.dropped += 1
                if not isinstance(exc, zmq.Again):
                    log.warning("KV event batch %d not sent: %s", seq, exc)
        return seq

    async def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        while not sock.closed:
            await sock.wait_readable()
            while (frames := sock.recv_nowait()) is not None:
                try:
                    await self._answer(sock, frames)
                except zmq.ZMQError as exc:
                    if sock.closed:
                        return
                    log.warning("KV replay failed: %s", exc)

    async def _answer(self, sock: AsyncSocket, frames: list[bytes]) -> None:
        # [identity, b"", start_seq] from a DEALER; [identity, start_seq] without the delimiter.
        if (
            len(frames) not in (2, 3)
            or (len(frames) == 3 and frames[1] != b"")
            or len(frames[-1]) != 8
        ):
            self.bad_input.note("kv_replay_request", "ignoring malformed KV replay request: %.200r",
                                frames[:4])
            return
        identity, prefix = frames[0], [frames[0], b""] if len(frames) == 3 else [frames[0]]
        start = int.from_bytes(frames[-1], "big")
        if start == SNAPSHOT_SEQ:
            replies = self._snapshot(prefix)
        else:
            replies = [[*prefix, self.topic, seq.to_bytes(8, "big"), payload]
                       for seq, payload in self._buffer if seq >= start]
        replies.append([*prefix, b"", END_SEQ, b""])
        for reply in replies:
            result = await sock.send(reply, timeout=REPLAY_SEND_TIMEOUT)
            if result != SendResult.SENT:
                log.info("KV replay to %r abandoned (%s)", identity,
                         "gone" if result == SendResult.GONE else "stalled")
                return

    def _snapshot(self, prefix: list[bytes]) -> list[list[bytes]]:
        if self._next_seq == 0:
            return []
        seq = (self._next_seq - 1).to_bytes(8, "big")
        return [[*prefix, self.topic, seq, payload] for payload in self.state.snapshot()]

    async def close(self) -> None:
        """Stop the replay task and close the sockets (idempotent)."""
        if self._res is not None:
            await self._res.close()

    def _close_sockets(self) -> None:
        if self._replay is not None:
            self._replay.close()
            self._replay = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None


def _bound_port(sock: zmq.Socket[bytes]) -> int:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    text = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
    return int(text.rsplit(":", 1)[1])
