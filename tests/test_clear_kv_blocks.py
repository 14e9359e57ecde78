"""``clear_kv_blocks`` through real processes: the frontend's ``POST /clear_kv_blocks`` calls the
endpoint of every worker of a model; the mocker empties its prefix cache and publishes the KV
events that make the KV router's index forget the blocks; an engine without the hook is listed
as failed (``Unsupported``)."""

from __future__ import annotations

import asyncio
import json
import random
import urllib.error
import urllib.request

import openai

from tests.support.metrics import index_blocks
from tests.support.mocker_fleet import mocker_fleet, start_frontend
from tests.support.procs import Proc
from tests.support.waiting import eventually

BLOCK = 16
PROMPT_BLOCKS = 8


def worker(spawn, namespace, model, *extra: str, name: str = "tiny",
           engine: str = "mocker") -> Proc:
    args = ["-m", "dynamo_zmq.worker", "--engine", engine, "--model-path", str(model),
            "--model-name", name, "--namespace", namespace, "--host", "127.0.0.1", *extra]
    if engine == "mocker":
        args += ["--speedup-ratio", "100", "--block-size", str(BLOCK)]
    return spawn(*args)


def frontend(spawn, namespace, *extra: str) -> str:
    return start_frontend(spawn, namespace, *extra, mode=None).wait_ready().address


def request(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def routed_instances(url: str, model: str) -> set[str]:
    _, body = await asyncio.to_thread(request, "GET", f"{url}/health")
    return set(json.loads(body).get("models", {}).get(model, []))


async def test_clear_kv_blocks_empties_the_mocker_and_the_routers_index(
    namespace, spawn, tiny_model
):
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 2, speedup="100",
                               worker_args=("--block-size", str(BLOCK)))
    url, ids = fleet.url, fleet.ids
    rng = random.Random(11)
    prompt = [rng.randrange(10, 500) for _ in range(PROMPT_BLOCKS * BLOCK + 3)]
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:

        async def complete() -> tuple[str, int]:
            raw = await client.completions.with_raw_response.create(
                model="tiny", prompt=prompt, max_tokens=2
            )
            usage = raw.parse().usage
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            return raw.headers["x-dynamo-worker"].split("/")[0], cached or 0

        target, _ = await complete()

        async def indexed() -> bool:
            return (await index_blocks(url)).get(target, 0) >= PROMPT_BLOCKS

        await eventually(indexed, 15, "the prompt's blocks in the router's index")
        again, cached = await complete()
        assert again == target and cached >= PROMPT_BLOCKS * BLOCK  # the mocker's cache hit

        status, body = await asyncio.to_thread(
            request, "POST", f"{url}/clear_kv_blocks", json.dumps({"model": "tiny"}).encode()
        )
        assert status == 200, body
        answer = json.loads(body)
        assert answer["failed_workers"] == []
        cleared = answer["cleared_workers"]
        assert {c["name"] for c in cleared} == {
            f"{namespace}/backend-instance-{i}" for i in ids
        }
        assert all(c["response"]["status"] == "success" and c["model"] == "tiny"
                   for c in cleared)
        assert all(c["endpoint"] == f"{namespace}/backend/clear_kv_blocks" for c in cleared)

        async def forgotten() -> bool:
            return not any((await index_blocks(url)).values())

        await eventually(forgotten, 15, "the router's index emptied by the workers' KV events")
        _, cached = await complete()
        assert cached == 0, "the mocker still served the prompt from its prefix cache"


async def test_clear_kv_blocks_reports_an_engine_without_it_and_checks_the_model(
    namespace, spawn, tiny_model
):
    mocker = worker(spawn, namespace, tiny_model)
    echo = worker(spawn, namespace, tiny_model, name="echo",
                  engine="tests.support.engines:EchoEngine")
    url = frontend(spawn, namespace)

    async def both_models() -> bool:
        return (await routed_instances(url, "tiny") == {f"{mocker.instance_id:x}"}
                and await routed_instances(url, "echo") == {f"{echo.instance_id:x}"})

    await eventually(both_models, 30, "both models served")
    # No body: every model's workers (Dynamo's route clears every worker it knows).
    status, body = await asyncio.to_thread(request, "POST", f"{url}/clear_kv_blocks", b"")
    assert status == 200, body
    answer = json.loads(body)
    assert [c["model"] for c in answer["cleared_workers"]] == ["tiny"]
    (failed,) = answer["failed_workers"]
    assert failed["model"] == "echo"
    assert failed["name"] == f"{namespace}/backend-instance-{echo.instance_id:x}"
    assert failed["error"].startswith("Unsupported:")

    status, body = await asyncio.to_thread(
        request, "POST", f"{url}/clear_kv_blocks", b'{"model": "nope"}'
    )
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    status, _ = await asyncio.to_thread(
        request, "POST", f"{url}/clear_kv_blocks", b'{"model": 5}'
    )
    assert status == 400
    status, _ = await asyncio.to_thread(request, "GET", f"{url}/clear_kv_blocks")
    assert status == 405
