"""The brokerless KV transfer (``dynamo_zmq.kv_transfer``) over real ZeroMQ sockets: a pull gets
every block in order, in credited batches (never more than the credit in flight), the server's
memory bound refuses offers, unpulled transfers expire, and every way a pull can break ends in
a typed error within its timeout; garbage never stops the server."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.kv_transfer import (
    Ack,
    Batch,
    Failure,
    KvTransferClient,
    KvTransferConfig,
    KvTransferServer,
    Pull,
    Release,
    Ticket,
    TransferFailed,
    TransferFull,
    TransferNotFound,
    decode_client,
    decode_server,
    encode,
)
from dynamo_zmq.llm import PreprocessedRequest
from dynamo_zmq.runtime._handlers import adapt_handler

BLOCKS = [bytes([i]) * (100 + i) for i in range(10)]


async def started(**kw: object) -> KvTransferServer:
    server = KvTransferServer(KvTransferConfig(**kw))  # type: ignore[arg-type]
    await server.start()
    return server


async def pull_all(client: KvTransferClient, ticket: dict, ctx: Context | None = None,
                   pause: float = 0.0) -> list[list[bytes]]:
    batches = []
    async for batch in client.pull(ticket, ctx):
        batches.append(batch)
        await asyncio.sleep(pause)
    return batches


async def test_a_pull_gets_every_block_in_batches_and_releases_the_transfer() -> None:
    server = await started(batch_blocks=3)
    released: list[str] = []
    try:
        ticket = server.offer(BLOCKS, on_release=released.append)
        assert ticket.num_blocks == 10 and ticket.num_bytes == sum(map(len, BLOCKS))
        assert ticket.transfer_endpoint == server.endpoint and ticket.transfer_key is None
        assert server.num_held == 1 and server.held_bytes == ticket.num_bytes
        client = KvTransferClient()
        batches = await pull_all(client, ticket)
        assert [len(b) for b in batches] == [3, 3, 3, 1]
        assert [blk for b in batches for blk in b] == BLOCKS
        await _until(lambda: released == ["pulled"])
        assert server.num_held == 0 and server.held_bytes == 0
        total = sum(map(len, BLOCKS))
        assert server.metrics.sent_bytes._value.get() == total
        assert client.metrics.received_bytes._value.get() == total
        with pytest.raises(TransferNotFound):  # a transfer is pulled once
            await pull_all(client, ticket)
    finally:
        await server.close()


async def test_the_server_never_has_more_batches_in_flight_than_the_credit() -> None:
    server = await started(batch_blocks=1)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        ticket = server.offer(BLOCKS)
        sock.connect(ticket.transfer_endpoint)
        tid = ticket.transfer_id
        await sock.send(encode(Pull(tid, 2)))
        got = await _drain(sock, 0.5)
        assert [m.seq for m in got] == [0, 1]  # a consumer that acks nothing gets its credit
        await sock.send(encode(Ack(tid, 0)))
        assert [m.seq for m in await _drain(sock, 0.5)] == [2]  # one ack, one more batch
        # A slow consumer through the client: the server stays within the credit.
        slow = server.offer(BLOCKS)
        batches = await pull_all(KvTransferClient(KvTransferConfig(credit=3)), slow, pause=0.02)
        assert len(batches) == 10
        assert server.peak_in_flight == 3
    finally:
        sock.close()
        ctx.term()
        await server.close()


async def test_offers_beyond_max_bytes_are_refused_until_memory_is_released() -> None:
    server = await started(max_bytes=1000)
    try:
        first = server.offer([b"x" * 600])
        with pytest.raises(TransferFull):
            server.offer([b"y" * 600])
        assert server.offer([b"z"], num_bytes=400)  # the engine's own count is what is held
        assert server.metrics.refused._value.get() == 1
        await pull_all(KvTransferClient(), first)
        await _until(lambda: server.held_bytes == 400)
        server.offer([b"y" * 600])
    finally:
        await server.close()


async def test_an_unpulled_transfer_expires_and_is_counted() -> None:
    server = await started(ttl=0.2)
    released: list[str] = []
    try:
        ticket = server.offer(BLOCKS, on_release=released.append)
        await _until(lambda: released == ["expired"])
        assert server.num_held == 0 and server.metrics.expired._value.get() == 1
        with pytest.raises(TransferNotFound):
            await pull_all(KvTransferClient(), ticket)
    finally:
        await server.close()


async def test_a_vanished_server_ends_the_pull_with_a_typed_error_not_a_hang() -> None:
    server = await started()
    ticket = server.offer(BLOCKS)
    await server.close()
    client = KvTransferClient(KvTransferConfig(timeout=0.3))
    started_at = time.monotonic()
    with pytest.raises(TransferFailed):
        await pull_all(client, ticket)
    assert time.monotonic() - started_at < 10
    assert client.metrics.failed._value.get() == 1
    # A malformed ticket never reaches a pull: the worker refuses the request carrying it.
    serve = adapt_handler(lambda request: None, PreprocessedRequest)
    ticket_missing_fields = {"type": "transfer", "transfer_id": "x"}
    bad = {"token_ids": [1], "disaggregation": {"type": "prefill_remotely",
                                                "handoff": ticket_missing_fields}}
    with pytest.raises(errors.InvalidArgument):
        serve(msgspec.Raw(msgspec.msgpack.encode(bad)), Context("bad-ticket"))


async def test_stopping_the_context_cancels_the_pull_and_releases_the_transfer() -> None:
    server = await started(batch_blocks=1)
    released: list[str] = []
    try:
        ticket = server.offer(BLOCKS, on_release=released.append)
        ctx = Context("kv-pull")
        got = 0
        with pytest.raises(errors.Cancelled):
            async for _batch in KvTransferClient().pull(ticket, ctx):
                got += 1
                if got == 2:
                    ctx.stop()
        # Released at once: by the client's Release, or (if the server was still sending the
        # batch an earlier ack allowed) because the client's socket is gone.
        await _until(lambda: released in (["released"], ["gone"]), what=released)
        assert server.num_held == 0
    finally:
        await server.close()


async def test_garbage_on_the_server_socket_is_ignored_and_serving_goes_on() -> None:
    server = await started()
    zctx = zmq.asyncio.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(server.endpoint)
        for frames in ([b"\xff\x00garbage"], [b"a", b"b"], [b""], [b"\x91\xa3\x00\x00\x80"],
                       [encode(Batch("x", 0, [], True))],
                       [msgspec.msgpack.encode(["Pull", "t", 0])],
                       [msgspec.msgpack.encode(["Ack", "unknown-id", 0])]):
            await sock.send_multipart(frames)
        ticket = server.offer(BLOCKS)
        other = server.offer(BLOCKS)
        await sock.send(encode(Ack(other.transfer_id, 5)))  # not started: ignored
        assert [b for batch in await pull_all(KvTransferClient(), ticket) for b in batch] == BLOCKS
        await _until(lambda: server.bad_input.counts.get("kv_transfer_frame", 0) >= 6)
    finally:
        sock.close()
        zctx.term()
        await server.close()


async def test_a_client_fed_garbage_fails_typed() -> None:
    zctx = zmq.asyncio.Context()
    router = zctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    ticket = Ticket(transfer_endpoint=f"tcp://127.0.0.1:{port}", transfer_id="t1", num_blocks=1,
                    num_bytes=1)

    async def answer(*replies: bytes) -> None:
        while True:  # skip the Release of the pull before
            peer, msg = await router.recv_multipart()
            if isinstance(decode_client(msg), Pull):
                break
        for reply in replies:
            await router.send_multipart([peer, reply])

    try:
        for replies, error in (([b"\x00garbage"], TransferFailed),
                               ([encode(Batch("t1", 7, [b"x"], True))], TransferFailed),
                               ([encode(Failure("t1", "unknown", "gone"))], TransferNotFound)):
            task = asyncio.ensure_future(answer(*replies))
            with pytest.raises(error):
                await pull_all(KvTransferClient(KvTransferConfig(timeout=2)), ticket)
            await task
    finally:
        router.close()
        zctx.term()


_ids = st.text(min_size=1, max_size=128)
_messages = st.one_of(
    st.builds(Pull, _ids, st.integers(1, 1024)),
    st.builds(Ack, _ids, st.integers(0, 2**63 - 1)),
    st.builds(Release, _ids),
    st.builds(Batch, _ids, st.integers(0, 2**63 - 1), st.lists(st.binary(max_size=64)),
              st.booleans()),
    st.builds(Failure, st.text(), st.text(), st.text()),
)


@settings(max_examples=300, deadline=None)
@given(_messages)
def test_messages_round_trip(msg: Pull | Ack | Release | Batch | Failure) -> None:
    data = encode(msg)
    decoded = decode_server(data) if isinstance(msg, Batch | Failure) else decode_client(data)
    assert decoded == msg
    other = decode_client if isinstance(msg, Batch | Failure) else decode_server
    with pytest.raises(msgspec.ValidationError):  # a server message is no client message
        other(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_garbage_never_decodes_to_anything_but_a_typed_refusal(data: bytes) -> None:
    for decode in (decode_client, decode_server):
        try:
            decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass


async def _drain(sock: zmq.asyncio.Socket, quiet: float) -> list[Batch]:
    got = []
    while await sock.poll(int(quiet * 1000)):
        msg = decode_server(await sock.recv())
        assert isinstance(msg, Batch)
        got.append(msg)
    return got


async def _until(predicate, timeout: float = 10.0, what: object = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"condition not met in time: {what}"
        await asyncio.sleep(0.02)
