"""Adapter-aware KV matching: the router's index, fed the blocks a mocker stores under several
LoRA adapters and the base model (its ``BlockStored`` events, with the router's own hashes at
the edge or with tokens only), credits a request only with blocks of its own adapter, checked
by Hypothesis against a brute-force model (the longest block-aligned common prefix with a
stored prompt of the same adapter on each worker)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engines.mocker._sequence import Sequence
from router.config import kv_indexer
from router.events import BlockStored, EventBatch
from router.hashing import request_hashes

BS = 4
ADAPTERS = (None, "a", "b")
#: Prompts over a tiny alphabet from a few shared stems, so prefixes collide often.
STEMS = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 1, 2, 3, 4])
prompts = st.builds(
    lambda stem, tail: stem + tail, st.sampled_from(STEMS),
    st.lists(st.integers(1, 3), max_size=9),
)
stores = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(ADAPTERS), prompts), max_size=10)


def _brute(stored: list[tuple[int, str | None, list[int]]], adapter: str | None,
           prompt: list[int]) -> dict[tuple[int, int], int]:
    full = len(prompt) // BS
    best: dict[tuple[int, int], int] = {}
    for worker, ad, tokens in stored:
        if ad != adapter:
            continue
        n = 0
        while n < min(full, len(tokens) // BS) and (
                tokens[n * BS:(n + 1) * BS] == prompt[n * BS:(n + 1) * BS]):
            n += 1
        if n:
            best[(worker, 0)] = max(best.get((worker, 0), 0), n)
    return best


@settings(max_examples=150, deadline=None)
@given(stores, st.sampled_from(ADAPTERS), prompts, st.booleans(),
       st.sampled_from(("dicts", "packed")))
def test_matching_never_credits_across_adapters(stored, adapter, prompt, edge, layout) -> None:
    index = kv_indexer(BS, None, layout)
    for worker, ad, tokens in stored:
        n = len(tokens) // BS
        seq = Sequence(tokens, block_size=BS, vocab_size=100, seed=0, max_tokens=1,
                       lora_name=ad)
        event = BlockStored(seq.block_hashes(n), None, tokens[: n * BS], BS, lora_name=ad,
                            own_hashes=seq.own_hashes(n) if edge else None)
        index.apply_batch(worker, EventBatch(0.0, [event], 0))
    got = index.find_matches_for_hashes(request_hashes(prompt, BS, adapter))
    assert {k: v for k, v in got.items() if v} == _brute(stored, adapter, prompt)


def test_one_prompt_under_two_adapters_and_the_base_is_three_prefixes() -> None:
    prompt = list(range(1, 17))
    hashes = {ad: request_hashes(prompt, BS, ad) for ad in ADAPTERS}
    assert len({h for hs in hashes.values() for h in hs}) == 3 * len(prompt) // BS
