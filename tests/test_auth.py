"""CURVE auth (issue 16) through real processes: workers and frontends started with
``--auth-keys``, keys made with ``python -m dynamo_zmq.keys``, clients on raw ZMQ sockets.

With auth on: a plaintext client, one with an unknown key, or one that does not know the
server's key gets no answer while authorized clients are served; a worker advertising the
model with an unauthorized key, without a key, or with a trusted key it cannot prove gets no
request and is reported once; KV events and load reports reach the router only from trusted
workers; keys added or revoked at runtime take effect without restarts."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from dynamo_zmq.discovery import Advert, DiscoveryConfig, MdnsDiscovery
from dynamo_zmq.discovery._config import parse_static_file, split_entry
from dynamo_zmq.errors import InvalidArgument
from dynamo_zmq.tools.keys import load_keypair
from dynamo_zmq.wire import Describe, Kind, encode
from tests.support.auth import BLOCK, complete, health_models, keys_cli, log_of, worker
from tests.support.http_calls import get
from tests.support.mocker_fleet import start_frontend
from tests.support.procs import ROOT, Proc
from tests.support.waiting import eventually


@dataclass
class Keys:
    cluster: Path  # worker, front, client keypairs; all three authorized
    rogue: Path  # the rogue's own keypair; it trusts the cluster's keys (it would serve them)
    worker: str
    front: str
    client: str
    rogue_key: str


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    cluster, rogue = tmp_path / "cluster", tmp_path / "rogue"
    made = {name: keys_cli("create", str(cluster), "--name", name)
            for name in ("worker", "front", "client")}
    for name in made:
        keys_cli("authorize", str(cluster), str(cluster / f"{name}.key"))
    rogue_key = keys_cli("create", str(rogue), "--name", "rogue")
    for name in made:
        keys_cli("authorize", str(rogue), str(cluster / f"{name}.key"))
    return Keys(cluster, rogue, made["worker"], made["front"], made["client"], rogue_key)


def frontend(spawn, namespace: str, keydir: Path, *extra: str) -> Proc:
    return start_frontend(spawn, namespace, "--auth-keys", str(keydir), "--auth-key-name",
                          "front", *extra)


def describe(address: str, server_key: str | None, keypair: tuple[bytes, bytes] | None,
             timeout_ms: int = 1500, payload: list[bytes] | None = None) -> bytes | None:
    """Send DESCRIBE (or ``payload``) from a fresh DEALER (plaintext when ``keypair`` is
    None); the answer's first frame, or None when nothing came back."""
    frames = describe_frames(address, server_key, keypair, timeout_ms, payload)
    return None if frames is None else frames[0]


def describe_frames(address: str, server_key: str | None,
                    keypair: tuple[bytes, bytes] | None, timeout_ms: int = 1500,
                    payload: list[bytes] | None = None) -> list[bytes] | None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    # A DEALER whose handshake failed has no peer, and a send then blocks: bound it too.
    sock.sndtimeo = timeout_ms
    try:
        if keypair is not None:
            sock.curve_publickey, sock.curve_secretkey = keypair
            sock.curve_serverkey = (server_key or "").encode()
        sock.connect(address)
        try:
            sock.send_multipart(payload or [Kind.DESCRIBE, encode(Describe(1))])
        except zmq.Again:
            return None
        if not sock.poll(timeout_ms):
            return None
        return sock.recv_multipart()
    finally:
        sock.close(0)
        ctx.term()


