"""KV routing end to end, all real processes: a frontend in ``--router-mode kv`` and four mocker
workers with two data-parallel ranks each; ``python -m router`` beside it; a worker killed."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import select
import signal
import subprocess
import sys

import pytest

from dynamo_zmq import errors
from tests.support.completions import complete_header_body
from tests.support.metrics import index_blocks_per_rank, metrics_page
from tests.support.mocker_fleet import mocker_fleet, start_mocker
from tests.support.waiting import eventually

BLOCK = 16
PREFIX_BLOCKS = 6
#: The mocker workers' flags: two data-parallel ranks each.
WORKER = ("--block-size", str(BLOCK), "--data-parallel-size", "2", "--num-gpu-blocks-override",
          "256")


@pytest.fixture
async def cluster(namespace, spawn, tiny_model):
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 4, worker_args=WORKER)
    return fleet.url, fleet.workers


async def test_kv_routing_end_to_end(namespace, spawn, make_runtime, cluster):
    url, workers = cluster
    rng = random.Random(1234)
    prefix = [rng.randrange(10, 500) for _ in range(PREFIX_BLOCKS * BLOCK)]

    # 1. Requests sharing a long prefix land where the first one was served.
    target, _first = await asyncio.to_thread(complete_header_body, url, [*prefix, 1, 2, 3])
    assert re.fullmatch(r"[0-9a-f]+/[01]", target)
    assert target.split("/")[0] in {f"{w.instance_id:x}" for w in workers}

    async def indexed() -> bool:  # the first request's KV events reached the frontend's index
        return index_blocks_per_rank(await metrics_page(url)).get(target, 0) >= PREFIX_BLOCKS

    await eventually(indexed, 15, "the prefix in the frontend's index")
    for i in range(5):
        suffix = [rng.randrange(10, 500) for _ in range(3 + 7 * i)]
        got, _ = await asyncio.to_thread(complete_header_body, url, prefix + suffix)
        assert got == target, f"request {i} with the shared prefix went to {got}, not {target}"

    # 2. Unrelated requests spread over (worker, rank) pairs by load.
    prompts = [[rng.randrange(10, 500) for _ in range(4 * BLOCK)] for _ in range(16)]
    results = await asyncio.gather(*(asyncio.to_thread(complete_header_body, url, p, 48)
                                     for p in prompts))
    pairs = {h for h, _ in results}
    assert len(pairs) >= 4 and len({p.split("/")[0] for p in pairs}) >= 3, pairs

    text = await metrics_page(url)
    assert "dynamo_router_decisions_total" in text and "dynamo_router_kv_hit_rate_bucket" in text
    assert "dynamo_frontend_requests_total" in text  # one /metrics page for both

    # 3. ``python -m router`` answers best_worker as the frontend routed.
    spawn("-m", "router", "--namespace", namespace, "--host", "127.0.0.1")
    client = await make_runtime().endpoint(f"{namespace}.router.best_worker").client()
    await client.wait_for_instances(timeout=15)

    async def best(tokens: list[int] | dict) -> dict:
        request = tokens if isinstance(tokens, dict) else {"model": "tiny", "token_ids": tokens}
        stream = await client.generate(request)
        answers = [r.data() async for r in stream]
        assert len(answers) == 1
        return answers[0]

    async def router_knows() -> dict | None:
        try:
            answer = await best([*prefix, 42])
        except Exception:  # the model is not followed yet
            return None
        return answer if answer["overlap_blocks"] >= PREFIX_BLOCKS else None

    answer = await eventually(router_knows, 20, "python -m router following the workers")
    assert f"{answer['worker_id']:x}/{answer['dp_rank']}" == target
    assert answer["matches"][target] >= PREFIX_BLOCKS and answer["prompt_blocks"] == PREFIX_BLOCKS
    for bad, message in [({"model": "nosuch", "token_ids": [1]}, "unknown model"),
                         ({"model": "tiny", "token_ids": []}, "must not be empty"),
                         ({"model": "tiny", "token_ids": [5, -1]}, "token ids must be ints"),
                         ({"model": "tiny", "token_ids": [2**40]}, "token ids must be ints"),
                         ({"model": "tiny", "token_ids": "abc"}, "invalid request")]:
        with pytest.raises(errors.InvalidArgument, match=message):
            await best(bad)
    assert (await best([*prefix, 42]))["overlap_blocks"] >= PREFIX_BLOCKS  # still serving

    # 4. Kill the worker holding the prefix: its blocks leave both indexes, others serve.
    victim = next(w for w in workers if f"{w.instance_id:x}" == target.split("/")[0])
    victim.signal(signal.SIGKILL)
    victim.wait()

    async def forgotten() -> bool:
        return not any(
            k.startswith(f"{victim.instance_id:x}/")
            for k in index_blocks_per_rank(await metrics_page(url))
        )

    await eventually(forgotten, 15, "the killed worker's blocks leaving the frontend's index")
    got, body = await asyncio.to_thread(complete_header_body, url, [*prefix, 1, 2, 3])
    assert (
        not got.startswith(f"{victim.instance_id:x}/")
        and body["choices"][0]["finish_reason"] == "length"
    )

    async def router_forgot() -> bool:
        try:
            answer = await best([*prefix, 42])
        except errors.CannotConnect:
            # python -m router may have described only the victim so far (the others are still
            # being discovered): "no live instance" is then its right answer, for now.
            return False
        return not any(k.startswith(f"{victim.instance_id:x}/") for k in answer["matches"])

    await eventually(router_forgot, 15, "the killed worker leaving python -m router's index")


async def test_approximate_kv_routing_without_kv_events(namespace, spawn, tiny_model):
    """``--no-kv-events``: engines publish nothing; the frontend predicts caches from its own
    decisions. Streaming responses carry the routing header too."""
    url = (await mocker_fleet(
        spawn, namespace, tiny_model, 2,
        worker_args=("--block-size", str(BLOCK), "--data-parallel-size", "2", "--no-kv-events"),
        frontend_args=("--no-kv-events", "--router-temperature", "0"))).url
    prefix = list(range(20, 20 + 4 * BLOCK))
    target, _ = await asyncio.to_thread(complete_header_body, url, [*prefix, 5])
    for tail in ([6], [7, 8], list(range(30, 60))):
        got, _ = await asyncio.to_thread(complete_header_body, url, prefix + tail)
        assert got == target

    def stream_header() -> tuple[str, bytes]:
        body = json.dumps(
            {"model": "tiny", "prompt": [*prefix, 9], "max_tokens": 3, "stream": True}
        )
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.getheader("x-dynamo-worker") or "", resp.read()
        finally:
            conn.close()

    header, sse = await asyncio.to_thread(stream_header)
    assert header == target and sse.rstrip().endswith(b"data: [DONE]")

    async def gauged() -> bool:  # the gauges follow within a second
        return index_blocks_per_rank(await metrics_page(url)).get(target, 0) >= 4

    await eventually(gauged, 5, "the routed prefix in the index-size gauge")


async def test_router_service_waits_for_workers(namespace, spawn, tiny_model):
    """``python -m router --wait-for-workers 2`` serves (prints READY) only once it follows two
    workers: with one it waits, and the second one releases it."""
    first = start_mocker(spawn, namespace, tiny_model, *WORKER).wait_ready()
    router = spawn("-m", "router", "--namespace", namespace, "--host", "127.0.0.1",
                   "--wait-for-workers", "2", ready=False)

    async def waiting_on_one() -> bool:
        return "waiting for 2 workers (1 seen)" in router.logs()

    await eventually(waiting_on_one, 30, "the router following the first worker")
    assert router.popen.poll() is None
    readable, _, _ = select.select([router.popen.stdout], [], [], 0)
    assert not readable, "READY printed with one worker of two"
    second = start_mocker(spawn, namespace, tiny_model, *WORKER).wait_ready()
    await asyncio.to_thread(router.wait_ready, 30)
    assert "following 2 workers" in router.logs() and first.instance_id != second.instance_id


@pytest.mark.parametrize(("flags", "message"), [
    (["--wait-for-workers", "-1"], "--wait-for-workers must be >= 0"),
    (["--namespace", "a.b"], "namespace name 'a.b' must be non-empty"),
    (["--component", "x y"], "component name 'x y' must be non-empty"),
])
def test_bad_router_service_flags_are_usage_errors(flags, message):
    res = subprocess.run([sys.executable, "-m", "router", *flags],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_the_router_service_on_a_taken_port_fails_with_one_clear_line(flag, taken_port):
    port = taken_port
    res = subprocess.run([sys.executable, "-m", "router", "--discovery", "static",
                          "--host", "127.0.0.1", flag, str(port)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    assert (
        f"127.0.0.1:{port}: Address already in use" in res.stderr
        and "Traceback" not in res.stderr
    )
