"""python -m dynamo_zmq.worker as users run it: discovery, streaming, model files, health,
metrics, engine plugins, and the shutdown order under load."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from dynamo_zmq import errors
from dynamo_zmq.llm import Capability, ModelAdvert, ModelCard
from dynamo_zmq.runtime import Context
from tests.support.metrics import sample
from tests.support.procs import system_port
from tests.support.waiting import until


def worker_args(namespace: str, model: str, *extra: str) -> list[str]:
    return [
        "-m", "dynamo_zmq.worker", "--model-path", model, "--namespace", namespace,
        "--host", "127.0.0.1", *extra,
    ]


def request(tokens, max_tokens=8, **stop):
    return {"token_ids": tokens, "stop": {"max_tokens": max_tokens, **stop}}


async def outputs(stream) -> list[dict]:
    return [r.data() async for r in stream]


async def test_mocker_worker_is_discovered_and_streams(namespace, spawn, make_runtime, tiny_model):
    proc = spawn(
        *worker_args(namespace, str(tiny_model), "--engine", "mocker", "--speedup-ratio", "1000")
    )
    client = await make_runtime().endpoint(f"{namespace}.backend.generate").client()
    assert await client.wait_for_instances(timeout=15) == [proc.instance_id]
    chunks = await outputs(await client.generate(request(list(range(1, 40)), max_tokens=12)))
    tokens = [t for c in chunks for t in c.get("token_ids", [])]
    assert len(tokens) == 12
    assert [c.get("finish_reason") for c in chunks].count("length") == 1
    assert chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 12


async def test_model_card_and_files_come_from_the_worker(
    namespace, spawn, make_runtime, tiny_model
):
    proc = spawn(
        *worker_args(namespace, str(tiny_model), "--engine", "mocker", "--model-name", "tiny")
    )
    rt = make_runtime(static=(proc.address,))
    client = await rt.endpoint(f"{namespace}.backend.model_files").client()
    await client.wait_for_instances(timeout=15)
    (peer,) = [p for p in await rt.peers() if p.description]
    (info,) = [e for e in peer.description.endpoints if e.name == "generate"]
    import msgspec

    card = msgspec.convert(info.metadata["model_card"], ModelCard)
    assert card.name == "tiny" and card.context_length > 0 and card.kv_block_size > 0
    assert {f.name for f in card.files} >= {
        "tokenizer.json", "tokenizer_config.json", "config.json"
    }
    for f in card.files:
        data = b"".join([r.data() async for r in await client.generate({"name": f.name})])
        assert len(data) == f.size and hashlib.sha256(data).hexdigest() == f.sha256
        assert data == (tiny_model / f.name).read_bytes()
    with pytest.raises(errors.InvalidArgument):
        async for _ in await client.generate({"name": "../../etc/passwd"}):
            pass
    assert info.metadata["engine"]["model_name"]
    # The engine's name and capabilities travel in the advert (frontends refuse what it lacks).
    assert info.metadata["engine_name"] == "mocker"
    advert = ModelAdvert.from_metadata(info.metadata)
    assert advert is not None and set(advert.capabilities) <= {
        v for k, v in vars(Capability).items() if k.isupper()
    }


async def test_health_and_metrics(namespace, spawn, make_runtime, tiny_model):
    proc = spawn(*worker_args(namespace, str(tiny_model), "--engine", "mocker",
                              "--metrics-port", "0", "--speedup-ratio", "1000"))
    client = await (
        make_runtime(static=(proc.address,)).endpoint(f"{namespace}.backend.generate").client()
    )
    await client.wait_for_instances(timeout=15)
    port = system_port(proc)
    await outputs(await client.generate(request([1, 2, 3], max_tokens=5)))

    def get(path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    status, body = await asyncio.to_thread(get, "/health")
    assert status == 200 and json.loads(body)["status"] == "healthy"
    status, body = await asyncio.to_thread(get, "/metrics")
    assert status == 200
    assert sample(body, "dynamo_component_requests_total", dynamo_namespace=namespace) == 1
    assert "dynamo_component_time_to_first_token_seconds_bucket" in body
    assert (await asyncio.to_thread(get, "/live"))[0] == 200


async def test_third_party_engine_by_module_and_cancellation(
    namespace, spawn, make_runtime, tiny_model
):
    proc = spawn(*worker_args(namespace, str(tiny_model),
                              "--engine", "tests.support.engines:EchoEngine",
                              "--echo-delay", "0.02", "--metrics-port", "0"))
    client = await (
        make_runtime(static=(proc.address,)).endpoint(f"{namespace}.backend.generate").client()
    )
    await client.wait_for_instances(timeout=15)
    chunks = await outputs(await client.generate(request([5, 6, 7], max_tokens=3)))
    assert [c["token_ids"] for c in chunks[:-1]] == [[5], [6], [7]]

    ctx = Context()
    got = []
    async for r in await client.generate(request([9] * 4, max_tokens=1000), context=ctx):
        got.append(r.data())
        if len(got) == 3:
            ctx.stop()
    assert got[-1]["finish_reason"] == "cancelled" and len(got) < 1000
    port = system_port(proc)
    body = await asyncio.to_thread(
        lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{port}/metrics", timeout=5
        ).read().decode()
    )
    assert sample(body, "dynamo_component_cancellation_total", model="echo") == 1


def test_bad_engine_and_missing_model_fail_clearly(tmp_path, tiny_model):
    run = [sys.executable, "-m", "dynamo_zmq.worker", "--model-path", str(tmp_path)]
    res = subprocess.run([*run, "--engine", "nosuch"], capture_output=True, text=True, timeout=60)
    assert (
        res.returncode == 2
        and "unknown engine 'nosuch'" in res.stderr
        and "mocker" in res.stderr
    )
    res = subprocess.run([*run[:-2], "--model-path", str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "not a directory" in res.stderr
    for flags, message in [(["--namespace", "a.b"], "namespace name 'a.b' must be non-empty"),
                           (["--endpoint", ""], "endpoint name '' must be non-empty"),
                           (["--block-size", "0"], "block_size must be >= 1"),
                           (["--speedup-ratio", "nan"], "speedup_ratio must be > 0")]:
        res = subprocess.run([*run[:-1], str(tiny_model), "--engine", "mocker", *flags],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
    (tmp_path / "config.json").write_text("{not json")
    res = subprocess.run([*run, "--engine", "mocker"], capture_output=True, text=True, timeout=60)
    assert (
        res.returncode == 2
        and "config.json is not valid JSON" in res.stderr
        and "Traceback" not in res.stderr
    )
    (tmp_path / "config.json").unlink()
    res = subprocess.run([*run, "--engine", "mocker"], capture_output=True, text=True, timeout=60)
    assert (
        res.returncode == 2
        and "config.json not found" in res.stderr
        and "Traceback" not in res.stderr
    )
    for bad in ("10", "-1"):  # reports slower than routers' TTL would expire between sends
        res = subprocess.run([*run, "--load-interval", bad],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and "--load-interval must be" in res.stderr


async def test_sigterm_under_load_drains_and_hands_over(namespace, spawn, make_runtime, tiny_model):
    args = ("--engine", "tests.support.engines:EchoEngine", "--echo-delay", "0.02",
            "--grace-period", "0.5")
    leaving = spawn(*worker_args(namespace, str(tiny_model), *args))
    staying = spawn(*worker_args(namespace, str(tiny_model), *args))
    client = await make_runtime().endpoint(f"{namespace}.backend.generate").client()
    assert await until(client, lambda: len(client.instance_ids()) == 2, timeout=15)

    inflight = [
        await client.direct(request([1, 2, 3], max_tokens=40), leaving.instance_id)
        for _ in range(8)
    ]
    first = [await s.__anext__() for s in inflight]  # all running on the leaving worker
    leaving.signal(signal.SIGTERM)
    assert await until(client, lambda: client.instance_ids() == [staying.instance_id], timeout=5)

    # New requests go to the other worker while the old ones finish where they started.
    new = [await client.generate(request([4], max_tokens=3)) for _ in range(6)]
    assert {s.instance_id for s in new} == {staying.instance_id}
    for stream in new:
        assert (await outputs(stream))[-1]["finish_reason"] == "length"
    for head, stream in zip(first, inflight, strict=True):
        chunks = [head.data(), *await outputs(stream)]
        assert sum(len(c.get("token_ids", [])) for c in chunks) == 40
        assert chunks[-1]["finish_reason"] == "length"
    assert await asyncio.to_thread(leaving.wait, 30) == 0


def test_help_lists_the_engines_own_flags():
    res = subprocess.run(
        [sys.executable, "-m", "dynamo_zmq.worker", "--engine", "mocker", "--help"],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0 and "--speedup-ratio" in res.stdout and "--model-path" in res.stdout


@pytest.mark.parametrize(("main", "var", "flag"), [
    ("dynamo_zmq.worker", "DYN_LOAD_INTERVAL", "--load-interval"),
    ("dynamo_zmq.worker", "DYN_PORT", "--port"),
    ("dynamo_zmq.frontend", "DYN_HTTP_PORT", "--http-port"),
    ("dynamo_zmq.frontend", "DYN_ROUTER_TEMPERATURE", "--router-temperature"),
    ("router", "DYN_LOAD_REPORT_TTL", "--load-report-ttl"),
])
def test_a_bad_dyn_variable_is_a_usage_error_not_a_traceback(main, var, flag):
    """A ``DYN_*`` default that does not parse fails like the flag it stands for."""
    res = subprocess.run([sys.executable, "-m", main], capture_output=True, text=True, timeout=60,
                         env={**os.environ, var: "not-a-number"})
    assert res.returncode == 2, res.stderr
    assert f"argument {flag}: invalid" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "flag", ["--port", "--load-port", "--kv-events-port", "--kv-replay-port", "--metrics-port"]
)
def test_a_taken_port_fails_the_start_with_one_clear_line(flag, tiny_model, taken_port):
    port = taken_port
    res = subprocess.run([sys.executable, *worker_args("ns", str(tiny_model), "--engine", "mocker",
                                                        "--discovery", "static", flag, str(port))],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    assert (
        f"127.0.0.1:{port}: Address already in use" in res.stderr
        and "Traceback" not in res.stderr
    )
