"""Sampling options and several choices through the real `openai` client, a real frontend and one
real vLLM worker: ``logit_bias`` forcing (and banning) a token, ``seed`` reproducible at
temperature 1 (also per choice of ``n``), ``stop_token_ids`` and ``min_tokens`` with their
stop reason, and a penalty reaching vLLM's sampler.

Runs only where vLLM is installed (skipped otherwise, failed in CI: see tests/test_vllm.py).
"""

from __future__ import annotations

import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

import openai
import pytest_asyncio
from tokenizers import Tokenizer

from tests.support.vllm_stack import wait_models

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

PROMPT = "The quick brown fox jumps over the lazy dog and"
#: A token of the tiny model that decodes to plain text (" the").
FORCED = 296


@pytest.fixture(scope="module")
def stack(tiny_vllm_stack):
    """One vLLM worker ('tiny') and a frontend (the session's shared pair)."""
    return tiny_vllm_stack.url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(stack):
    await wait_models(stack)
    async with openai.AsyncOpenAI(base_url=f"{stack}/v1", api_key="none", max_retries=0) as c:
        yield c


async def text(client, **kwargs) -> str:
    resp = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, **kwargs)
    return resp.choices[0].text


async def test_logit_bias_forces_and_bans_tokens(client, tiny_model):
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    forced = await text(client, temperature=1.0, logit_bias={str(FORCED): 100},
                        extra_body={"ignore_eos": True})
    assert forced == tokenizer.decode([FORCED] * 6)
    greedy = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"ignore_eos": True}
    )
    first = tokenizer.encode(PROMPT + greedy.choices[0].text, add_special_tokens=True).ids[-1]
    banned = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, temperature=0,
        logit_bias={str(first): -100}, extra_body={"ignore_eos": True},
    )
    assert banned.choices[0].text != greedy.choices[0].text


async def test_seed_reproduces_sampling_at_temperature_one(client):
    kw = {"temperature": 1.0, "extra_body": {"ignore_eos": True}}
    a = await text(client, seed=1234, **kw)
    b = await text(client, seed=1234, **kw)
    c = await text(client, seed=98765, **kw)
    assert a == b != c
    # n choices use seed, seed + 1, ...: reproducible, and different from each other
    many = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3,
                                           seed=1234, **kw)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert many.choices[0].text == a
    assert many.choices[1].text == await text(client, seed=1235, **kw)
    assert len({ch.text for ch in many.choices}) == 3


async def test_stop_token_ids_and_min_tokens_reach_vllm(client):
    """A token forced by logit_bias and named a stop token ends the choice at once with that
    stop_reason; with min_tokens vLLM masks it until that many other tokens are out."""
    forced = {"logit_bias": {str(FORCED): 100}, "temperature": 0}
    resp = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, **forced,
        extra_body={"stop_token_ids": [FORCED], "ignore_eos": True},
    )
    choice = resp.choices[0]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", FORCED)
    assert resp.usage.completion_tokens == 1
    held = await client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, **forced,
        extra_body={"stop_token_ids": [FORCED], "ignore_eos": True, "min_tokens": 3},
    )
    assert (held.choices[0].finish_reason, held.choices[0].stop_reason) == ("stop", FORCED)
    assert held.usage.completion_tokens == 3 + 1


async def test_a_penalty_reaches_vllms_sampler(client):
    """A token favoured by a moderate bias is picked again and again; a frequency penalty
    (subtracted per earlier occurrence) makes vLLM move off it."""
    base = {"temperature": 0, "logit_bias": {str(FORCED): 8}, "extra_body": {"ignore_eos": True}}
    plain = await text(client, **base)
    penalised = await text(client, frequency_penalty=2.0, **base)
    assert plain.count(" the") == 6
    assert penalised != plain
