"""``python -m router`` routes one model card per model name, as the frontend does (issue 33
item 4), all real processes: a mocker worker A serving ``tiny``, ``python -m router``, then a
worker B serving ``tiny`` from another model directory (another card checksum).

B holds a prompt's prefix (a request sent to it directly), so a router that mixed the two cards
would send that prompt to B: it must go to A, and a request naming B's card is refused. Once A
stops, B's card takes the model over.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dynamo_zmq import errors
from dynamo_zmq.llm import build_card
from tests.support.mocker_fleet import start_mocker
from tests.support.model_cards import other_card_model
from tests.support.waiting import eventually

BLOCK = 16
WORKER = ("--block-size", str(BLOCK))
WARNING = "serves it with another model card"
PREFIX = [11 + (i * 7) % 400 for i in range(6 * BLOCK)]


async def test_the_router_service_never_mixes_two_cards_of_one_name(
    namespace, spawn, make_runtime, tiny_model, tmp_path
):
    other = other_card_model(tiny_model, tmp_path)
    card_a, card_b = build_card(tiny_model, "tiny").checksum, build_card(other, "tiny").checksum
    a = start_mocker(spawn, namespace, tiny_model, *WORKER).wait_ready()
    router = spawn("-m", "router", "--namespace", namespace, "--host", "127.0.0.1",
                   "--wait-for-workers", "1")
    runtime = make_runtime()
    best_worker = await runtime.endpoint(f"{namespace}.router.best_worker").client()
    await best_worker.wait_for_instances(timeout=15)

    async def best(**fields: Any) -> dict[str, Any]:
        answers = [r.data() async for r in await best_worker.generate(
            {"model": "tiny", "token_ids": [*PREFIX, 1, 2, 3], **fields})]
        assert len(answers) == 1
        return answers[0]

    first = await best()
    assert first["worker_id"] == a.instance_id and first["mdcsum"] == card_a

    b = start_mocker(spawn, namespace, other, *WORKER).wait_ready()
    generate = await runtime.endpoint(f"{namespace}.backend.generate").client()

    async def b_live() -> bool:
        return b.instance_id in generate.instance_ids()

    await eventually(b_live, 15, "B live in a client of the namespace")
    request = {"token_ids": PREFIX, "stop": {"max_tokens": 2}, "mdcsum": card_b}
    async for _ in await generate.direct(request, b.instance_id):
        pass  # B now holds the prefix, and publishes it

    async def warned() -> bool:
        return WARNING in router.logs()

    await eventually(warned, 30, "the router warning about B's card")
    await asyncio.sleep(1.0)  # time for B's KV events, had the router followed B
    for _ in range(5):
        answer = await best()
        assert answer["worker_id"] == a.instance_id, answer
        assert answer["mdcsum"] == card_a and not any(
            m.startswith(f"{b.instance_id:x}/") for m in answer["matches"]), answer
    assert (await best(mdcsum=card_a))["worker_id"] == a.instance_id
    with pytest.raises(errors.InvalidArgument, match=card_b):
        await best(mdcsum=card_b)
    assert router.logs().count(WARNING) == 1  # once per card

    a.stop()  # no live worker serves A's card: B's takes the model over

    async def taken_over() -> dict[str, Any] | None:
        try:
            answer = await best()
        except errors.DynamoError:
            return None
        return answer if answer["mdcsum"] == card_b else None

    answer = await eventually(taken_over, 30, "B's card taking the model over")
    assert answer["worker_id"] == b.instance_id
    assert "now routed with card" in router.logs()
