"""Roles of authorized keys (issue 33, item 5) through real processes on loopback: keys made
and authorized with ``python -m dynamo_zmq.keys ... --role``, workers and frontends started
with ``--auth-keys``, the other side of each check a raw ZMQ socket with a role's key.

A frontend-role key cannot serve as a worker (the frontend never routes to it and says so
once); a tool-role key reads status (DESCRIBE, ``status``, load reports) but its requests get
``PermissionDenied`` and KV events refuse it; a revoke closes the revoked key's open
connections (request plane and load subscription) while another key's stay, and a key given
fewer roles is reconnected under them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from dynamo_zmq.llm import ModelAdvert, PreprocessedRequest, StopConditions
from dynamo_zmq.tools.keys import load_keypair, revoke
from dynamo_zmq.wire import Describe, Description, Error, Kind, Request, encode
from tests.support.auth import complete, health_models, keys_cli, log_of, worker
from tests.support.procs import ROOT, Proc
from tests.support.waiting import eventually

ROLES = {"worker": "worker", "front": "frontend", "router": "router", "tool": "tool",
         "client": "frontend"}


@dataclass
class Keys:
    dir: Path
    public: dict[str, str]  # name -> Z85 public key

    def pair(self, name: str) -> tuple[bytes, bytes]:
        return load_keypair(self.dir, name)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    home = tmp_path / "keys"
    public = {name: keys_cli("create", str(home), "--name", name) for name in ROLES}
    for name, role in ROLES.items():
        keys_cli("authorize", str(home), str(home / f"{name}.key"), "--role", role)
    return Keys(home, public)


def frontend(spawn, namespace: str, keys: Keys, name: str) -> Proc:
    from tests.support.mocker_fleet import start_frontend

    return start_frontend(spawn, namespace, "--auth-keys", str(keys.dir), "--auth-key-name", name)


class Peer:
    """A DEALER (and, on demand, SUBs) with one key, its connection events watched."""

    def __init__(self, keys: Keys, name: str, address: str) -> None:
        self.ctx = zmq.Context()
        self.keypair = keys.pair(name)
        self.server = keys.public["worker"].encode()
        self.sock = self._socket(zmq.DEALER)
        self.events = self.sock.get_monitor_socket()
        self.sock.connect(address)
        self.subs: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]] = []

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        # A DEALER whose handshake is refused has no peer, and a send would block for ever.
        sock.sndtimeo = 3000
        sock.curve_publickey, sock.curve_secretkey = self.keypair
        sock.curve_serverkey = self.server
        return sock

    def ask(self, frames: list[bytes], timeout_ms: int = 3000) -> list[bytes] | None:
        try:
            self.sock.send_multipart(frames)
        except zmq.Again:  # no peer: the handshake was refused
            return None
        return self.sock.recv_multipart() if self.sock.poll(timeout_ms) else None

    def describe(self) -> Description | None:
        got = self.ask([Kind.DESCRIBE, encode(Describe(1))])
        return None if got is None else msgspec.msgpack.decode(got[1], type=Description)

    def request(self, endpoint: str, request_id: int) -> Error | None:
        """A REQUEST with an empty payload: the ERROR it gets (None: no answer)."""
        req = Request(request_id, endpoint, "ctx", msgspec.Raw(b"\x80"))
        got = self.ask([Kind.REQUEST, encode(req)])
        if got is None:
            return None
        assert got[0] == Kind.ERROR, got
        return msgspec.msgpack.decode(got[1], type=Error)

    def generate(self, endpoint: str, request_id: int, tokens: list[int]) -> list[bytes]:
        """A real generate request: the kinds of the frames it gets back, up to its terminal
        (END, ERROR, or a BATCH, which may carry it) or 5 s of silence."""
        pre = PreprocessedRequest(tokens, model="tiny", stop=StopConditions(max_tokens=2))
        req = Request(request_id, endpoint, "ctx", msgspec.Raw(msgspec.msgpack.encode(pre)))
        self.sock.send_multipart([Kind.REQUEST, encode(req)])
        kinds = []
        while self.sock.poll(5000):
            kinds.append(self.sock.recv_multipart()[0])
            if kinds[-1] in (Kind.END, Kind.ERROR, Kind.BATCH):
                break
        return kinds

    def subscribe(self, address: str) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        events = sub.get_monitor_socket()
        sub.connect(address)
        self.subs.append((sub, events))
        return sub, events

    def close(self) -> None:
        # Monitors off before their sockets close (libzmq may abort otherwise).
        for sock, events in [(self.sock, self.events), *self.subs]:
            sock.disable_monitor()
            events.close(0)
            sock.close(0)
        self.ctx.term()


def disconnected(events: zmq.Socket[bytes], timeout: float) -> bool:
    """Whether the monitored socket sees its connection end within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if events.poll(int(left * 1000)):
            if recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED:
                return True
    return False


