"""LoRA adapters end to end, all real processes (mocker workers with ``--enable-lora``, a
frontend, the ``openai`` client): vLLM's load and unload routes, ``/v1/models`` with each
adapter's parent, requests naming an adapter, all-or-nothing loads, ``--lora-placement``, and
adapter-aware KV routing (the router's matched blocks and the mocker's cached tokens)."""

from __future__ import annotations

import json
import random
import signal

import openai
import pytest

from dynamo_zmq import errors
from dynamo_zmq.tools.lora_adapter import write_adapter_config
from tests.support import migration
from tests.support.lora import complete, load_adapter, unload_adapter
from tests.support.metrics import fetch_sample, index_blocks, metrics_page, sample
from tests.support.mocker_fleet import mocker_fleet, serving, start_frontend, start_mocker
from tests.support.waiting import eventually

BLOCK = 16
WORKER = ("--enable-lora", "--block-size", str(BLOCK))


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


async def test_an_adapter_is_loaded_listed_used_unloaded_and_then_unknown(
    namespace, spawn, tiny_model, tmp_path
):
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 2, worker_args=WORKER)
    url = fleet.url
    path = write_adapter_config(tmp_path / "sql", 8, "tiny")
    status, body = await load_adapter(url, "sql", path)
    assert (status, body) == (200, b"Success: LoRA adapter 'sql' added successfully.")
    async with client(url) as api:
        models = {m.id: m.model_dump() for m in (await api.models.list()).data}
        assert models["sql"]["parent"] == "tiny" and models["sql"]["root"] == str(path)
        assert "tiny" in models
        # Right after the load answered: the adapter is routed, on both workers.
        done = await complete(api, "sql", "select the rows")
        assert done.model == "sql" and done.worker in fleet.ids
        chat = await api.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.model == "sql" and chat.usage is not None

        status, body = await load_adapter(url, "sql", path)
        assert status == 400 and "already been loaded" in json.loads(body)["error"]["message"]
        status, body = await load_adapter(url, "tiny", path)
        assert status == 400 and "conflicts with a served base model" in body.decode()
        status, body = await load_adapter(url, "x", "")
        assert status == 400 and "must be provided" in body.decode()
        status, body = await load_adapter(url, "x", path, model="nosuch")
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"

        status, body = await unload_adapter(url, "sql")
        assert (status, body) == (200, b"Success: LoRA adapter 'sql' removed successfully.")
        assert "sql" not in {m.id for m in (await api.models.list()).data}
        with pytest.raises(openai.NotFoundError) as exc:
            await complete(api, "sql", "select the rows")
        assert exc.value.code == "model_not_found"
        status, body = await unload_adapter(url, "sql")
        assert status == 404 and "cannot be found" in body.decode()
        assert (await complete(api, "tiny", "select the rows")).model == "tiny"


async def test_a_load_is_all_or_nothing(namespace, spawn, tiny_model, tmp_path):
    # Two workers that differ in their largest rank: a rank-12 adapter fits only one.
    big = start_mocker(spawn, namespace, tiny_model, *WORKER, "--max-lora-rank", "16")
    small = start_mocker(spawn, namespace, tiny_model, *WORKER, "--max-lora-rank", "8")
    front = start_frontend(spawn, namespace, mode="round-robin")
    await serving(front, [big, small], "tiny")
    url = front.address
    status, body = await load_adapter(url, "a", write_adapter_config(tmp_path / "r12", 12, "t"))
    assert status == 400
    assert "LoRA rank 12" in body.decode() and "max_lora_rank 8" in body.decode()
    missing = tmp_path / "missing"
    status, body = await load_adapter(url, "a", missing)
    assert status == 400 and str(missing) in json.loads(body)["error"]["message"]
    async with client(url) as api:
        assert "a" not in {m.id for m in (await api.models.list()).data}
        with pytest.raises(openai.NotFoundError):
            await complete(api, "a", "hello")
        # No worker kept "a" (a worker refuses a name it holds): it loads now, on both.
        status, _ = await load_adapter(url, "a", write_adapter_config(tmp_path / "r4", 4, "t"))
        assert status == 200
        served = {(await complete(api, "a", "hello")).worker for _ in range(4)}
        assert served == {f"{big.instance_id:x}", f"{small.instance_id:x}"}


@pytest.mark.parametrize("mode", ["round-robin", "kv"])
async def test_placement_loads_on_one_worker_and_routes_only_there(
    namespace, spawn, tiny_model, tmp_path, mode
):
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 2, worker_args=WORKER,
                               mode=mode, frontend_args=("--lora-placement", "1"))
    url = fleet.url
    for name in ("a", "b"):
        status, body = await load_adapter(url, name, write_adapter_config(tmp_path / name, 8, "t"))
        assert status == 200, body
    async with client(url) as api:
        on_a = {(await complete(api, "a", "hello")).worker for _ in range(4)}
        on_b = {(await complete(api, "b", "hello")).worker for _ in range(4)}
        assert len(on_a) == len(on_b) == 1 and on_a != on_b  # the one with fewer adapters
        if mode == "round-robin":
            assert {(await complete(api, "tiny", "hello")).worker for _ in range(4)} == fleet.ids
        holder = next(w for w in fleet.workers if f"{w.instance_id:x}" in on_a)
        holder.signal(signal.SIGTERM)
        holder.wait()

        async def unavailable() -> str | None:
            try:
                await complete(api, "a", "hello")
            except openai.InternalServerError as exc:  # 503
                return str(exc)
            return None

        message = await eventually(unavailable, 15, "503 for the adapter its holder served")
        assert "no live worker holds the LoRA adapter 'a'" in message
        assert (await complete(api, "b", "hello")).worker in on_b


