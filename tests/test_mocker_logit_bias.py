"""The mocker's ``logit_bias``: its logits are all equal, so token ``t`` weighs ``exp(bias[t])``
against 1 for every other token: a bias of 100 forces a token, -100 bans it, a moderate one
favours it; sampling without a bias is unchanged, and a migrated sequence goes on as the
original would have."""

from __future__ import annotations

import collections
import math

from engines.mocker._sequence import Sequence


def seq(bias: dict[int, float] | None, prompt: list[int] | None = None, resumed: int = 0,
        vocab: int = 64) -> Sequence:
    return Sequence(prompt or [1, 2, 3], block_size=4, vocab_size=vocab, seed=7,
                    max_tokens=10_000, logit_bias=bias, resumed=resumed)


def draws(s: Sequence, count: int) -> list[int]:
    return [s.sample() for _ in range(count)]


def test_a_strong_bias_forces_or_bans_a_token() -> None:
    assert set(draws(seq({5: 100.0}), 500)) == {5}
    banned = draws(seq({t: -100.0 for t in range(10)}), 2000)
    assert not set(banned) & set(range(10))
    assert set(draws(seq({t: -100.0 for t in range(63)}), 200)) == {63}


def test_a_moderate_bias_weighs_a_token_by_its_exponential() -> None:
    counts = collections.Counter(draws(seq({9: math.log(63.0)}), 20_000))
    # token 9 weighs 63 against 63 others of weight 1: about half of the draws
    assert 0.45 < counts[9] / 20_000 < 0.55


def test_no_bias_samples_as_before_and_a_migrated_sequence_goes_on() -> None:
    assert draws(seq(None), 50) == draws(seq({}), 50)
    bias = {4: 2.0, 11: -1.0}
    original = draws(seq(bias), 30)
    resumed = seq(bias, prompt=[1, 2, 3, *original[:12]], resumed=12)
    assert draws(resumed, 18) == original[12:]