def connected_once(events: zmq.Socket[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if events.poll(int(left * 1000)):
            if recv_monitor_message(events)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return True
    return False


def drain(sock: zmq.Socket[bytes]) -> int:
    n = 0
    while sock.poll(0):
        sock.recv_multipart()
        n += 1
    return n


def advert(desc: Description) -> ModelAdvert:
    ep = next(e for e in desc.endpoints if e.name == "generate")
    found = ModelAdvert.from_metadata(ep.metadata)
    assert found is not None
    return found


async def test_a_frontend_key_cannot_serve_as_a_worker(spawn, namespace, tiny_model, keys) -> None:
    real = worker(spawn, namespace, tiny_model, keys.dir, "worker")
    rogue = worker(spawn, namespace, tiny_model, keys.dir, "front")  # a frontend's key, stolen
    front = frontend(spawn, namespace, keys, "front")
    for proc in (real, rogue, front):
        proc.wait_ready()
    real_id, rogue_id = f"{real.instance_id:x}", f"{rogue.instance_id:x}"
    said = f"instance {rogue_id} at {rogue.address} advertises a model, but its key front"

    async def only_real() -> bool:
        return (await health_models(front.address)).get("tiny") == [real_id]

    await eventually(only_real, 30, "the frontend serving 'tiny' from the real worker only")
    async def reported() -> bool:
        return said in log_of(front)

    await eventually(reported, 30, "the rogue reported")
    served = set()
    for i in range(8):
        prompt = [(11 * i + j) % 400 + 10 for j in range(32)]
        served.add(await asyncio.to_thread(complete, front.address, prompt))
    assert served == {real_id}
    await asyncio.sleep(2)  # more descriptions, more routing decisions: still said once
    assert log_of(front).count(said) == 1, log_of(front)[-3000:]
    # The rogue process itself was told at start that its key is not a worker's.
    assert "not authorized as a worker" in log_of(rogue), log_of(rogue)[-3000:]


async def test_a_tool_key_reads_status_but_cannot_generate(spawn, namespace, tiny_model,
                                                           keys) -> None:
    w = worker(spawn, namespace, tiny_model, keys.dir, "worker").wait_ready()
    generate = f"{namespace}.backend.generate"
    tool, front, router = (Peer(keys, n, w.address) for n in ("tool", "front", "router"))
    try:
        desc = await asyncio.to_thread(tool.describe)  # status: answered
        assert desc is not None and desc.instance_id == w.instance_id
        # Past the role check, an empty payload is invalid; before it, the key is refused.
        err = await asyncio.to_thread(front.request, generate, 1)
        assert err is not None and err.kind == "InvalidArgument", err
        for peer, name in ((tool, "tool"), (router, "router")):
            for endpoint in (generate, f"{namespace}.backend.model_files"):
                err = await asyncio.to_thread(peer.request, endpoint, 2)
                assert err is not None and err.kind == "PermissionDenied", err
                assert f"key {name} ({name}) may not call {endpoint}" in err.message
        assert f"refused a request: key tool (tool) may not call {generate}" in log_of(w)

        # A tool follows load reports (status --watch) but not KV events (prompts' prefixes).
        adv = advert(desc)
        assert adv.load_endpoint and adv.kv_events_endpoint
        load_sub, _ = tool.subscribe(adv.load_endpoint)
        kv_tool, kv_tool_events = tool.subscribe(adv.kv_events_endpoint)
        kv_front, _ = front.subscribe(adv.kv_events_endpoint)
        assert await asyncio.to_thread(load_sub.poll, 10_000)
        assert not await asyncio.to_thread(connected_once, kv_tool_events, 3)
        # Events flow to the frontend's key (a request's stores) and never to the tool's.
        await asyncio.sleep(0.5)  # the frontend key's subscription is made
        tokens = list(range(10, 80))
        kinds = await asyncio.to_thread(front.generate, generate, 3, tokens)
        assert kinds and Kind.ERROR not in kinds, kinds
        assert await asyncio.to_thread(kv_front.poll, 10_000)
        assert not kv_tool.poll(0)
        assert "to a kv-events socket: it admits worker,frontend,router" in log_of(w)
    finally:
        for peer in (tool, front, router):
            peer.close()

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    status = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "dynamo_zmq", "status", "--json", "--namespace", namespace,
         "--discovery", "static", "--wait", "3", "--static-workers",
         f"{w.address} key={keys.public['worker']}", "--auth-keys", str(keys.dir),
         "--auth-key-name", "tool"], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=60)
    assert status.returncode == 0, status.stderr
    assert {row["instance_id"] for row in json.loads(status.stdout)} == {f"{w.instance_id:x}"}


