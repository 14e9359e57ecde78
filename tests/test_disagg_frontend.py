"""Disaggregated prefill and decode on the frontend, through real processes: a frontend, mocker
workers in the prefill and decode roles (``--disaggregation-mode``) and the real ``openai``
client. The mocker may or may not return a KV handoff: these tests check routing, roles,
fallback, cancellation and metrics, never the handoff itself."""

from __future__ import annotations

import asyncio
import json
import signal

import openai
import pytest

from tests.support.disagg import LONG, SHORT, Worker, wait_pools
from tests.support.http_calls import get, post
from tests.support.metrics import sample
from tests.support.mocker_fleet import start_frontend
from tests.support.procs import status_json
from tests.support.waiting import eventually


async def frontend_metric(url: str, name: str, **labels: str) -> float:
    status, page = await asyncio.to_thread(get, f"{url}/metrics")
    assert status == 200
    return sample(page.decode(), name, model="tiny", **labels) or 0.0


@pytest.fixture
async def client_of():
    clients: list[openai.AsyncOpenAI] = []

    def make(url: str) -> openai.AsyncOpenAI:
        clients.append(openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0))
        return clients[-1]

    yield make
    for c in clients:
        await c.close()


async def chat(client: openai.AsyncOpenAI, content: str, max_tokens: int = 6):
    """A streamed chat request with usage: (text, finish reason, usage)."""
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    return text, finish, usage


@pytest.mark.parametrize("mode", ["round-robin", "kv"])
async def test_disaggregated_request_streams_and_each_worker_does_its_part(
    namespace, spawn, tiny_model, client_of, mode
):
    prefill = Worker(spawn, namespace, tiny_model, "prefill")
    decode = Worker(spawn, namespace, tiny_model, "decode")
    url = start_frontend(spawn, namespace, "--disagg-mode", "always", mode=mode, ready=True).address
    await wait_pools(url, prefill=1)
    client = client_of(url)
    # (health canaries prefill a token now and then: count from here)
    prefilled = {w: await w.engine_metric("mocker_prefill_tokens_total") for w in (prefill, decode)}

    raw = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=7,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    assert raw.headers["x-dynamo-worker"].split("/")[0] == f"{decode.proc.instance_id:x}"
    text, finish, usage = "", None, None
    async for chunk in raw.parse():
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text and finish == "length"
    assert usage.completion_tokens == 7 and usage.prompt_tokens > 3

    # The prefill worker served one request of one token; the decode worker the generation.
    await prefill.wait_metric("requests_total", 1)
    await prefill.wait_metric("output_tokens_total", 1)
    await decode.wait_metric("requests_total", 1)
    await decode.wait_metric("output_tokens_total", 7)
    assert await frontend_metric(url, "dynamo_frontend_remote_prefills_total") == 1
    # The prompt's KV was computed on the prefill worker and pulled by the decode worker,
    # which computed none of the prompt itself.
    assert await prefill.engine_metric("mocker_kv_handoffs_total") == 1
    computed = {w: await w.engine_metric("mocker_prefill_tokens_total") - prefilled[w]
                for w in (prefill, decode)}
    assert computed[prefill] >= usage.prompt_tokens and computed[decode] < usage.prompt_tokens
    assert await decode.engine_metric("mocker_remote_prefills_total") == 1
    pulled = await decode.metric("kv_transfer_received_bytes_total")
    assert pulled > 0 and pulled == await prefill.metric("kv_transfer_sent_bytes_total")
    assert await frontend_metric(url, "dynamo_frontend_prefill_seconds_count") == 1
    assert await frontend_metric(url, "dynamo_frontend_local_prefills_total") == 0

    # Both pools are visible to the status tool, each instance with its role.
    rows = await asyncio.to_thread(status_json, "--namespace", namespace, "--wait", "3")
    roles = {r["instance_id"]: (r["model"], r["role"]) for r in rows if r["component"]}
    assert roles[f"{prefill.proc.instance_id:x}"] == ("tiny", "prefill")
    assert roles[f"{decode.proc.instance_id:x}"] == ("tiny", "decode")


