"""With auth on: vLLM's KV events stay on loopback and reach routers through CURVE sockets.

vLLM's engine core publishes KV events from sockets it makes itself, in plaintext. With
``--auth-keys`` the adapter points them at loopback instead of every interface: vLLM's PUB
connects to a SUB of ours on ``127.0.0.1`` (vLLM binds only wildcard endpoints and connects to
others) and its replay ROUTER binds ``127.0.0.1``. ``KvRelay`` forwards each data-parallel
rank's events, frames unchanged, to a CURVE PUB of ours, and answers replays on a CURVE
ROUTER by asking vLLM's replay socket over loopback. Routers see the same protocol and
sequence numbers as without auth; the live events gain the router's own block hashes
(``_edge.py``, declared as ``EngineConfig.kv_hash_scheme``), replays pass unchanged.
"""

from __future__ import annotations

import asyncio
import logging

import zmq

from dynamo_zmq.resources import Resources
from dynamo_zmq.transport import AsyncSocket, SendResult, make_socket

from ._edge import EdgeHasher
from ._endpoints import free_port

__all__ = ["KvRelay"]

log = logging.getLogger(__name__)

#: vLLM's replay end marker is an empty topic frame.
_END = b""
#: Seconds a relayed replay may take before it is abandoned.
REPLAY_TIMEOUT = 10.0
_HWM = 100_000
_LOOPBACK = "127.0.0.1"


class KvRelay:
    """Relays vLLM's KV events (and replays) of ``dp_size`` ranks through CURVE sockets.

    Args:
        resources: owns the relay's sockets and tasks (closed with the engine).
        dp_size: vLLM's data-parallel ranks (rank r uses each port + r, as vLLM does).
        events_port, replay_port: where our CURVE PUB / ROUTER of rank 0 bind (0: any).
    """

    def __init__(self, resources: Resources, dp_size: int, events_port: int = 0,
                 replay_port: int = 0) -> None:
        self._res = resources.child("kv-relay")
        self._dp_size = max(1, dp_size)
        self._ports = (events_port, replay_port)
        #: Loopback endpoints of rank 0 to give vLLM (``KVEventsConfig``).
        self.vllm_events = f"tcp://{_LOOPBACK}:{free_port()}"
        self.vllm_replay = f"tcp://{_LOOPBACK}:{free_port()}"
        #: Ports of our CURVE PUB and ROUTER, per rank (after ``start``).
        self.events_ports: list[int] = []
        self.replay_ports: list[int] = []

    def start(self) -> None:
        """Bind every socket and start forwarding (in the running loop)."""
        for rank in range(self._dp_size):
            sub = make_socket(self._res.zctx, zmq.SUB, bind=_offset(self.vllm_events, rank),
                              hwm=_HWM, heartbeat_ms=0, curve=False)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            pub = make_socket(self._res.zctx, zmq.PUB, bind=self._bind(0, rank), hwm=_HWM)
            router = make_socket(self._res.zctx, zmq.ROUTER, bind=self._bind(1, rank), hwm=_HWM)
            self.events_ports.append(_port(pub))
            self.replay_ports.append(_port(router))
            socks = [AsyncSocket(s) for s in (sub, pub, router)]
            for s in socks:
                self._res.on_close(s.close)
            self._res.spawn(self._forward(socks[0], socks[1]), f"kv-relay-events-{rank}")
            self._res.spawn(self._serve_replays(socks[2], _offset(self.vllm_replay, rank)),
                            f"kv-relay-replay-{rank}")
        log.info("KV events of vLLM relayed over CURVE: PUB ports %s, replay ports %s",
                 self.events_ports, self.replay_ports)

    def _bind(self, which: int, rank: int) -> str:
        port = self._ports[which]
        return f"tcp://*:{port + rank if port else 0}"

    async def close(self) -> None:
        await self._res.close()

    async def _forward(self, sub: AsyncSocket, pub: AsyncSocket) -> None:
        hasher = EdgeHasher()  # one per rank: each rank's stores chain in its own cache

        def relay(frames: list[bytes]) -> None:
            if len(frames) == 3:
                frames[2] = hasher.rewrite(frames[2])
            # PUB never blocks: with no subscriber, or one too slow, ZMQ drops (as vLLM's does);
            # the router's sequence check and replay cover it.
            pub.try_send(frames)

        await sub.drain_forever(relay, "vLLM's KV events")

    async def _serve_replays(self, router: AsyncSocket, vllm_replay: str) -> None:
        while not router.closed:
            await router.wait_readable()
            while (frames := router.recv_nowait()) is not None:
                if len(frames) != 3 or len(frames[2]) != 8:
                    continue  # not a replay request; vLLM would drop it too
                self._res.spawn(self._replay(router, vllm_replay, frames),
                                "kv-relay-replay-request")

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
                        await asyncio.wait_for(dealer.wait_readable(), remaining)
                    except asyncio.TimeoutError:
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
