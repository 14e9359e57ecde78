"""The model-card checksum travels with each request (``mdcsum``): workers refuse requests
preprocessed for another card, and a frontend never mixes workers that serve one model name
with different cards."""

from __future__ import annotations

import asyncio

import openai
import pytest

from dynamo_zmq import errors
from dynamo_zmq.frontend.preprocess import Preprocessor
from dynamo_zmq.frontend.protocol import parse_completion
from dynamo_zmq.llm import build_card
from tests.support.mocker_fleet import start_frontend, start_worker
from tests.support.model_cards import other_card_model
from tests.support.waiting import wait_models

WARNING = "serves it with another model card"


def test_requests_carry_the_checksum_of_their_card(tiny_model):
    card = build_card(tiny_model, "tiny")
    pre = Preprocessor(tiny_model, card).completion(
        parse_completion(b'{"model": "tiny", "prompt": "hello", "max_tokens": 2}')
    )
    assert pre.mdcsum == card.checksum


async def served_by(client, n: int) -> list[str]:
    """The instance (hex) that served each of ``n`` chat requests."""
    found = []
    for _ in range(n):
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        raw.parse()
        found.append(raw.headers["x-dynamo-worker"])
    return found


async def test_one_name_two_cards_are_not_mixed(namespace, spawn, tiny_model, tmp_path):
    first = start_worker(spawn, namespace, tiny_model, ready=True)
    fe = start_frontend(spawn, namespace, mode=None, ready=True)
    url = fe.address
    await wait_models(url, {"tiny"})
    second = start_worker(spawn, namespace, other_card_model(tiny_model, tmp_path), ready=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while WARNING not in fe.logs():  # the frontend saw the second card, and said so
        assert loop.time() < deadline, f"no warning about the other card:\n{fe.logs()}"
        await asyncio.sleep(0.1)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        # round-robin over every instance would reach the second within two requests
        assert set(await served_by(client, 8)) == {f"{first.instance_id:x}"}
        assert fe.logs().count(WARNING) == 1  # once per card, however often the table refreshes
        # When no instance serves the first card any more, the other one takes the model over.
        first.stop()
        deadline = loop.time() + 30
        while True:
            try:
                if await served_by(client, 1) == [f"{second.instance_id:x}"]:
                    break
            except openai.APIStatusError as exc:
                assert exc.status_code == 503, exc
            assert loop.time() < deadline, "the other card never took over"
            await asyncio.sleep(0.2)
    assert "now served with card" in fe.logs()


async def test_a_worker_refuses_a_request_for_another_card(
    namespace, spawn, make_runtime, tiny_model
):
    proc = start_worker(spawn, namespace, tiny_model, ready=True)
    client = await (
        make_runtime(static=(proc.address,)).endpoint(f"{namespace}.backend.generate").client()
    )
    await client.wait_for_instances(timeout=15)
    own = build_card(tiny_model, "tiny").checksum
    wrong = "0" * 64

    async def run(**fields) -> list[dict]:
        req = {"token_ids": [5, 6, 7], "stop": {"max_tokens": 2}, **fields}
        return [r.data() async for r in await client.generate(req)]

    with pytest.raises(errors.InvalidArgument) as exc:
        await run(mdcsum=wrong)
    assert wrong in exc.value.message and own in exc.value.message
    assert (await run(mdcsum=own))[-1]["finish_reason"] == "length"
    # no checksum (a caller of the runtime API building requests itself): accepted
    assert (await run())[-1]["finish_reason"] == "length"