async def test_a_prefill_worker_alone_serves_no_request(namespace, spawn, tiny_model, client_of):
    prefill = Worker(spawn, namespace, tiny_model, "prefill")
    url = start_frontend(spawn, namespace, "--disagg-mode", "always", mode=None, ready=True).address
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 3}).encode()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:  # 404 until the frontend has loaded the model's card
        status, reply = await asyncio.to_thread(post, f"{url}/v1/chat/completions", body)
        if status != 404:
            break
        assert loop.time() < deadline, reply
        await asyncio.sleep(0.1)
    assert status == 503, reply
    status, models = await asyncio.to_thread(get, f"{url}/v1/models")
    assert "tiny" not in {m["id"] for m in json.loads(models)["data"]}
    assert await prefill.metric("requests_total") == 0

    # A decode worker joining makes the model servable, disaggregated.
    Worker(spawn, namespace, tiny_model, "decode")
    await wait_pools(url, prefill=1)
    _, finish, usage = await chat(client_of(url), "Hello", max_tokens=4)
    assert finish == "length" and usage.completion_tokens == 4
    await prefill.wait_metric("requests_total", 1)


async def test_client_disconnect_mid_prefill_stops_the_prefill(
    namespace, spawn, tiny_model, client_of
):
    prefill = Worker(spawn, namespace, tiny_model, "prefill", speedup="0.005")  # a slow prefill
    decode = Worker(spawn, namespace, tiny_model, "decode")
    url = start_frontend(spawn, namespace, "--disagg-mode", "always", mode=None, ready=True).address
    await wait_pools(url, prefill=1)

    task = asyncio.create_task(chat(client_of(url), LONG))
    await prefill.wait_metric("inflight_requests", 1)
    task.cancel()  # the client goes away mid-prefill
    with pytest.raises(asyncio.CancelledError):
        await task

    await prefill.wait_metric("cancellation_total", 1)
    await prefill.wait_metric("inflight_requests", 0)
    assert await decode.metric("requests_total") == 0


async def test_killing_the_prefill_worker_mid_prefill_still_completes_the_request(
    namespace, spawn, tiny_model, client_of
):
    prefill = Worker(spawn, namespace, tiny_model, "prefill", speedup="0.005")
    decode = Worker(spawn, namespace, tiny_model, "decode")
    url = start_frontend(spawn, namespace, "--disagg-mode", "always", mode=None, ready=True).address
    await wait_pools(url, prefill=1)

    task = asyncio.create_task(chat(client_of(url), LONG, max_tokens=5))
    await prefill.wait_metric("inflight_requests", 1)
    prefill.proc.signal(signal.SIGKILL)

    text, finish, usage = await asyncio.wait_for(task, 60)
    assert text and finish == "length" and usage.completion_tokens == 5
    await decode.wait_metric("requests_total", 1)
    assert await frontend_metric(
        url, "dynamo_frontend_local_prefills_total", reason="failed"
    ) == 1
    assert await frontend_metric(url, "dynamo_frontend_remote_prefills_total") == 0


async def test_conditional_mode_prefills_short_prompts_locally(
    namespace, spawn, tiny_model, client_of
):
    prefill = Worker(spawn, namespace, tiny_model, "prefill")
    decode = Worker(spawn, namespace, tiny_model, "decode")
    url = start_frontend(spawn, namespace, "--disagg-mode", "conditional",
                         "--disagg-max-local-prefill-tokens", "100", mode=None,
                         ready=True).address
    await wait_pools(url, prefill=1)
    client = client_of(url)

    _, finish, usage = await chat(client, SHORT)
    assert finish == "length" and usage.prompt_tokens <= 100
    await decode.wait_metric("requests_total", 1)
    assert await prefill.metric("requests_total") == 0
    assert await frontend_metric(url, "dynamo_frontend_local_prefills_total", reason="short") == 1

    _, finish, usage = await chat(client, LONG)
    assert finish == "length" and usage.prompt_tokens > 100
    await prefill.wait_metric("requests_total", 1)
    await decode.wait_metric("requests_total", 2)
    assert await frontend_metric(url, "dynamo_frontend_remote_prefills_total") == 1


