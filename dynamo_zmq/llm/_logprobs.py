"""Token texts for logprobs, as vLLM's server shows them (worker post-processing).

vLLM decodes each token of a logprobs entry on its own (``tokenizer.decode([id])``, special
tokens kept), restores leading spaces a SentencePiece ``Metaspace`` decoder strips, and redoes a
text that ends in an incomplete UTF-8 character with up to four preceding sampled tokens as
context (``vllm.v1.engine.logprobs``). ``TokenTexts`` does the same with the worker's
``tokenizers.Tokenizer``, so the frontend's ``token`` / ``bytes`` equal vLLM's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._messages import LLMEngineOutput

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["TokenTexts", "prompt_logprob_texts", "with_logprob_texts"]

_REPLACEMENT = "\ufffd"
#: Preceding sampled tokens vLLM uses to complete a partial UTF-8 character.
_CONTEXT = 4


def _space_marker(tokenizer: Tokenizer) -> str | None:
    """The Metaspace replacement character of the pre-tokenizer, if it has one."""
    try:
        pre = json.loads(tokenizer.to_str()).get("pre_tokenizer") or {}
    except (ValueError, AttributeError):
        return None
    subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for sub in subs:
        if sub.get("type") == "Metaspace":
            return str(sub.get("replacement", "\u2581"))
    return None


class TokenTexts:
    """Per request: the text of each logprobs token, with the sampled tokens as context.

    Args:
        tokenizer: the model's tokenizer.
        generated: output tokens sampled before this worker's (a migrated request's replay).
    """

    __slots__ = ("_context", "_marker", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, generated: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._marker = _space_marker(tokenizer)
        self._context: list[int] = list(generated[-_CONTEXT:])

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _one(self, token: int) -> str:
        text = self._decode([token])
        if self._marker is not None:
            raw = self._tokenizer.id_to_token(token) or ""
            markers = len(raw) - len(raw.lstrip(self._marker))
            missing = markers - (len(text) - len(text.lstrip(" ")))
            if missing > 0:
                text = " " * missing + text
        if text.endswith(_REPLACEMENT):
            text = self._complete(token)
        return text

    def _complete(self, token: int) -> str:
        """vLLM's ``_correct_decoded_token``: the text ``token`` completes after the context."""
        context = self._context
        for n in range(1, min(len(context), _CONTEXT) + 1):
            ctx = context[-n:]
            full = self._decode([*ctx, token])
            if full.endswith(_REPLACEMENT):
                continue
            clean = len(ctx)
            for j in range(len(ctx) - 1, -1, -1):
                if self._decode([ctx[j]]).endswith(_REPLACEMENT):
                    clean = j
                else:
                    break
            prefix = self._decode(ctx[:clean]) if clean > 0 else ""
            if full.startswith(prefix):
                return full[len(prefix) :]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""

    def step(self, sampled: int, alternatives: Sequence[tuple[int, float]]) -> list[str]:
        """The texts of one position: the sampled token's, then each alternative's."""
        texts = [self._one(sampled), *(self._one(token) for token, _ in alternatives)]
        self._context.append(sampled)
        del self._context[:-_CONTEXT]
        return texts


def with_logprob_texts(
    chunk: LLMEngineOutput, engine: LLMEngineOutput, texts: TokenTexts | None
) -> LLMEngineOutput:
    """``chunk`` (post-processed from ``engine``, maybe cut shorter) with the engine's logprobs
    of its tokens and their texts (the engine's own when ``texts`` is None)."""
    n = len(chunk.token_ids)
    log_probs = engine.log_probs
    if log_probs is None:
        return chunk
    top = engine.top_logprobs
    chunk.log_probs = log_probs[:n]
    chunk.top_logprobs = top[:n] if top is not None else None
    if texts is None:
        given = engine.logprob_texts
        chunk.logprob_texts = given[:n] if given is not None else None
        return chunk
    chunk.logprob_texts = [
        texts.step(token, top[i] if top is not None and i < len(top) else ())
        for i, token in enumerate(chunk.token_ids)
    ]
    return chunk


def prompt_logprob_texts(
    tokenizer: Tokenizer, prompt: Sequence[int],
    positions: Sequence[Sequence[tuple[int, float, int]]],
) -> list[list[str]]:
    """The texts of a prompt's logprobs entries (``LLMEngineOutput.prompt_logprobs``), as
    vLLM's server shows them; a position without entries (the first) gets its prompt token's
    own text."""
    texts = TokenTexts(tokenizer)
    out: list[list[str]] = []
    for i, entries in enumerate(positions):
        if not entries:
            token = prompt[i] if i < len(prompt) else None
            out.append([] if token is None else [tokenizer.decode([token],
                                                                  skip_special_tokens=False)])
            continue
        out.append(texts.step(entries[0][0], [(tid, lp) for tid, lp, _ in entries[1:]]))
    return out
