"""Router replica sync carries each routed request's LoRA adapter (``ReplicaEvent.lora``), so a
replica's adapter residency prediction (router/_lora_residency.py) follows its peers' routing
too: the publisher puts it in its ``ADD``, ``ReplicaSync.handle`` passes it to ``on_lora``, an
event of an older sender (no ``lora``) still decodes, and an overlong name is refused."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq

from dynamo_zmq.resources import Resources
from router._lora_residency import LoraResidency
from router._replica_metrics import ReplicaMetrics
from router._replica_publisher import ReplicaPublisher
from router._replica_snapshot import Peer
from router._replica_wire import (
    ADD,
    MAX_LORA_NAME,
    REPLICA_TOPIC,
    REPLICA_VERSION,
    ReplicaDecodeError,
    ReplicaEvent,
    decode_event,
    encode_event,
)
from router.busy import PrefillTokens
from router.metrics import RouterMetrics
from router.replica_sync import ReplicaSync
from router.scheduler import LoadTracker

PEER = 0xABC
KNOWN, UNKNOWN = 11, 12


def _add(seq: int, worker: int, lora: str) -> list[bytes]:
    ev = ReplicaEvent(REPLICA_VERSION, ADD, PEER, seq, 100 + seq, worker, 0, b"", 1, 0, lora)
    return [REPLICA_TOPIC, encode_event(ev)]


def test_the_publisher_sends_the_adapter_and_a_replica_predicts_it_resident() -> None:
    pub = ReplicaPublisher("tiny", ReplicaMetrics.for_router(RouterMetrics()))
    zctx = zmq.Context()
    # A real socket pair on loopback; XPUB hears the subscription, so nothing is sent early.
    sock, sub = zctx.socket(zmq.XPUB), zctx.socket(zmq.SUB)
    try:
        sock.rcvtimeo = sub.rcvtimeo = 10_000
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.subscribe(REPLICA_TOPIC)
        sock.recv()  # the subscription
        pub.sock = sock  # type: ignore[assignment]
        route = LoadTracker().add((KNOWN, 0), [1, 2], 1)
        pub.added(route, 0, "sql")
        pub.added(route, 0, None)
        frames = [sub.recv_multipart() for _ in range(2)]
    finally:
        sock.close(0)
        sub.close(0)
        zctx.term()
    assert [decode_event(f[-1]).lora for f in frames] == ["sql", ""]

    sync = ReplicaSync(None, Resources("test"), "dyn://ns.backend.generate",  # type: ignore[arg-type]
                       "tiny", LoadTracker(), PrefillTokens(), {KNOWN}.__contains__,
                       RouterMetrics())
    sync._peers[PEER] = Peer(PEER, "tcp://127.0.0.1:1")
    residency = LoraResidency(32.0, lambda _w: 2)
    sync.on_lora = residency.routed
    for seq, (worker, lora) in enumerate([(KNOWN, "a"), (KNOWN, ""), (UNKNOWN, "b"),
                                          (KNOWN, "c")]):
        assert sync.handle(PEER, _add(seq, worker, lora))
    assert residency.resident((KNOWN, 0)) == ["a", "c"]
    assert residency.resident((UNKNOWN, 0)) == []  # a worker this replica does not follow


def test_an_older_senders_event_decodes_and_an_overlong_name_is_refused() -> None:
    fields: list[Any] = [REPLICA_VERSION, ADD, PEER, 0, 1, KNOWN, 0, b"", 1, 0]  # no lora
    assert decode_event(msgspec.msgpack.encode(fields)).lora == ""
    with pytest.raises(ReplicaDecodeError, match="LoRA name"):
        decode_event(msgspec.msgpack.encode([*fields, "x" * (MAX_LORA_NAME + 1)]))