def metric_workers(page: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", page, re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if "worker" in labels:
            out[labels["worker"]] = out.get(labels["worker"], 0) + float(m.group(2))
    return out


# -- (a) who gets an answer --------------------------------------------------------------------


async def test_only_authorized_clients_get_answers(spawn, namespace, tiny_model, keys) -> None:
    w = worker(spawn, namespace, tiny_model, keys.cluster, "worker").wait_ready()
    client = load_keypair(keys.cluster, "client")
    rogue = load_keypair(keys.rogue, "rogue")
    stranger = zmq.curve_keypair()  # a key in no file at all

    assert await asyncio.to_thread(describe, w.address, None, None) is None  # plaintext
    assert await asyncio.to_thread(describe, w.address, keys.worker, rogue) is None
    assert await asyncio.to_thread(describe, w.address, keys.worker, stranger) is None
    # An authorized client that takes another key for the server's gets nothing either.
    assert await asyncio.to_thread(describe, w.address, keys.rogue_key, client) is None
    # ...while the authorized client is served, before and after a second round of strangers.
    assert await asyncio.to_thread(describe, w.address, keys.worker, client) == Kind.INFO
    assert await asyncio.to_thread(describe, w.address, keys.worker, rogue) is None
    assert await asyncio.to_thread(describe, w.address, keys.worker, client) == Kind.INFO

    # The worker logged each refused key once, although ZMQ retried the handshakes.
    text = log_of(w)
    assert text.count(f"unauthorized key {keys.rogue_key}") == 1, text[-3000:]
    assert text.count(f"unauthorized key {stranger[0].decode()}") == 1, text[-3000:]

    # Its load reports go to authorized subscribers only.
    load = re.search(r"publishing load every \S+ s on (tcp://\S+)", text)
    assert load is not None, text[-3000:]

    def first_report(keypair: tuple[bytes, bytes] | None, wait_ms: int = 2000) -> bool:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.linger = 0
        try:
            if keypair is not None:
                sub.curve_publickey, sub.curve_secretkey = keypair
                sub.curve_serverkey = keys.worker.encode()
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(load.group(1))
            return bool(sub.poll(2000))
        finally:
            sub.close(0)
            ctx.term()

    # Generous for the one that must arrive (a CURVE handshake on a loaded machine); the
    # refused ones wait the short default, which is all a refusal can be shown by.
    assert await asyncio.to_thread(first_report, client, 20_000)
    assert not await asyncio.to_thread(first_report, None)
    assert not await asyncio.to_thread(first_report, rogue)

    # The mocker's KV replay ROUTER (advertised in the description) refuses them as well.
    info = await asyncio.to_thread(describe_frames, w.address, keys.worker, client)
    assert info is not None
    replay = re.search(rb"tcp://127\.0\.0\.1:\d+", info[1].split(b"kv_replay_endpoint", 1)[1])
    assert replay is not None

    def replay_answers(keypair: tuple[bytes, bytes] | None) -> bool:
        return describe(replay.group().decode(), keys.worker, keypair,
                        payload=[b"", (0).to_bytes(8, "big")]) is not None

    assert await asyncio.to_thread(replay_answers, client)
    assert not await asyncio.to_thread(replay_answers, None)
    assert not await asyncio.to_thread(replay_answers, rogue)


# -- (b), (c) spoofed workers ------------------------------------------------------------------


async def test_spoofed_workers_get_no_requests_and_no_subscription(
    spawn, namespace, tiny_model, keys
) -> None:
    real = worker(spawn, namespace, tiny_model, keys.cluster, "worker")
    rogue = worker(spawn, namespace, tiny_model, keys.rogue, "rogue")  # unauthorized key
    plain = worker(spawn, namespace, tiny_model, None)  # no key at all
    front = frontend(spawn, namespace, keys.cluster)
    for proc in (real, rogue, plain, front):
        proc.wait_ready()
    url = front.address
    real_id = f"{real.instance_id:x}"

    # A fourth advert names the real worker's (trusted) key at an address it does not own: a
    # plain ROUTER that cannot prove the key. It must never see a message.
    zctx = zmq.Context()
    fake = zctx.socket(zmq.ROUTER)
    fake.linger = 0
    fake_port = fake.bind_to_random_port("tcp://127.0.0.1")
    disc = MdnsDiscovery(DiscoveryConfig(mdns_interfaces=("127.0.0.1",)))
    fake_advert = Advert(namespace, 0x5EED, (f"tcp://127.0.0.1:{fake_port}",),
                         ("backend",), public_key=keys.worker)
    try:
        await disc.advertise(fake_advert)

        async def only_real() -> bool:
            return (await health_models(url)).get("tiny") == [real_id]

        await eventually(only_real, 30, "the frontend serving 'tiny' from the real worker")

        async def all_refused() -> bool:
            text = log_of(front)
            return (f"instance {rogue.instance_id:x}" in text
                    and f"instance {plain.instance_id:x}" in text
                    and "CURVE handshake failed" in text)

        await eventually(all_refused, 30, "the three spoofed adverts reported")

        served = set()
        for i in range(8):
            prompt = [(7 * i + j) % 400 + 10 for j in range(4 * BLOCK)]
            served.add(await asyncio.to_thread(complete, url, prompt))
        assert served == {real_id}

        await asyncio.sleep(4)  # mDNS re-announces and re-queries meanwhile: still said once
        text = log_of(front)
        for proc in (rogue, plain):
            lines = [ln for ln in text.splitlines()
                     if f"instance {proc.instance_id:x}" in ln and "not connecting" in ln]
            assert len(lines) == 1, lines
        assert text.count(f"127.0.0.1:{fake_port}: the CURVE handshake failed") == 1
        assert not fake.poll(0), "the fake ROUTER received an application message"

        # KV events and load reports: only the real worker is followed, and its events (over
        # CURVE) fill the index.
        async def indexed() -> dict[str, float] | None:
            _, body = await asyncio.to_thread(get, f"{url}/metrics")
            blocks = metric_workers(body.decode(), "dynamo_router_kv_index_blocks")
            return blocks if blocks.get(real_id, 0) > 0 else None

        blocks = await eventually(indexed, 15, "the real worker's KV events indexed")
        _, body = await asyncio.to_thread(get, f"{url}/metrics")
        page = body.decode()
        assert set(blocks) == {real_id}
        assert set(metric_workers(page, "dynamo_router_reported_active_blocks")) == {real_id}
        loads = re.search(r'^dynamo_router_load_reports_total\{model="tiny"\} (\S+)$', page,
                          re.MULTILINE)
        assert loads is not None and float(loads.group(1)) > 0
        for proc in (rogue, plain):
            assert f"{proc.instance_id:x}" not in page
    finally:
        await disc.close()
        fake.close(0)
        zctx.term()


async def test_static_entries_carry_the_key(spawn, namespace, tiny_model, keys) -> None:
    real = worker(spawn, namespace, tiny_model, keys.cluster, "worker")
    rogue = worker(spawn, namespace, tiny_model, keys.rogue, "rogue")
    for proc in (real, rogue):
        proc.wait_ready()
    peers = ",".join([f"{real.address} key={keys.worker}",
                      f"{rogue.address} key={keys.rogue_key}"])
    front = frontend(spawn, namespace, keys.cluster, "--discovery", "static",
                     "--static-workers", peers).wait_ready()

    async def only_real() -> bool:
        return (await health_models(front.address)).get("tiny") == [f"{real.instance_id:x}"]

    await eventually(only_real, 30, "the frontend serving 'tiny' from the real worker")
    for i in range(4):
        prompt = [(3 * i + j) % 400 + 10 for j in range(2 * BLOCK)]
        assert await asyncio.to_thread(complete, front.address, prompt) == f"{real.instance_id:x}"
    text = log_of(front)
    assert text.count(f"not connecting to {rogue.address}") == 1, text[-3000:]


# -- (d) keys change at runtime ----------------------------------------------------------------


async def test_keys_added_and_revoked_at_runtime(spawn, namespace, tiny_model, keys,
                                                 tmp_path) -> None:
    w = worker(spawn, namespace, tiny_model, keys.cluster, "worker").wait_ready()
    late_dir = tmp_path / "late"
    keys_cli("create", str(late_dir), "--name", "late")
    late = load_keypair(late_dir, "late")
    assert await asyncio.to_thread(describe, w.address, keys.worker, late) is None

    keys_cli("authorize", str(keys.cluster), str(late_dir / "late.key"))

    async def answered() -> bool:
        return await asyncio.to_thread(describe, w.address, keys.worker, late) == Kind.INFO

    await eventually(answered, 15, "the newly authorized key served")

    assert keys_cli("revoke", str(keys.cluster), "late") == "revoked late"

    async def refused() -> bool:
        return await asyncio.to_thread(describe, w.address, keys.worker, late, 1000) is None

    await eventually(refused, 15, "the revoked key refused")
    # The others are still served.
    client = load_keypair(keys.cluster, "client")
    assert await asyncio.to_thread(describe, w.address, keys.worker, client) == Kind.INFO


# -- the CLIs ----------------------------------------------------------------------------------


def test_status_needs_the_keys(spawn, namespace, tiny_model, keys) -> None:
    w = worker(spawn, namespace, tiny_model, keys.cluster, "worker").wait_ready()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base = [sys.executable, "-m", "dynamo_zmq", "status", "--json", "--namespace", namespace,
            "--discovery", "static", "--wait", "3"]
    entry = f"{w.address} key={keys.worker}"
    ok = subprocess.run([*base, "--static-workers", entry, "--auth-keys", str(keys.cluster),
                         "--auth-key-name", "client"], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert {row["instance_id"] for row in json.loads(ok.stdout)} == {f"{w.instance_id:x}"}
    plain = subprocess.run([*base, "--static-workers", w.address], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert f"{w.instance_id:x}" not in plain.stdout


def test_demo_with_auth(tmp_path) -> None:
    keydir = tmp_path / "keys"
    keys_cli("create", str(keydir))
    keys_cli("authorize", str(keydir), str(keydir / "node.key"))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "DYN_AUTH_KEYS": str(keydir)}
    done = subprocess.run([sys.executable, "-m", "dynamo_zmq", "demo", "--discovery", "static",
                           "--delay", "0"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Hello," in done.stdout


# -- the static entry form ---------------------------------------------------------------------


def test_static_entry_form() -> None:
    key = "DBvF+Wpx[R6]@XnTy*Hf(qZDvSB}Bn&Tx3A.]LLZ"
    hashed = "R$CK#d*pj-%l<SwGZ<r=5md/RGB/SGC>eo6A&&XI"  # a key may hold '#'
    assert split_entry("tcp://a:1") == ("tcp://a:1", None)
    assert split_entry(f"tcp://a:1 key={key}") == ("tcp://a:1", key.encode())
    text = (f"# peers\ntcp://a:1\ntcp://b:2 key={key}  # b\ntcp://c:3 key={hashed}#c\n"
            "tcp://d:4#d\n")
    assert parse_static_file(text) == (
        "tcp://a:1", f"tcp://b:2 key={key}", f"tcp://c:3 key={hashed}", "tcp://d:4"
    )
    for bad in ("tcp://a:1 key=short", "tcp://a:1 kee=" + key, f"tcp://a:1 key={key} key={key}"):
        with pytest.raises(InvalidArgument):
            split_entry(bad)
    with pytest.raises(InvalidArgument):
        DiscoveryConfig(backend="static", static_addresses=("tcp://a:1 key=" + "~" * 40,))


async def test_router_service_with_keys(spawn, namespace, tiny_model, keys) -> None:
    w = worker(spawn, namespace, tiny_model, keys.cluster, "worker").wait_ready()
    router = spawn("-m", "router", "--namespace", namespace, "--host", "127.0.0.1",
                   "--wait-for-workers", "1", "--metrics-port", "0",
                   "--auth-keys", str(keys.cluster), "--auth-key-name", "front", ready=False)
    router.wait_ready(60)  # READY only once it follows the worker (over CURVE)
    client = load_keypair(keys.cluster, "client")
    front_key = keys_cli("public", str(keys.cluster), "--name", "front")
    assert await asyncio.to_thread(describe, router.address, front_key, client) == Kind.INFO
    assert await asyncio.to_thread(describe, router.address, None, None) is None
    port = re.search(r"metrics on port (\d+)", log_of(router))
    assert port is not None, log_of(router)[-3000:]

    async def loads() -> bool:
        _, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port.group(1)}/metrics")
        return f'worker="{w.instance_id:x}"' in body.decode()

    await eventually(loads, 15, "the router following the worker's load reports")


@pytest.mark.parametrize("module", ["dynamo_zmq.worker", "dynamo_zmq.frontend", "router"])
def test_bad_keys_are_one_line_errors(module, tmp_path, tiny_model) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    extra = ["--engine", "mocker", "--model-path", str(tiny_model)] if "worker" in module else []
    done = subprocess.run([sys.executable, "-m", module, *extra, "--auth-keys",
                           str(tmp_path / "none")], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: no key file at {tmp_path / 'none' / 'node.key_secret'}"
    ), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


async def test_frontend_follows_key_changes(spawn, namespace, tiny_model, keys,
                                            tmp_path) -> None:
    """A worker refused for its key is used once the key is authorized, and dropped from
    routing when it is revoked, without restarting the frontend."""
    late_dir = tmp_path / "late"
    keys_cli("create", str(late_dir), "--name", "late")
    keys_cli("authorize", str(late_dir), str(keys.cluster / "front.key"))
    real = worker(spawn, namespace, tiny_model, keys.cluster, "worker")
    late = worker(spawn, namespace, tiny_model, late_dir, "late")
    front = frontend(spawn, namespace, keys.cluster)
    for proc in (real, late, front):
        proc.wait_ready()
    real_id, late_id = f"{real.instance_id:x}", f"{late.instance_id:x}"

    async def serving(ids: set[str]):
        async def check() -> bool:
            return set((await health_models(front.address)).get("tiny", [])) == ids
        return check

    async def refused() -> bool:
        return f"instance {late_id}" in log_of(front)

    await eventually(refused, 30, "the late worker refused")
    await eventually(await serving({real_id}), 30, "only the real worker serving")

    keys_cli("authorize", str(keys.cluster), str(late_dir / "late.key"))
    await eventually(await serving({real_id, late_id}), 30, "the late worker used")

    keys_cli("revoke", str(keys.cluster), "late")
    await eventually(await serving({real_id}), 30, "the late worker dropped")
    for i in range(4):
        prompt = [(5 * i + j) % 400 + 10 for j in range(2 * BLOCK)]
        assert await asyncio.to_thread(complete, front.address, prompt) == real_id
