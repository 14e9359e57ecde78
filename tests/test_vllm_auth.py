"""With auth on, vLLM's KV events (published by vLLM's own ``ZmqEventPublisher``, in
plaintext) stay on loopback and reach subscribers only through the relay's CURVE PUB and
replay ROUTER (``engines/vllm/_relay.py``), in a real child process.

Runs only where vLLM is installed; skipped otherwise, except in CI (``CI=true``)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

import zmq

from dynamo_zmq.tools.keys import authorize, create_keypair, load_keypair
from tests.support.http_calls import get
from tests.support.vllm_stack import VLLM_ENV, WORKER_FLAGS, WORKER_START, wait_listed


def _sub(endpoint: str, keypair: tuple[bytes, bytes] | None, server: bytes) -> list[bytes] | None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    try:
        if keypair is not None:
            sub.curve_publickey, sub.curve_secretkey = keypair
            sub.curve_serverkey = server
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        return sub.recv_multipart() if sub.poll(3000) else None
    finally:
        sub.close(0)
        ctx.term()


def _replay(endpoint: str, keypair: tuple[bytes, bytes], server: bytes) -> list[list[bytes]]:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    try:
        dealer.curve_publickey, dealer.curve_secretkey = keypair
        dealer.curve_serverkey = server
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            got.append(frames)
            if frames[1] == b"":  # vLLM's end marker: an empty topic
                break
        return got
    finally:
        dealer.close(0)
        ctx.term()


def test_vllm_kv_events_are_relayed_over_curve_only(spawn, tmp_path: Path) -> None:
    keydir = tmp_path / "keys"
    server = create_keypair(keydir, "worker")
    create_keypair(keydir, "router")
    for name in ("worker", "router"):
        authorize(keydir, str(keydir / f"{name}.key"))
    out = tmp_path / "ports.json"
    child = spawn("-m", "tests.support.vllm_relay_child", str(keydir), "worker", str(out),
                  ready=False)
    child.wait_ready(180)  # importing vLLM takes a while
    ports = json.loads(out.read_text())
    # vLLM's own (plaintext) sockets are on loopback only.
    assert ports["vllm_events"].startswith("tcp://127.0.0.1:")
    assert ports["vllm_replay"].startswith("tcp://127.0.0.1:")

    router = load_keypair(keydir, "router")
    pub = f"tcp://127.0.0.1:{ports['pub']}"
    frames = _sub(pub, router, server)
    assert frames is not None and frames[0] == b"kv-events" and len(frames) == 3
    assert _sub(pub, None, server) is None  # plaintext
    assert _sub(pub, zmq.curve_keypair(), server) is None  # unknown key

    answers = _replay(f"tcp://127.0.0.1:{ports['replay']}", router, server)
    assert len(answers) >= 2 and answers[-1][1] == b"", answers[-3:]
    assert all(a[1] == b"kv-events" for a in answers[:-1])
    seqs = [int.from_bytes(a[2], "big") for a in answers[:-1]]
    assert seqs == sorted(seqs) and seqs[0] == 0



def test_vllm_worker_with_auth_feeds_a_kv_router(spawn, tiny_model, namespace,
                                                 tmp_path: Path) -> None:
    """A real vLLM worker with --auth-keys: a KV-routing frontend with keys indexes its blocks
    and replays its events, through the relay's CURVE sockets."""
    keydir = tmp_path / "keys"
    for name in ("worker", "front"):
        create_keypair(keydir, name)
        authorize(keydir, str(keydir / f"{name}.key"))
    auth = ("--auth-keys", str(keydir), "--auth-key-name")
    worker = spawn("-m", "dynamo_zmq.worker", "--engine", "vllm", "--model-path",
                   str(tiny_model), "--model-name", "tiny", "--namespace", namespace,
                   "--host", "127.0.0.1", *WORKER_FLAGS, *auth, "worker", env=VLLM_ENV,
                   ready=False)
    front = spawn("-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                  "--router-mode", "kv", *auth, "front", ready=False)
    worker.wait_ready(WORKER_START)
    front.wait_ready(60)
    wait_listed(front.address)
    assert "KV events of vLLM relayed over CURVE" in Path(worker.log.name).read_text()

    body = json.dumps({"model": "tiny", "prompt": list(range(10, 138)), "max_tokens": 2})
    req = urllib.request.Request(f"{front.address}/v1/completions", body.encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200

    wid = f"{worker.instance_id:x}"
    deadline = time.monotonic() + 30
    while True:
        text = get(f"{front.address}/metrics")[1].decode()
        blocks = [float(v) for v in re.findall(
            rf'^dynamo_router_kv_index_blocks\{{[^}}]*worker="{wid}"[^}}]*\}} (\S+)$', text,
            re.MULTILINE)]
        replays = re.search(
            r'^dynamo_router_kv_event_replays_total\{[^}]*result="ok"[^}]*\} (\S+)$', text,
            re.MULTILINE)
        if blocks and sum(blocks) > 0 and replays and float(replays.group(1)) >= 1:
            break
        assert time.monotonic() < deadline, text[-3000:]
        time.sleep(0.5)


def test_relayed_vllm_events_carry_the_routers_own_hashes(spawn, tmp_path: Path) -> None:
    """Issue 18: the relay hashes vLLM's live events at the edge: each ``BlockStored`` it
    republishes carries the router's own hashes, which the router's edge decoder takes."""
    from router.events import decode_edge_batch
    from router.hashing import block_hashes

    keydir = tmp_path / "keys"
    server = create_keypair(keydir, "worker")
    create_keypair(keydir, "router")
    for name in ("worker", "router"):
        authorize(keydir, str(keydir / f"{name}.key"))
    out = tmp_path / "ports.json"
    child = spawn("-m", "tests.support.vllm_relay_child", str(keydir), "worker", str(out),
                  ready=False)
    child.wait_ready(180)
    ports = json.loads(out.read_text())
    frames = _sub(f"tcp://127.0.0.1:{ports['pub']}", load_keypair(keydir, "router"), server)
    assert frames is not None and len(frames) == 3
    batch, edge = decode_edge_batch(frames[2])
    assert edge == 1
    (stored,) = batch.events
    assert stored.own_hashes == block_hashes([1, 2], 2)  # the child stores root blocks [1, 2]