async def test_never_mode_keeps_prefill_workers_idle(namespace, spawn, tiny_model, client_of):
    prefill = Worker(spawn, namespace, tiny_model, "prefill")
    decode = Worker(spawn, namespace, tiny_model, "decode")
    url = start_frontend(spawn, namespace, "--disagg-mode", "never", mode=None, ready=True).address
    await wait_pools(url, prefill=1)

    _, finish, _ = await chat(client_of(url), LONG)
    assert finish == "length"
    await decode.wait_metric("requests_total", 1)
    assert await prefill.metric("requests_total") == 0
    assert await frontend_metric(url, "dynamo_frontend_local_prefills_total", reason="never") == 1


def test_bad_disagg_flags_exit_2() -> None:
    from dynamo_zmq.frontend.__main__ import main

    assert main(["--disagg-max-prefill-queue", "-1"]) == 2
    assert main(["--disagg-prefill-timeout", "0"]) == 2


async def test_kv_mode_routes_prefills_by_the_prefill_workers_cached_blocks(
    namespace, spawn, tiny_model, client_of
):
    prefills = [Worker(spawn, namespace, tiny_model, "prefill") for _ in range(2)]
    Worker(spawn, namespace, tiny_model, "decode")
    url = start_frontend(spawn, namespace, "--disagg-mode", "always", mode="kv", ready=True).address
    await wait_pools(url, prefill=1)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:  # until the prefill pool's KV router follows both prefill workers
        _, page = await asyncio.to_thread(get, f"{url}/metrics")
        if all(sample(page.decode(), "dynamo_router_kv_index_blocks",
                      worker=f"{p.proc.instance_id:x}") is not None for p in prefills):
            break
        assert loop.time() < deadline
        await asyncio.sleep(0.05)
    client = client_of(url)

    await chat(client, LONG)
    counts = [await p.metric("requests_total") for p in prefills]
    assert sorted(counts) == [0, 1], counts
    first = prefills[counts.index(1)]
    deadline = loop.time() + 30
    while not await frontend_metric(  # the prefill pool's router indexed its KV events
        url, "dynamo_router_kv_index_blocks", worker=f"{first.proc.instance_id:x}"
    ):
        assert loop.time() < deadline
        await asyncio.sleep(0.05)

    async def pool_idle() -> bool:  # as the router sees it: no prefill still charged as load
        return not any([await frontend_metric(url, name, worker=f"{p.proc.instance_id:x}")
                        for p in prefills for name in ("dynamo_router_predicted_active_blocks",
                                                       "dynamo_router_reported_active_blocks")])

    for _ in range(3):  # round-robin would alternate; the KV overlap keeps the cached worker
        deadline = loop.time() + 30  # a late load report must not make the cached one look busy
        while not await pool_idle():
            assert loop.time() < deadline
            await asyncio.sleep(0.05)
        await chat(client, LONG)
    assert await first.metric("requests_total") == 4
    assert sum([await p.metric("requests_total") for p in prefills]) == 4


async def test_a_decode_worker_lost_mid_stream_migrates_the_request(
    namespace, spawn, tiny_model, client_of
):
    Worker(spawn, namespace, tiny_model, "prefill")
    decodes = [Worker(spawn, namespace, tiny_model, "decode", speedup="1") for _ in range(2)]
    url = start_frontend(spawn, namespace, "--disagg-mode", "always", mode=None, ready=True).address
    await wait_pools(url, prefill=1)
    by_id = {f"{w.proc.instance_id:x}": w for w in decodes}

    async def both_decodes_listed() -> bool:  # so the migration has a known worker to go to
        status, body = await asyncio.to_thread(get, f"{url}/health")
        return status == 200 and set(json.loads(body)["models"].get("tiny", [])) == set(by_id)

    await eventually(both_decodes_listed, 30, "both decode workers serving")

    raw = await client_of(url).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=300,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    serving = by_id[raw.headers["x-dynamo-worker"].split("/")[0]]
    chunks, finish, usage = 0, None, None
    async for chunk in raw.parse():
        if chunk.choices:
            chunks += 1
            finish = chunk.choices[0].finish_reason or finish
            if chunks == 5:
                serving.proc.signal(signal.SIGKILL)
        if chunk.usage is not None:
            usage = chunk.usage
    assert finish == "length" and usage.completion_tokens == 300
    assert await frontend_metric(url, "dynamo_frontend_migrations_total") == 1
    assert await frontend_metric(url, "dynamo_frontend_remote_prefills_total") == 1
    assert await frontend_metric(
        url, "dynamo_frontend_local_prefills_total", reason="migrated"
    ) == 1


