"""Disaggregated prefill and decode with real mocker worker processes, driven through the
runtime API (not the frontend): a prefill-role worker returns the KV handoff on its terminal, a
decode-role worker pulls the KV over the brokerless transfer instead of prefilling, and every
failure (refused offer, expired transfer, prefill worker killed mid-transfer) ends in a local
prefill with the same output. The workers' metrics show each part."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from dynamo_zmq.kv_transfer import Pull, encode
from dynamo_zmq.llm import BlockStored
from engines.mocker._hashing import chain_hashes
from router.events import decode_batch
from tests.support.metrics import sample
from tests.support.procs import ROOT, Proc, system_port

BLOCK = 16
_rng = random.Random(17)
PROMPT = [_rng.randrange(1, 200) for _ in range(300)]  # 19 blocks, the last partial
NUM_BLOCKS = -(-len(PROMPT) // BLOCK)


def worker(spawn, namespace: str, model: Path, role: str, *extra: str, ready: bool = True,
           engine: str = "mocker") -> Proc:
    return spawn("-m", "dynamo_zmq.worker", "--engine", engine, "--model-path", str(model),
                 "--model-name", "tiny", "--namespace", namespace, "--component", role,
                 "--host", "127.0.0.1", "--discovery", "static", "--disaggregation-mode", role,
                 # (vLLM-shaped KV events: stored_hashes reads their engine block hashes)
                 *(("--block-size", str(BLOCK), "--speedup-ratio", "100", "--kv-event-form",
                    "stores") if engine == "mocker" else ()), *extra,
                 env={"DYN_SYSTEM_PORT": "0"}, ready=ready)


async def client_of(make_runtime, proc: Proc, namespace: str, role: str):
    client = await (make_runtime(static=(proc.address,))
                    .endpoint(f"{namespace}.{role}.generate").client())
    await client.wait_for_instances(timeout=15)
    return client


async def generate(client, prompt: list[int], max_tokens: int,
                   params: dict | None = None) -> list[dict]:
    req: dict = {"token_ids": prompt, "stop": {"max_tokens": max_tokens}}
    if params is not None:
        req["disaggregation"] = params
    return [r.data() async for r in await client.generate(req)]


def pulling(handoff: dict) -> dict:
    """A decode request's ``disaggregation``: pull the KV ``handoff`` names."""
    return {"type": "prefill_remotely", "handoff": handoff}


async def prefill(client, prompt: list[int] = PROMPT) -> dict | None:
    chunks = await generate(client, prompt, 1, {"type": "decode_remotely"})
    assert chunks[-1]["finish_reason"] == "length", chunks[-1]
    assert all("kv_handoff" not in c for c in chunks[:-1])
    return chunks[-1].get("kv_handoff")


def tokens(chunks: list[dict]) -> list[int]:
    return [t for c in chunks for t in c.get("token_ids", [])]


def metrics(proc: Proc) -> str:
    port = system_port(proc)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def value(proc: Proc, name: str, **labels: str) -> float:
    return sample(metrics(proc), name, **labels) or 0.0


async def stored_hashes(client) -> list[int]:
    """Every block hash the worker behind ``client`` published as stored (its KV-event replay
    from the first batch)."""
    desc = json.dumps(msgspec.to_builtins(client.instances()[0].description))
    match = re.search(r'"kv_replay_endpoint": "([^"]+)"', desc)
    assert match, desc
    zctx = zmq.asyncio.Context()
    dealer = zctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(match.group(1))
    stored: list[int] = []
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while (frames := await asyncio.wait_for(dealer.recv_multipart(), 10))[1]:
            for event in decode_batch(frames[3]).events:
                if isinstance(event, BlockStored):
                    stored.extend(event.block_hashes)
    finally:
        dealer.close()
        zctx.term()
    return stored


