"""LoRA adapters and priorities on the vLLM engine (issue 35, items 1 and 3), through one real
vLLM worker (``--enable-lora --lora-modules a=... --scheduling-policy priority --max-num-seqs
1``) and vLLM's own offline ``LLM`` in a child process, both on the tiny model with random
``peft`` adapters (``dynamo_zmq.tools.tiny_lora``):

- greedy output with the adapter differs from the base model's and is vLLM's own offline
  output with a ``LoRARequest`` for the same adapter; an adapter the worker lacks: NotFound;
- the worker's KV events of adapter blocks chain from ``root_hash(name)``, as the router hashes
  a request for the adapter: base and adapter blocks never match each other (edge-hashed live
  events and vLLM's own replayed events alike);
- a request's priority reaches vLLM's scheduler: with one sequence slot, the waiting request of
  the better (lower) priority runs first although it came second;
- end to end through a frontend and the ``openai`` client: an adapter loaded with
  ``/v1/load_lora_adapter`` is listed and used (``model=<adapter>``), a bad path or a rank above
  ``--max-lora-rank`` is 400 with vLLM's message and leaves nothing loaded, and once unloaded
  the adapter is 404;
- a worker whose ``--lora-modules`` adapter vLLM refuses does not start: it exits with vLLM's
  message naming the adapter.

Runs only where vLLM is installed; skipped otherwise, except in CI (``CI=true``)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

import msgspec
import pytest_asyncio
import zmq
import zmq.asyncio
from tokenizers import Tokenizer

from dynamo_zmq import errors
from dynamo_zmq.context import Context
from dynamo_zmq.llm import BlockStored, Capability, EventBatch, ModelAdvert
from dynamo_zmq.tools.tiny_lora import build_lora_adapter
from router.events import decode_batch
from router.hashing import block_hashes, root_hash
from router.indexer import KvIndexer
from tests.conftest import runtime_factory
from tests.support.http_calls import get_text
from tests.support.lora import complete, load_adapter, unload_adapter
from tests.support.metrics import sample
from tests.support.procs import Proc, run_cli, system_port
from tests.support.vllm_kv import kv_ports
from tests.support.vllm_stack import VLLM_ENV, WORKER_FLAGS, WORKER_START
from tests.support.waiting import eventually, serving

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

BLOCK = 32
MAX_TOKENS = 16
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {"a": build_lora_adapter(tiny_model, root / "a", rank=8, seed=0),
            "b": build_lora_adapter(tiny_model, root / "b", rank=8, seed=1),
            "r32": build_lora_adapter(tiny_model, root / "r32", rank=32, seed=2)}


@pytest.fixture(scope="module")
def prompts(tiny_model: Path) -> list[list[int]]:
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    texts = ["Once upon a time there was", "The worker engine said"]
    return [tok.encode(t).ids for t in texts] + [[1, 5, 9, 200, 300, 17]]


@pytest.fixture(scope="module")
def offline(tiny_model: Path, adapters: dict[str, Path], prompts: list[list[int]]) -> dict:
    """vLLM's own offline greedy ids per prompt: {"base": [...], "lora": [...]}."""
    done = run_cli("-m", "tests.support.vllm_offline_lora", str(tiny_model), str(adapters["a"]),
                   str(MAX_MODEL_LEN), str(MAX_TOKENS), json.dumps(prompts), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def worker(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[Proc]:
    namespace = f"t{uuid.uuid4().hex[:12]}"
    proc = Proc(["-m", "dynamo_zmq.worker", "--engine", "vllm", "--model-path", str(tiny_model),
                 "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
                 "--metrics-port", "0", *WORKER_FLAGS, "--enable-lora", "--max-lora-rank", "16",
                 "--lora-modules", f"a={adapters['a']}", "--scheduling-policy", "priority",
                 "--max-num-seqs", "1", "--kv-event-form", "stores"], env=VLLM_ENV)
    proc.namespace = namespace  # type: ignore[attr-defined]
    try:
        yield proc.wait_ready(WORKER_START)
    finally:
        proc.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(worker: Proc):
    async with runtime_factory() as make:
        yield make(static=(worker.address,))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(worker: Proc, runtime):
    client = await runtime.endpoint(f"{worker.namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    return client


def request(tokens: list[int], max_tokens: int = MAX_TOKENS, ignore_eos: bool = False,
            **extra) -> dict:
    return {"token_ids": list(tokens), "sampling": {"temperature": 0.0},
            "stop": {"max_tokens": max_tokens, "ignore_eos": ignore_eos}, **extra}


async def token_ids(client, req: dict, ctx: Context | None = None) -> list[int]:
    chunks = [r.data() async for r in await client.generate(req, context=ctx)]
    assert chunks[-1]["finish_reason"] in ("length", "stop"), chunks[-1]
    return [t for c in chunks for t in c.get("token_ids", [])]


# -- output ------------------------------------------------------------------------------------


async def test_adapter_output_differs_from_the_base_and_is_vllms_offline_output(
    client, prompts, offline, runtime, worker
):
    for i, prompt in enumerate(prompts):
        base = await token_ids(client, request(prompt))
        adapted = await token_ids(client, request(prompt, lora_name="a"))
        assert base == offline["base"][i], i
        assert adapted == offline["lora"][i], i
        assert adapted != base, i
    # The worker advertises the adapter and what the engine can do.
    (peer,) = [p for p in await runtime.peers() if p.description]
    (info,) = [e for e in peer.description.endpoints if e.name == "generate"]
    advert = ModelAdvert.from_metadata(info.metadata)
    assert {Capability.LORA, Capability.PRIORITY} <= set(advert.capabilities)
    # ... and its adapter slots, for the KV router's residency prediction (vLLM's default 1).
    assert advert.engine.extra["max_loras"] == 1


async def test_an_adapter_the_worker_lacks_is_not_found(client, prompts):
    with pytest.raises(errors.NotFound, match="'zz'"):
        await token_ids(client, request(prompts[0], lora_name="zz"))
    assert await token_ids(client, request(prompts[0], lora_name="a"))  # the worker goes on


async def test_a_module_that_does_not_load_fails_the_start_with_vllms_message(
    tiny_model: Path, adapters: dict[str, Path]
):
    """A real vLLM worker whose ``--lora-modules`` adapter vLLM refuses (rank 32 above
    ``--max-lora-rank 16``) does not start: it exits non-zero, saying which adapter and why."""
    done = await asyncio.to_thread(
        run_cli, "-m", "dynamo_zmq.worker", "--engine", "vllm", "--model-path", str(tiny_model),
        "--model-name", "tiny", "--namespace", f"t{uuid.uuid4().hex[:12]}", "--host",
        "127.0.0.1", "--metrics-port", "0", *WORKER_FLAGS, "--enable-lora", "--max-lora-rank",
        "16", "--lora-modules", f"big={adapters['r32']}", timeout=WORKER_START, env=VLLM_ENV,
    )
    assert done.returncode not in (0, None), done.stderr[-3000:]
    assert "--lora-modules: LoRA adapter 'big' could not be loaded from" in done.stderr, (
        done.stderr[-3000:])
    assert "rank 32" in done.stderr and "16" in done.stderr, done.stderr[-3000:]
    assert "READY" not in done.stdout


# -- KV events ---------------------------------------------------------------------------------


async def replayed(endpoint: str, zctx: zmq.asyncio.Context) -> list[bytes]:
    """vLLM's own batches from seq 0 (stores form: passed on by the relay unchanged)."""
    dealer = zctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            _, _topic, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 10)
            if seq == b"\xff" * 8:
                return out
            out.append(payload)
    finally:
        dealer.close(0)


async def test_kv_events_of_adapter_blocks_hash_like_the_routers_adapter_requests(
    client, worker
):
    pub, replay = kv_ports(worker)
    zctx = zmq.asyncio.Context()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub}")
    stores: list[BlockStored] = []

    async def drain() -> None:
        while await sub.poll(300):
            _topic, _seq, payload = await sub.recv_multipart()
            batch = msgspec.msgpack.decode(payload, type=EventBatch)
            stores.extend(ev for ev in batch.events if isinstance(ev, BlockStored))

    try:
        async def joined() -> bool:  # the SUB is joined once a fresh prompt's store reaches it
            await token_ids(client, request([7, 8] + [uuid.uuid4().int % 400 + 4] * BLOCK, 1))
            await drain()
            return bool(stores)

        await eventually(joined, timeout=30)
        stores.clear()
        prompt = [(7 * i + 11) % 500 + 4 for i in range(7 * BLOCK + 5)]  # 7 full blocks
        await token_ids(client, request(prompt, 1))
        await token_ids(client, request(prompt, 1, lora_name="a"))
        await drain()
        base = [h for ev in stores if ev.lora_name is None for h in ev.own_hashes or []]
        adapted = [h for ev in stores if ev.lora_name == "a" for h in ev.own_hashes or []]
        assert base == block_hashes(prompt, BLOCK)
        assert adapted == block_hashes(prompt, BLOCK, root_hash("a"))
        # The adapter's name is in the root, not a salt of each block.
        assert all(k is None for ev in stores for k in ev.extra_keys or [])
        live = KvIndexer(BLOCK)
        for ev in stores:
            live.apply_batch(42, EventBatch(0.0, [ev], 0))
        # vLLM's own events (replay: no own hashes, the name in extra_keys) index the same.
        own = KvIndexer(BLOCK)
        for payload in await replayed(f"tcp://127.0.0.1:{replay}", zctx):
            own.apply_batch(42, decode_batch(payload))
        for index in (live, own):
            assert index.find_matches(prompt) == {(42, 0): 7}
            assert index.find_matches(prompt, lora="a") == {(42, 0): 7}
            assert index.find_matches(prompt, lora="b") == {}
    finally:
        sub.close(0)
        zctx.term()


# -- priority ----------------------------------------------------------------------------------


async def test_the_better_priority_runs_first_with_vllms_priority_scheduling(client, worker):
    """One sequence slot, held by a long request; a priority 10 request, then a priority -10
    one queue behind it; when the long one is stopped, vLLM runs the -10 one first."""
    metrics = f"http://127.0.0.1:{system_port(worker)}/metrics"

    async def waiting(n: int) -> bool:
        page = await asyncio.to_thread(get_text, metrics)
        return (sample(page, "vllm:num_requests_waiting") or 0) >= n

    hold_ctx = Context()
    hold = await client.generate(request([1, 2, 3], 480, ignore_eos=True), context=hold_ctx)
    first = await hold.__anext__()  # the long request is running
    assert first.data().get("token_ids")
    done: list[str] = []

    async def run(name: str, priority: int) -> None:
        await token_ids(client, request([1, 4, 20 + priority], 4, priority=priority))
        done.append(name)

    tasks = [asyncio.create_task(run("early", 10))]
    try:
        await eventually(lambda: waiting(1), timeout=20)  # "early" waits in vLLM
        tasks.append(asyncio.create_task(run("late-but-urgent", -10)))
        await eventually(lambda: waiting(2), timeout=20)  # both wait
        hold_ctx.stop()
        last = [r.data() async for r in hold][-1]
        assert last["finish_reason"] == "cancelled"  # it was still running: both waited
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    finally:
        for task in tasks:
            task.cancel()
    assert done == ["late-but-urgent", "early"]


# -- end to end: the frontend's routes and the openai client ------------------------------------


@pytest.fixture(scope="module")
def frontend(worker: Proc) -> Iterator[Proc]:
    proc = Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace",
                 worker.namespace])
    try:
        yield proc
    finally:
        proc.stop()