async def test_a_revoke_closes_the_revoked_keys_connections(spawn, namespace, tiny_model,
                                                            keys) -> None:
    w = worker(spawn, namespace, tiny_model, keys.dir, "worker").wait_ready()
    client, front = Peer(keys, "client", w.address), Peer(keys, "front", w.address)
    try:
        for peer in (client, front):
            assert await asyncio.to_thread(peer.describe) is not None
        load = advert(await asyncio.to_thread(client.describe)).load_endpoint
        assert load
        sub, sub_events = client.subscribe(load)
        assert await asyncio.to_thread(sub.poll, 10_000)
        for events in (client.events, front.events, sub_events):
            drain(events)

        revoked_at = time.monotonic()
        assert revoke(keys.dir, "client") == ["client"]  # as `keys revoke` does
        assert await asyncio.to_thread(disconnected, client.events, 10)
        took = time.monotonic() - revoked_at
        assert await asyncio.to_thread(disconnected, sub_events, 10)
        print(f"revoke -> request-plane connection closed in {took:.2f} s")
        # It reconnects, and the handshake is refused: no answer any more.
        assert await asyncio.to_thread(client.describe) is None
        drain(sub)
        await asyncio.sleep(1)
        assert drain(sub) == 0, "load reports still reach the revoked key"
        # The other key's request-plane connection was not touched.
        assert not await asyncio.to_thread(disconnected, front.events, 0.5)
        assert await asyncio.to_thread(front.describe) is not None
        text = log_of(w)
        assert "key client lost a role: closed its connection from 127.0.0.1:" in text, text[-3000:]

        # A key given fewer roles is reconnected under them: frontend -> tool.
        keys_cli("authorize", str(keys.dir), keys.public["front"], "--as", "front", "--role",
                 "tool")
        assert await asyncio.to_thread(disconnected, front.events, 10)
        generate = f"{namespace}.backend.generate"

        async def refused() -> bool:
            err = await asyncio.to_thread(front.request, generate, 7)
            return err is not None and err.kind == "PermissionDenied"

        await eventually(refused, 15, "the downgraded key refused as a tool")
        assert await asyncio.to_thread(front.describe) is not None  # a tool reads status
    finally:
        client.close()
        front.close()
