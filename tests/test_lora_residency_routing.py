"""Adapter residency in KV routing end to end, all real processes: two mocker workers that keep
one adapter resident each (``--max-loras 1``), a kv frontend, the ``openai`` client. Two
adapters whose requests alternate, every prompt new (no cached prefix to pull them anywhere):
the router's residency term (``--kv-lora-miss-blocks``) settles each adapter on its own
worker, where it stays resident."""

from __future__ import annotations

import random

import openai

from dynamo_zmq.tools.lora_adapter import write_adapter_config
from tests.support.lora import complete, load_adapter
from tests.support.mocker_fleet import mocker_fleet

BLOCK = 16
WORKER = ("--enable-lora", "--max-loras", "1", "--block-size", str(BLOCK))


async def test_each_adapter_settles_on_its_own_worker(namespace, spawn, tiny_model, tmp_path):
    fleet = await mocker_fleet(spawn, namespace, tiny_model, 2, worker_args=WORKER,
                               frontend_args=("--kv-lora-miss-blocks", "32"))
    for name in ("a", "b"):
        status, body = await load_adapter(fleet.url, name,
                                          write_adapter_config(tmp_path / name, 8, "t"))
        assert status == 200, body
    rng = random.Random(35)
    served: dict[str, list[str]] = {"a": [], "b": []}
    async with openai.AsyncOpenAI(base_url=f"{fleet.url}/v1", api_key="none",
                                  max_retries=0) as api:
        for i in range(12):
            name = "ab"[i % 2]
            prompt = [rng.randrange(10, 500) for _ in range(4 * BLOCK)]
            served[name].append((await complete(api, name, prompt)).worker)
    # The first "a" goes to either worker; "b" then to the other one (a free slot: it evicts
    # nothing), and from then on each adapter's requests stay where it is resident.
    assert len(set(served["a"])) == 1 and len(set(served["b"])) == 1, served
    assert set(served["a"]) != set(served["b"])