async def test_load_use_unload_through_the_frontend(frontend, worker, adapters, prompts):
    url = await serving(frontend, [worker], "tiny", timeout=60)
    prompt = prompts[2]
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as api:
        async def text(model: str) -> str:
            done = await api.completions.create(model=model, prompt=prompt, max_tokens=8,
                                                temperature=0.0)
            return done.choices[0].text

        status, body = await load_adapter(url, "b", adapters["b"])
        assert (status, body) == (200, b"Success: LoRA adapter 'b' added successfully.")
        models = {m.id: m.model_dump() for m in (await api.models.list()).data}
        assert models["a"]["parent"] == models["b"]["parent"] == "tiny"
        assert models["b"]["root"] == str(adapters["b"])
        base, with_b = await text("tiny"), await text("b")
        assert with_b != base
        assert (await complete(api, "b", prompt)).model == "b"

        missing = adapters["b"].parent / "missing"
        status, body = await load_adapter(url, "c", missing)
        assert status == 400 and str(missing) in json.loads(body)["error"]["message"]
        status, body = await load_adapter(url, "c", adapters["r32"])
        message = json.loads(body)["error"]["message"]
        assert status == 400 and "LoRA rank 32 is greater than max_lora_rank 16" in message
        status, body = await load_adapter(url, "b", adapters["a"])
        assert status == 400 and "already been loaded" in body.decode()
        assert {m.id for m in (await api.models.list()).data} == {"tiny", "a", "b"}

        status, body = await unload_adapter(url, "b")
        assert (status, body) == (200, b"Success: LoRA adapter 'b' removed successfully.")
        with pytest.raises(openai.NotFoundError):
            await text("b")
        status, _ = await unload_adapter(url, "b")
        assert status == 404
        assert await text("a") != base and await text("tiny") == base  # the rest serves on
