"""vLLM's KV events stay on loopback and reach routers through sockets of ours.

vLLM's engine core publishes KV events from sockets it makes itself, in plaintext. Whenever KV
events are on, the adapter points them at loopback: vLLM's PUB connects to a SUB of ours on
``127.0.0.1`` (vLLM binds only wildcard endpoints and connects to others) and its replay ROUTER
binds ``127.0.0.1``. ``KvRelay`` republishes each data-parallel rank's events, with vLLM's
sequence numbers, on a PUB of ours and answers replays on a ROUTER of ours, both bound where
vLLM's own sockets would be (``--kv-events-port`` / ``--kv-replay-port``): CURVE with
``--auth-keys``, plaintext (as vLLM's are) without. The live events are hashed at the edge
(``_edge.py``, the router's own block hashes, declared as ``EngineConfig.kv_hash_scheme``) and
published in the configured form (``--kv-event-form``, ``EdgeKvState``): ``stores`` (vLLM's
events with ``own_hashes``) or ``deltas`` (own-hash deltas). A full dump (``SNAPSHOT_SEQ``) is
answered from the relay's own record of what the published events leave held, in that form;
other replays are vLLM's (stores form: asked over loopback, passed unchanged) or, in deltas form,
the delta batches the relay published (it keeps the last ``buffer_size`` of them).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

import zmq

from dynamo_zmq.llm._block_hashing import FORM_STORES
from dynamo_zmq.llm._kv_forms import EdgeKvState
from dynamo_zmq.resources import Resources
from dynamo_zmq.transport import AsyncSocket, Domain, SendResult, current_curve, make_socket

from ._edge import EdgeHasher
from ._endpoints import free_port

__all__ = ["KvRelay"]

log = logging.getLogger(__name__)

#: vLLM's replay end marker is an empty topic frame, then seq -1.
_END = b""
_END_SEQ = b"\xff" * 8
#: Start seq of a full-dump request (-2 as u64; ``router._replay.SNAPSHOT_SEQ``).
SNAPSHOT_SEQ = 0xFFFFFFFFFFFFFFFE
#: Seconds a relayed replay may take before it is abandoned.
REPLAY_TIMEOUT = 10.0
_HWM = 100_000
_LOOPBACK = "127.0.0.1"


class _Rank:
    """One rank's relay state: the edge hasher, what was published (in the form), the last seq
    and, in deltas form, the published batches kept for replay."""

    def __init__(self, form: str, buffer_size: int,
                 lora_names: Callable[[int], str | None] | None = None) -> None:
        # One per rank: each rank's stores chain in its own cache.
        self.hasher = EdgeHasher(lora_names)
        self.state = EdgeKvState(form)
        self.last_seq: bytes | None = None
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=max(1, buffer_size))

    def relay(self, seq: bytes, payload: bytes) -> bytes:
        """The payload to publish for vLLM's batch ``seq``, after following it."""
        expected = 0 if self.last_seq is None else int.from_bytes(self.last_seq, "big") + 1
        if int.from_bytes(seq, "big") != expected:
            # Not expected on loopback (vLLM publishes once requests run, the SUB's HWM is
            # 100k): routers recover the gap from vLLM's replay, this relay's dumps do not.
            log.warning("KV relay missed vLLM's batches from %d to %d: its full dumps may lack"
                        " their blocks", expected, int.from_bytes(seq, "big") - 1)
        self.last_seq = seq
        batch = self.hasher.hash_batch(payload)
        state = self.state
        if batch is None:  # not vLLM's map form: passed on as is (stores) or as no change
            out = state.empty(0) if state.deltas else payload
        else:
            out = state.live(batch.events, batch.dp_rank, keep_empty=True, ts=batch.ts) or b""
        if state.deltas:
            self.buffer.append((int.from_bytes(seq, "big"), out))
        return out


