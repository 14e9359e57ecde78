"""Bad input on a real worker's request plane (issue 20, item 4): every malformed frame gets a
typed InvalidArgument answer at once, including one whose endpoint name is not UTF-8; garbage
is logged as at most one line per kind per 10 s, never a traceback, and counted in
``dynamo_component_malformed_input_total``; the worker keeps serving."""

from __future__ import annotations

import asyncio
import random
import urllib.request
from pathlib import Path

import msgspec
import zmq

from dynamo_zmq.tools.frame_fuzz import answerable, request_frames
from dynamo_zmq.wire import Batch, Error, Kind, Ping, Pong, Request, encode
from tests.support.metrics import sample
from tests.support.procs import system_port

ANSWER_MS = 5000
BARRIER = 0x20B_20B_20B
_error = msgspec.msgpack.Decoder(Error)
_pong = msgspec.msgpack.Decoder(Pong)
_batch = msgspec.msgpack.Decoder(Batch)


def start_worker(spawn, namespace, tiny_model):
    return spawn(
        "-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(tiny_model),
        "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
        "--discovery", "static", "--speedup-ratio", "1000", env={"DYN_SYSTEM_PORT": "0"},
    )


def log_text(proc) -> str:
    """The worker's whole stderr so far."""
    return Path(proc.log.name).read_text(errors="replace")


def dealer(address: str) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    return sock


def answers(sock: zmq.Socket[bytes], tail_ms: int = 20) -> list[list[bytes]]:
    """The first answer (waiting up to ``ANSWER_MS``), then whatever follows within
    ``tail_ms``."""
    if not sock.poll(ANSWER_MS):
        raise AssertionError(f"no answer within {ANSWER_MS} ms")
    got = [sock.recv_multipart()]
    while sock.poll(tail_ms):
        got.append(sock.recv_multipart())
    return [g for g in got if g[0] != Kind.NOTICE]


def invalid_arguments(got: list[list[bytes]]) -> int:
    """How many InvalidArgument terminals ``got`` holds (alone, or in BATCH frames)."""
    errs = [_error.decode(body) for kind, body in got if kind == Kind.ERROR]
    errs += [e for kind, body in got if kind == Kind.BATCH for e in _batch.decode(body).errors]
    return sum(1 for e in errs if e.kind == "InvalidArgument")


async def assert_serves(make_runtime, proc, namespace) -> None:
    client = await make_runtime(static=(proc.address,)).endpoint(
        f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    request = {"token_ids": [1, 2, 3], "stop": {"max_tokens": 3, "ignore_eos": True}}
    chunks = [r.data() async for r in await client.generate(request)]
    assert chunks[-1]["finish_reason"] == "length"


async def test_an_endpoint_name_of_invalid_utf8_is_answered_at_once(
    namespace, spawn, make_runtime, tiny_model
):
    proc = start_worker(spawn, namespace, tiny_model)
    sock = dealer(proc.address)
    try:
        endpoint = f"{namespace}.backend.generate"
        for rid, field in ((7, endpoint), (8, "ctx-name")):
            whole = encode(Request(rid, endpoint, "ctx-name", msgspec.Raw(b"\x80")))
            bad = whole.replace(msgspec.msgpack.encode(field), b"\xa2\xff\xfe", 1)
            sock.send_multipart([Kind.REQUEST, bad])
            [[kind, body]] = answers(sock)
            assert kind == Kind.ERROR
            err = _error.decode(body)
            # The id is echoed, so the caller's stream ends now, not at its own timeout.
            assert (err.request_id, err.kind) == (rid, "InvalidArgument"), err
            assert "utf-8" in err.message
        # A payload (the request itself) with invalid UTF-8 is refused the same way.
        payload = msgspec.msgpack.encode({"token_ids": [1], "model": "x"}).replace(
            b"\xa1x", b"\xa1\xff")
        sock.send_multipart([Kind.REQUEST, encode(Request(9, endpoint, "c", msgspec.Raw(payload)))])
        [[kind, body]] = answers(sock)
        assert kind == Kind.ERROR and _error.decode(body).kind == "InvalidArgument"
    finally:
        sock.close()
    assert "Traceback" not in log_text(proc)
    await assert_serves(make_runtime, proc, namespace)


async def test_a_thousand_garbage_frames_log_a_few_lines_and_are_counted(
    namespace, spawn, make_runtime, tiny_model
):
    proc = start_worker(spawn, namespace, tiny_model)
    lines_before = len(log_text(proc).splitlines())
    rng = random.Random(20)
    endpoint = f"{namespace}.backend.generate"
    sock = dealer(proc.address)
    invalid = 0
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        for _ in range(1000):
            frames = request_frames(rng, endpoint)
            sock.send_multipart(frames)
            if not answerable(frames):
                continue
            # Every answerable frame is answered, promptly (what comes later of a stream that
            # garbage happened to start is read with the next answers).
            invalid += invalid_arguments(answers(sock, tail_ms=0))
        sock.send_multipart([Kind.PING, encode(Ping(BARRIER))])  # answered after the rest
        while True:
            got = answers(sock)
            invalid += invalid_arguments(got)
            if any(k == Kind.PONG and _pong.decode(b).nonce == BARRIER for k, b in got):
                break
    finally:
        sock.close()
    elapsed = loop.time() - started
    assert proc.running(), proc.logs()
    await assert_serves(make_runtime, proc, namespace)

    text = log_text(proc)
    assert "Traceback" not in text, text[-3000:]
    new_lines = text.splitlines()[lines_before:]
    # Two kinds (malformed frames, refused requests): one line each per 10 s, plus the first.
    assert len(new_lines) <= 2 * (2 + int(elapsed / 10)), "\n".join(new_lines[-20:])
    assert invalid > 500  # most garbage is refused (the rest: pings, describes, controls)
    page = await asyncio.to_thread(
        lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{system_port(proc)}/metrics", timeout=5).read().decode()
    )
    counted = sample(page, "dynamo_component_malformed_input_total", dynamo_namespace=namespace)
    assert counted == invalid, page