async def eventually(check, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"{what} not reached in {timeout}s"
        await asyncio.sleep(0.1)


@pytest.fixture
def model(tiny_model) -> Path:
    return tiny_model


async def test_a_decode_worker_pulls_the_prefilled_kv_and_streams_the_same_output(
    namespace, spawn, make_runtime, model
):
    pw, dw = worker(spawn, namespace, model, "prefill"), worker(spawn, namespace, model, "decode")
    p, d = await client_of(make_runtime, pw, namespace, "prefill"), await client_of(
        make_runtime, dw, namespace, "decode")
    assert "KV transfers served on tcp://127.0.0.1:" in pw.logs()
    prefilled_before = value(pw, "mocker_prefill_tokens_total")
    handoff = await prefill(p)
    assert handoff is not None and handoff["num_blocks"] == NUM_BLOCKS
    assert handoff["num_bytes"] == len(PROMPT) * 131072  # the default --kv-bytes-per-token
    assert handoff["transfer_endpoint"].startswith("tcp://127.0.0.1:")
    assert value(pw, "mocker_prefill_tokens_total") - prefilled_before == len(PROMPT)
    assert value(pw, "dynamo_component_kv_transfer_held") == 1

    decoded_before = value(dw, "mocker_prefill_tokens_total")
    chunks = await generate(d, PROMPT, 8, pulling(handoff))
    assert chunks[-1]["finish_reason"] == "length" and len(tokens(chunks)) == 8
    # The prompt was pulled, not prefilled: the decode worker computed none of it.
    assert value(dw, "mocker_prefill_tokens_total") == decoded_before
    assert value(dw, "mocker_remote_prefills_total") == 1
    assert value(dw, "mocker_remote_prefill_blocks_total") == NUM_BLOCKS
    assert value(dw, "mocker_kv_transfer_modeled_seconds_total") > 0
    moved = value(dw, "dynamo_component_kv_transfer_received_bytes_total")
    assert moved > 0 and value(pw, "dynamo_component_kv_transfer_sent_bytes_total") == moved
    await eventually(lambda: value(pw, "dynamo_component_kv_transfer_held") == 0,
                     what="the prefill worker releasing the transfer")
    assert value(pw, "dynamo_component_kv_transfer_held_bytes") == 0
    # Both workers published the prompt's full blocks as stored: the prefill worker from its
    # prefill, the decode worker from the transfer.
    full = chain_hashes(PROMPT, BLOCK)
    assert set(full) <= set(await stored_hashes(p))
    assert set(full) <= set(await stored_hashes(d))
    # The same request served aggregated (the decode worker prefills it) streams the same.
    again = await generate(d, PROMPT, 8)
    assert tokens(again) == tokens(chunks)
    # The prefill worker's blocks stayed as prefix cache: the same prompt again is cached.
    cached = await generate(p, PROMPT, 1, {"type": "decode_remotely"})
    assert cached[-1]["usage"]["cached_tokens"] == (len(PROMPT) // BLOCK) * BLOCK


async def test_an_offer_beyond_max_bytes_hands_off_nothing_and_decode_prefills_locally(
    namespace, spawn, make_runtime, model
):
    pw = worker(spawn, namespace, model, "prefill", "--kv-bytes-per-token", "1000",
                "--kv-transfer-max-bytes", "400000")
    dw = worker(spawn, namespace, model, "decode")
    p, d = await client_of(make_runtime, pw, namespace, "prefill"), await client_of(
        make_runtime, dw, namespace, "decode")
    assert await prefill(p) is not None  # 300 000 bytes held
    other = [t + 1 for t in PROMPT]
    assert await prefill(p, other) is None  # 300 000 more would exceed the bound
    assert value(pw, "dynamo_component_kv_transfer_refused_total") == 1
    before = value(dw, "mocker_prefill_tokens_total")
    chunks = await generate(d, other, 4, {"type": "prefill_remotely"})  # no handoff
    assert len(tokens(chunks)) == 4
    assert value(dw, "mocker_prefill_tokens_total") - before == len(other)
    assert value(dw, "mocker_remote_prefills_total") == 0


async def test_an_unpulled_transfer_expires_and_decode_falls_back_to_a_local_prefill(
    namespace, spawn, make_runtime, model
):
    pw = worker(spawn, namespace, model, "prefill", "--kv-transfer-ttl", "0.5")
    dw = worker(spawn, namespace, model, "decode")
    p, d = await client_of(make_runtime, pw, namespace, "prefill"), await client_of(
        make_runtime, dw, namespace, "decode")
    handoff = await prefill(p)
    assert handoff is not None
    await eventually(lambda: value(pw, "dynamo_component_kv_transfer_expired_total") == 1,
                     what="the transfer expiring")
    assert value(pw, "dynamo_component_kv_transfer_held") == 0
    before = value(dw, "mocker_prefill_tokens_total")
    chunks = await generate(d, PROMPT, 4, pulling(handoff))
    assert chunks[-1]["finish_reason"] == "length" and len(tokens(chunks)) == 4
    assert value(dw, "mocker_remote_prefill_fallbacks_total") == 1
    assert value(dw, "mocker_prefill_tokens_total") - before == len(PROMPT)


async def test_killing_the_prefill_worker_mid_transfer_still_completes_the_request(
    namespace, spawn, make_runtime, model
):
    # 300 tokens x 1000 bytes at 10 kB/s / speedup 10: a 3 s pull, one block per batch.
    pw = worker(spawn, namespace, model, "prefill", "--kv-bytes-per-token", "1000",
                "--kv-transfer-batch-blocks", "1")
    dw = worker(spawn, namespace, model, "decode", "--kv-transfer-bandwidth", "0.00001",
                "--kv-transfer-credit", "1", "--kv-transfer-timeout", "1", "--speedup-ratio",
                "10")
    p, d = await client_of(make_runtime, pw, namespace, "prefill"), await client_of(
        make_runtime, dw, namespace, "decode")
    handoff = await prefill(p)
    assert handoff is not None
    request = asyncio.ensure_future(
        generate(d, PROMPT, 6, pulling(handoff)))
    await eventually(
        lambda: value(dw, "dynamo_component_kv_transfer_received_bytes_total") > 0,
        what="the pull starting")
    pw.signal(signal.SIGKILL)
    chunks = await asyncio.wait_for(request, 30)
    assert chunks[-1]["finish_reason"] == "length" and len(tokens(chunks)) == 6
    assert value(dw, "mocker_remote_prefill_fallbacks_total") == 1
    assert value(dw, "mocker_remote_prefills_total") == 0
    assert tokens(await generate(d, PROMPT, 6)) == tokens(chunks)


async def test_garbage_on_the_transfer_socket_does_not_stop_the_worker(
    namespace, spawn, make_runtime, model
):
    pw, dw = worker(spawn, namespace, model, "prefill"), worker(spawn, namespace, model, "decode")
    p, d = await client_of(make_runtime, pw, namespace, "prefill"), await client_of(
        make_runtime, dw, namespace, "decode")
    handoff = await prefill(p)
    assert handoff is not None
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(handoff["transfer_endpoint"])
        rng = random.Random(3)
        for _ in range(50):
            sock.send_multipart([rng.randbytes(rng.randrange(0, 64))
                                 for _ in range(rng.randrange(1, 4))])
        sock.send(encode(Pull("not-a-transfer", 1)))  # answered: unknown
        assert sock.poll(5000)
    finally:
        sock.close()
        zctx.term()
    assert pw.running()
    await eventually(lambda: value(pw, "dynamo_component_malformed_input_total",
                                   kind="kv_transfer_frame") > 0, what="garbage counted")
    chunks = await generate(d, PROMPT, 4, pulling(handoff))
    assert len(tokens(chunks)) == 4 and value(dw, "mocker_remote_prefills_total") == 1


async def test_an_engine_without_disaggregation_refuses_a_disaggregated_role(
    namespace, spawn, model
):
    proc = worker(spawn, namespace, model, "prefill", engine="tests.support.engines:EchoEngine",
                  ready=False)
    assert proc.wait(30) == 1
    assert "does not support disaggregated serving" in proc.logs()


def keys_cli(*args: str) -> str:
    """``python -m dynamo_zmq.keys ARGS`` (the real CLI); its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "dynamo_zmq.keys", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def answered(endpoint: str, keypair: tuple[bytes, bytes] | None, server_key: str,
             payload: bytes) -> bool:
    """Whether a fresh DEALER (plaintext when ``keypair`` is None) gets any answer."""
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        if keypair is not None:
            sock.curve_publickey, sock.curve_secretkey = keypair
            sock.curve_serverkey = server_key.encode()
        sock.connect(endpoint)
        sock.send(payload)
        return bool(sock.poll(1500))
    finally:
        sock.close(0)
        zctx.term()


async def test_with_auth_keys_the_transfer_uses_curve_and_refuses_unauthorized_clients(
    namespace, spawn, model, tmp_path
):
    from dynamo_zmq.discovery import DiscoveryConfig
    from dynamo_zmq.runtime import DistributedRuntime, RuntimeConfig
    from dynamo_zmq.tools.keys import load_keypair
    from dynamo_zmq.transport import disable_curve

    cluster, rogue = tmp_path / "cluster", tmp_path / "rogue"
    made = {name: keys_cli("create", str(cluster), "--name", name)
            for name in ("prefill", "decode", "client")}
    for name in made:
        keys_cli("authorize", str(cluster), str(cluster / f"{name}.key"))
    keys_cli("create", str(rogue), "--name", "rogue")
    pw = worker(spawn, namespace, model, "prefill", "--auth-keys", str(cluster),
                "--auth-key-name", "prefill")
    dw = worker(spawn, namespace, model, "decode", "--auth-keys", str(cluster),
                "--auth-key-name", "decode")
    runtimes = []

    async def client(proc: Proc, role: str):
        entry = f"{proc.address} key={made[role]}"
        rt = DistributedRuntime(config=RuntimeConfig(
            discovery=DiscoveryConfig(backend="static", static_addresses=(entry,)),
            host="127.0.0.1", auth_keys=str(cluster), auth_key_name="client"))
        runtimes.append(rt)
        c = await rt.endpoint(f"{namespace}.{role}.generate").client()
        await c.wait_for_instances(timeout=15)
        return c

    try:
        p, d = await client(pw, "prefill"), await client(dw, "decode")
        handoff = await prefill(p)
        assert handoff is not None and handoff["transfer_key"] == made["prefill"]
        pull = encode(Pull(handoff["transfer_id"], 1))
        endpoint = handoff["transfer_endpoint"]
        rogue_pair = load_keypair(rogue, "rogue")
        assert not await asyncio.to_thread(answered, endpoint, rogue_pair, made["prefill"], pull)
        assert not await asyncio.to_thread(answered, endpoint, None, made["prefill"], pull)
        assert "refused a connection from unauthorized key" in pw.logs()
        assert value(pw, "dynamo_component_kv_transfer_held") == 1  # still there for decode
        chunks = await generate(d, PROMPT, 4, pulling(handoff))
        assert len(tokens(chunks)) == 4
        assert value(dw, "mocker_remote_prefills_total") == 1  # pulled over CURVE
    finally:
        for rt in runtimes:
            await rt.close()
        disable_curve()


async def test_stopping_a_decode_request_mid_pull_releases_the_transfer_on_the_prefill_worker(
    namespace, spawn, make_runtime, model
):
    from dynamo_zmq.context import Context

    pw = worker(spawn, namespace, model, "prefill", "--kv-bytes-per-token", "1000",
                "--kv-transfer-batch-blocks", "1")
    dw = worker(spawn, namespace, model, "decode", "--kv-transfer-bandwidth", "0.00001",
                "--kv-transfer-credit", "1", "--speedup-ratio", "10")
    p, d = await client_of(make_runtime, pw, namespace, "prefill"), await client_of(
        make_runtime, dw, namespace, "decode")
    handoff = await prefill(p)
    assert handoff is not None
    ctx = Context("stop-mid-pull")
    req = {"token_ids": PROMPT, "stop": {"max_tokens": 6},
           "disaggregation": pulling(handoff)}
    stream = await d.generate(req, context=ctx)
    reading = asyncio.ensure_future(_collect(stream))
    await eventually(
        lambda: value(dw, "dynamo_component_kv_transfer_received_bytes_total") > 0,
        what="the pull starting")
    ctx.stop()
    chunks = await asyncio.wait_for(reading, 30)
    assert chunks[-1]["finish_reason"] == "cancelled" and not tokens(chunks)
    await eventually(lambda: value(pw, "dynamo_component_kv_transfer_held") == 0,
                     what="the prefill worker releasing the transfer")
    assert value(pw, "dynamo_component_kv_transfer_expired_total") == 0  # released, not expired
    assert value(dw, "mocker_remote_prefill_fallbacks_total") == 0


async def _collect(stream) -> list[dict]:
    return [r.data() async for r in stream]