async def test_a_migration_that_waits_for_a_new_decode_worker_counts_one_local_prefill(
    namespace, spawn, tiny_model, client_of
):
    # The only decode worker dies mid-stream; the migration polls until a new one is up, and
    # each poll that finds none is not a local prefill (only the continuation that was sent).
    Worker(spawn, namespace, tiny_model, "prefill")
    lost = Worker(spawn, namespace, tiny_model, "decode", speedup="1")
    url = start_frontend(spawn, namespace, "--disagg-mode", "always", mode=None, ready=True).address
    await wait_pools(url, prefill=1)

    stream = await client_of(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=300,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks, usage, started = 0, None, None
    async for chunk in stream:
        if chunk.choices:
            chunks += 1
            if chunks == 5:
                lost.proc.signal(signal.SIGKILL)
                started = asyncio.create_task(asyncio.to_thread(
                    Worker, spawn, namespace, tiny_model, "decode", "1"))
        if chunk.usage is not None:
            usage = chunk.usage
    assert started is not None
    replacement = await started
    assert usage.completion_tokens == 300
    assert await replacement.metric("requests_total") == 1
    assert await frontend_metric(url, "dynamo_frontend_migrations_total") == 1
    assert await frontend_metric(
        url, "dynamo_frontend_local_prefills_total", reason="migrated"
    ) == 1


async def test_conditional_mode_prefills_locally_while_the_prefill_pool_is_busy(
    namespace, spawn, tiny_model, client_of
):
    prefill = Worker(spawn, namespace, tiny_model, "prefill", speedup="0.005")  # a slow prefill
    decode = Worker(spawn, namespace, tiny_model, "decode")
    url = start_frontend(spawn, namespace, "--disagg-mode", "conditional",
                         "--disagg-max-local-prefill-tokens", "0", "--disagg-max-prefill-queue",
                         "0", mode=None, ready=True).address
    await wait_pools(url, prefill=1)
    client = client_of(url)

    slow = asyncio.create_task(chat(client, LONG))
    await prefill.wait_metric("inflight_requests", 1)
    # One remote prefill in flight is more than 0 per prefill worker: the pool is busy.
    _, finish, _ = await chat(client, LONG + "again")
    assert finish == "length"
    assert await frontend_metric(url, "dynamo_frontend_local_prefills_total", reason="busy") == 1
    assert await prefill.metric("requests_total") == 1

    _, finish, _ = await asyncio.wait_for(slow, 60)
    assert finish == "length"
    await decode.wait_metric("requests_total", 2)
    assert await frontend_metric(url, "dynamo_frontend_remote_prefills_total") == 1


async def test_a_prefill_past_its_timeout_falls_back_to_the_decode_worker(
    namespace, spawn, tiny_model, client_of
):
    prefill = Worker(spawn, namespace, tiny_model, "prefill", speedup="0.005")  # a slow prefill
    decode = Worker(spawn, namespace, tiny_model, "decode")
    url = start_frontend(spawn, namespace, "--disagg-mode", "always", "--disagg-prefill-timeout",
                         "1", mode=None, ready=True).address
    await wait_pools(url, prefill=1)

    _, finish, usage = await asyncio.wait_for(chat(client_of(url), LONG, max_tokens=4), 60)
    assert finish == "length" and usage.completion_tokens == 4
    await decode.wait_metric("requests_total", 1)
    await prefill.wait_metric("inflight_requests", 0)  # the prefill worker let it go
    assert await frontend_metric(
        url, "dynamo_frontend_local_prefills_total", reason="failed"
    ) == 1
    assert await frontend_metric(url, "dynamo_frontend_remote_prefills_total") == 0


def test_the_role_is_not_part_of_the_cards_identity(tiny_model) -> None:
    """Prefill and decode workers of one model directory take each other's requests: the
    checksum a request carries (``mdcsum``) does not depend on the worker's role."""
    from dynamo_zmq.llm import build_card

    cards = [build_card(tiny_model, "tiny", role=role) for role in ("agg", "prefill", "decode")]
    assert len({c.checksum for c in cards}) == 1
    assert [c.role for c in cards] == ["agg", "prefill", "decode"]
