"""A worker's metrics under Dynamo's component names, on Dynamo's system port: a real mocker
worker started with ``DYN_SYSTEM_PORT`` (no flag), scraped over HTTP."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from dynamo_zmq.runtime import system_port_from_env
from tests.support.metrics import sample
from tests.support.procs import system_port


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_worker_metrics_use_dynamo_component_names(
    namespace, spawn, make_runtime, tiny_model
):
    proc = spawn("-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(tiny_model),
                 "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
                 "--speedup-ratio", "1000", env={"DYN_SYSTEM_PORT": "0"})
    port = system_port(proc)
    client = await make_runtime(static=(proc.address,)).endpoint(
        f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    for _ in range(3):
        request = {"token_ids": [1, 2, 3], "stop": {"max_tokens": 4, "ignore_eos": True}}
        chunks = [r.data() async for r in await client.generate(request)]
        assert chunks[-1]["finish_reason"] == "length"

    labels = {"dynamo_namespace": namespace, "dynamo_component": "backend",
              "dynamo_endpoint": "generate", "model": "tiny"}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:  # the KV gauges are refreshed every second
        status, page = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        if (sample(page, "dynamo_component_kvstats_total_blocks", **labels) or 0) > 0:
            break
        assert loop.time() < deadline, page
        await asyncio.sleep(0.2)
    assert sample(page, "dynamo_component_requests_total", **labels) == 3
    assert sample(page, "dynamo_component_inflight_requests", **labels) == 0
    assert sample(page, "dynamo_component_request_duration_seconds_count", **labels) == 3
    assert sample(page, "dynamo_component_cancellation_total", **labels) == 0
    assert sample(page, "dynamo_component_kvstats_active_blocks", **labels) == 0
    assert sample(page, "dynamo_component_kvstats_gpu_cache_usage_percent", **labels) == 0
    assert sample(page, "dynamo_component_uptime_seconds", **labels) > 0
    assert sample(page, "dynamo_component_healthy", **labels) == 1
    assert "dynamo_worker_" not in page
    status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/health")
    assert status == 200 and json.loads(body)["status"] == "healthy"
    assert (await asyncio.to_thread(get, f"http://127.0.0.1:{port}/live"))[0] == 200


def test_system_port_follows_dynamos_variables() -> None:
    assert system_port_from_env({}) is None
    assert system_port_from_env({"DYN_SYSTEM_PORT": "9090"}) == 9090
    assert system_port_from_env({"DYN_SYSTEM_PORT": "-1"}) is None  # Dynamo's "disabled"
    assert system_port_from_env({"DYN_SYSTEM_ENABLED": "true"}) == 8081
    assert system_port_from_env({"DYN_SYSTEM_ENABLED": "true", "DYN_SYSTEM_PORT": "0"}) == 0
    assert system_port_from_env({"DYN_SYSTEM_ENABLED": "false", "DYN_SYSTEM_PORT": "9090"}) is None
    assert system_port_from_env({"DYN_METRICS_PORT": "7000"}) == 7000  # the older name