class KvRelay:
    """Relays vLLM's KV events (and replays) of ``dp_size`` ranks through sockets of ours.

    Args:
        resources: owns the relay's sockets and tasks (closed with the engine).
        dp_size: vLLM's data-parallel ranks (rank r uses each port + r, as vLLM does).
        events_port, replay_port: where our PUB / ROUTER of rank 0 bind (0: any).
        form: ``KvHashScheme.form`` of what it publishes ("stores" or "deltas").
        buffer_size: published batches kept per rank for replay (deltas form).
        lora_names: vLLM's LoRA adapter id -> the adapter's name (``EdgeHasher``).
    """

    def __init__(self, resources: Resources, dp_size: int, events_port: int = 0,
                 replay_port: int = 0, form: str = FORM_STORES, buffer_size: int = 10_000,
                 lora_names: Callable[[int], str | None] | None = None) -> None:
        self._res = resources.child("kv-relay")
        self._dp_size = max(1, dp_size)
        self._ports = (events_port, replay_port)
        self.form = form
        #: Topic frame of replies the relay makes itself (the live frames' topic).
        self.topic = b"kv-events"
        self._ranks = [_Rank(form, buffer_size, lora_names) for _ in range(self._dp_size)]
        #: Loopback endpoints of rank 0 to give vLLM (``KVEventsConfig``).
        self.vllm_events = f"tcp://{_LOOPBACK}:{free_port()}"
        self.vllm_replay = f"tcp://{_LOOPBACK}:{free_port()}"
        #: Ports of our CURVE PUB and ROUTER, per rank (after ``start``).
        self.events_ports: list[int] = []
        self.replay_ports: list[int] = []

    @property
    def started(self) -> bool:
        return bool(self.events_ports)

    def repick(self) -> None:
        """Fresh loopback ports for vLLM, before vLLM is started again because a port was
        taken: its replay port (vLLM binds it) and, until ``start`` has bound it, its events
        port. Replays read ``vllm_replay`` when they are asked."""
        if not self.started:
            self.vllm_events = f"tcp://{_LOOPBACK}:{free_port()}"
        self.vllm_replay = f"tcp://{_LOOPBACK}:{free_port()}"

    def given_ports(self) -> tuple[int, ...]:
        """The ports given to bind (each rank's), which a dead predecessor may still hold."""
        return tuple(port + rank for port in self._ports if port
                     for rank in range(self._dp_size))

    def start(self) -> None:
        """Bind every socket and start forwarding (in the running loop). All or nothing: when a
        bind fails, the sockets bound so far are closed and it may be called again."""
        made: list[list[zmq.Socket[bytes]]] = []
        try:
            for rank in range(self._dp_size):
                sub = make_socket(self._res.zctx, zmq.SUB, bind=_offset(self.vllm_events, rank),
                                  hwm=_HWM, heartbeat_ms=0, curve=False)
                made.append([sub])
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                made[-1].append(make_socket(self._res.zctx, zmq.PUB, bind=self._bind(0, rank),
                                            hwm=_HWM, zap_domain=Domain.KV_EVENTS))
                made[-1].append(make_socket(self._res.zctx, zmq.ROUTER, bind=self._bind(1, rank),
                                            hwm=_HWM, zap_domain=Domain.KV_EVENTS))
        except BaseException:
            for sock in (s for group in made for s in group):
                sock.close(linger=0)
            raise
        for rank, (sub, pub, router) in enumerate(made):
            self.events_ports.append(_port(pub))
            self.replay_ports.append(_port(router))
            socks = [AsyncSocket(s) for s in (sub, pub, router)]
            for s in socks:
                self._res.on_close(s.close)
            state = self._ranks[rank]
            self._res.spawn(self._forward(socks[0], socks[1], state), f"kv-relay-events-{rank}")
            self._res.spawn(self._serve_replays(socks[2], rank, state),
                            f"kv-relay-replay-{rank}")
        log.info("KV events of vLLM relayed over %s in %s form: PUB ports %s, replay ports %s",
                 "CURVE" if current_curve() is not None else "plaintext", self.form,
                 self.events_ports, self.replay_ports)

    def _bind(self, which: int, rank: int) -> str:
        port = self._ports[which]
        return f"tcp://*:{port + rank if port else 0}"

    async def close(self) -> None:
        await self._res.close()

    async def _forward(self, sub: AsyncSocket, pub: AsyncSocket, state: _Rank) -> None:
        def relay(frames: list[bytes]) -> None:
            if len(frames) == 3 and len(frames[1]) == 8:
                self.topic = frames[0]
                frames[2] = state.relay(frames[1], frames[2])
            # PUB never blocks: with no subscriber, or one too slow, ZMQ drops (as vLLM's does);
            # the router's sequence check and replay cover it.
            pub.try_send(frames)

        await sub.drain_forever(relay, "vLLM's KV events")

    async def _serve_replays(self, router: AsyncSocket, rank: int, state: _Rank) -> None:
        while not router.closed:
            await router.wait_readable()
            while (frames := router.recv_nowait()) is not None:
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request; vLLM would drop it too
                start = int.from_bytes(frames[2], "big")
                if start == SNAPSHOT_SEQ or state.state.deltas:
                    self._res.spawn(self._answer(router, frames[0], state, start),
                                    "kv-relay-replay-answer")
                else:
                    self._res.spawn(self._replay(router, _offset(self.vllm_replay, rank),
                                                 frames), "kv-relay-replay-request")

    async def _answer(self, router: AsyncSocket, identity: bytes, state: _Rank,
                      start: int) -> None:
        """A full dump from the relay's record, or (deltas form) its kept batches."""
        topic = self.topic
        if start == SNAPSHOT_SEQ:
            seq = state.last_seq
            replies = [] if seq is None else [[identity, b"", topic, seq, payload]
                                              for payload in state.state.snapshot()]
        else:
            replies = [[identity, b"", topic, s.to_bytes(8, "big"), payload]
                       for s, payload in state.buffer if s >= start]
        replies.append([identity, b"", _END, _END_SEQ, b""])
        for reply in replies:
            if await router.send(reply, timeout=REPLAY_TIMEOUT) != SendResult.SENT:
                return  # the asker is gone

    async def _replay(self, router: AsyncSocket, vllm_replay: str, request: list[bytes]) -> None:
        """Ask vLLM on loopback (a fresh DEALER per request) and pass its answers back."""
        identity = request[0]
        dealer = AsyncSocket(make_socket(self._res.zctx, zmq.DEALER, connect=vllm_replay,
                                         hwm=_HWM, heartbeat_ms=0, curve=False))
        try:
            if dealer.try_send([b"", request[2]]) != SendResult.SENT:
                return
            deadline = asyncio.get_running_loop().time() + REPLAY_TIMEOUT
            while True:
                frames = dealer.recv_nowait()
                if frames is None:
                    remaining = deadline - asyncio.get_running_loop().time()
                    if remaining <= 0:
                        return  # the router times the replay out on its side as well
                    try:
                        async with asyncio.timeout(remaining):
                            await dealer.wait_readable()
                    except TimeoutError:
                        return
                    continue
                sent = await router.send([identity, *frames], timeout=REPLAY_TIMEOUT)
                if sent != SendResult.SENT:
                    return  # the asker is gone
                if len(frames) >= 2 and frames[1] == _END:
                    return
        finally:
            dealer.close()


def _offset(endpoint: str, rank: int) -> str:
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def _port(sock: zmq.Socket[bytes]) -> int:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return int(endpoint.decode().rsplit(":", 1)[1])