async def test_kv_routing_matches_each_adapters_own_blocks(
    namespace, spawn, make_runtime, tiny_model, tmp_path
):
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 3, worker_args=WORKER)
    url = fleet.url
    for name in ("a", "b"):
        status, body = await load_adapter(url, name, write_adapter_config(tmp_path / name, 8, "t"))
        assert status == 200, body
    rng = random.Random(35)
    prompt = [rng.randrange(10, 500) for _ in range(6 * BLOCK)]

    async def indexed(total: float) -> bool:
        return sum((await index_blocks(url)).values()) >= total

    async def matched() -> float:
        return await fetch_sample(url, "dynamo_router_matched_blocks_total")

    async with client(url) as api:

        async def run(model: str, tokens: list[int]) -> tuple[str, int, float]:
            before = await matched()
            done = await complete(api, model, tokens)
            return done.worker, done.cached, await matched() - before

        base_worker, cached, credit = await run("tiny", prompt)
        assert (cached, credit) == (0, 0)
        await eventually(lambda: indexed(6), 15, "the base prompt's blocks indexed")
        # Adapter "a", same prompt: the base model's blocks credit it nothing, anywhere.
        a_worker, cached, credit = await run("a", prompt)
        assert (cached, credit) == (0, 0)
        await eventually(lambda: indexed(12), 15, "adapter a's blocks indexed")
        # "a" again with more: routed where a's blocks are, credited with them.
        worker, cached, credit = await run("a", [*prompt, 7, 8, 9])
        assert (worker, cached, credit) == (a_worker, 6 * BLOCK, 6)
        # Adapter "b": neither the base's nor a's blocks credit it.
        _, cached, credit = await run("b", prompt)
        assert (cached, credit) == (0, 0)
        await eventually(lambda: indexed(18), 15, "adapter b's blocks indexed")
        # The base prompt still goes to the base blocks.
        worker, cached, credit = await run("tiny", [*prompt, 1])
        assert (worker, cached, credit) == (base_worker, 6 * BLOCK, 6)

        # python -m router answers alike: each adapter's blocks only, with "lora_name".
        spawn("-m", "router", "--namespace", namespace, "--host", "127.0.0.1")
        best = await make_runtime().endpoint(f"{namespace}.router.best_worker").client()
        await best.wait_for_instances(timeout=15)

        async def ask(lora: str | None) -> dict:
            request = {"model": "tiny", "token_ids": [*prompt, 1]}
            stream = await best.generate(request if lora is None else {**request,
                                                                      "lora_name": lora})
            (answer,) = [r.data() async for r in stream]
            return answer

        async def follows() -> bool:
            try:  # each worker's blocks come by its own replay: wait for both workers'
                return all([(await ask(lora))["overlap_blocks"] >= 6 for lora in ("a", None)])
            except Exception:  # the model or its blocks are not followed yet
                return False

        await eventually(follows, 20, "python -m router following the adapter's and the base's "
                                      "blocks")
        assert (await ask("a"))["matches"] == {f"{a_worker}/0": 6}
        assert (await ask(None))["matches"] == {f"{base_worker}/0": 6}
        with pytest.raises(errors.CannotConnect):  # no worker holds it
            await ask("nosuch")


async def test_a_migrated_adapter_request_goes_only_to_another_holder(
    namespace, spawn, tiny_model, tmp_path
):
    """Three slow workers, the adapter on two of them (``--lora-placement 2``): a stream whose
    holder is killed mid-way goes on on the other holder (the third one would refuse it), to
    its full length."""
    three = await migration.fleet(spawn, namespace, tiny_model, 3, "--enable-lora",
                                  frontend_args=("--lora-placement", "2"))
    status, body = await load_adapter(three.url, "a", write_adapter_config(tmp_path / "a", 8, "t"))
    assert status == 200, body
    async with migration.client_for(three.url) as api:
        holders = {(await complete(api, "a", "hello")).worker for _ in range(6)}
        assert len(holders) == 2
        raw = await api.chat.completions.with_raw_response.create(
            model="a", messages=migration.MESSAGES, stream=True,
            stream_options={"include_usage": True}, **migration.PARAMS,
        )
        victim = migration.serving_worker(three.workers, raw.headers["x-dynamo-worker"])
        assert f"{victim.instance_id:x}" in holders
        chunks, seen = [], 0
        async for chunk in raw.parse():
            chunks.append(chunk)
            if chunk.choices and chunk.choices[0].delta.content:
                seen += 1
                if seen == 10:
                    victim.signal(signal.SIGKILL)
    finish = [c.choices[0].finish_reason for c in chunks
              if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"] and chunks[-1].usage.completion_tokens == migration.LONG
    page = await metrics_page(three.url)
    assert sample(page, "dynamo_frontend_migrations_total", model="tiny") == 1
