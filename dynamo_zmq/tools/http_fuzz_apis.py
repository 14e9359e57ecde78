"""The Responses and Messages APIs' part of ``http_fuzz``: their valid bodies, hostile content
(input items, content blocks, content parts of random types and shapes), stored-response ids,
API-key headers, and the error shape each route must answer in.

Routes: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}`` (drawn as the pseudo
route ``STORED``), ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``. Their errors
are OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on every route but the
Messages API's, which answer Anthropic's ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import random
from typing import Any
from urllib.parse import quote

__all__ = ["MESSAGES", "STORED", "auth_headers", "bad_auth", "blocks", "error_problem",
           "key_header", "stored_id", "valid_body"]

#: The Messages API's routes (Anthropic's error shape).
MESSAGES = ("/v1/messages", "/v1/messages/count_tokens")
#: The pseudo route of ``GET`` / ``DELETE /v1/responses/{id}``.
STORED = "/v1/responses/{id}"
Headers = tuple[tuple[str, str], ...]

_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking",
                "document", "input_text", "output_text", "input_image", "image_url", "nope", "")
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "item_reference",
               "web_search_call", "nope")
_ROLES = ("user", "assistant", "system", "developer", "tool", "robot", "", None)


def valid_body(rng: random.Random, path: str, model: str) -> dict[str, Any]:
    """A valid request body for one of the new routes."""
    if path == "/v1/responses":
        body: dict[str, Any] = {"model": model, "input": rng.choice(["hi there", [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]]),
            "max_output_tokens": rng.randint(1, 4), "stream": rng.random() < 0.3}
        if rng.random() < 0.3:
            body["instructions"] = "Be brief."
        return body
    body = {"model": model, "messages": [{"role": "user", "content": "hi there"}]}
    if rng.random() < 0.3:
        body["system"] = "Be brief."
    if path == "/v1/messages":
        body.update(max_tokens=rng.randint(1, 4), stream=rng.random() < 0.3)
    return body


def _scalar(rng: random.Random) -> Any:
    return rng.choice([None, True, 0, -1, 2**64, 1.5, "", "x", "é" * 3, [], {}])


def _shape(rng: random.Random, kinds: tuple[str | None, ...]) -> dict[str, Any]:
    """An object with a random ``type`` and random values in the fields such objects have."""
    out: dict[str, Any] = {} if rng.random() < 0.1 else {"type": rng.choice(kinds)}
    for name in rng.sample(["text", "content", "id", "name", "input", "tool_use_id", "call_id",
                            "arguments", "output", "role", "thinking", "summary", "source",
                            "image_url", "is_error", "signature", "data"], rng.randint(0, 4)):
        out[name] = rng.choice([_scalar(rng), [_scalar(rng)], {"type": rng.choice(kinds)},
                                [{"type": rng.choice(kinds), "text": _scalar(rng)}]])
    return out


def blocks(rng: random.Random, path: str, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` with its messages, input items or content parts of random types and shapes."""
    body = dict(base)
    if path == "/v1/responses":
        items = [_shape(rng, _ITEM_TYPES) for _ in range(rng.randint(1, 4))]
        for item in items:
            if rng.random() < 0.5:
                item["role"] = rng.choice(_ROLES)
        body["input"] = items
        return body
    messages = []
    for _ in range(rng.randint(1, 4)):
        content: Any = [_shape(rng, _BLOCK_TYPES) for _ in range(rng.randint(0, 3))]
        messages.append({"role": rng.choice(_ROLES), "content": rng.choice([content,
                                                                            _scalar(rng)])})
    body["messages"] = messages
    if path in MESSAGES and rng.random() < 0.3:
        body["system"] = rng.choice([[_shape(rng, _BLOCK_TYPES)], _scalar(rng)])
    return body


def stored_id(rng: random.Random) -> str:
    """A stored response's id, often odd (percent-encoded for the request line)."""
    raw = rng.choice(["resp_nope", "", "resp_" + "a" * 5000, "\x00", "../../etc/passwd", "a/b",
                      "résumé", "resp_%zz", " ", "resp_1?x=1", "\U0001f600"])
    return quote(raw, safe="/?=%")


def key_header(path: str, key: str, rng: random.Random) -> Headers:
    """The right key in one of its two headers (``x-api-key`` on the Messages API only)."""
    if path in MESSAGES and rng.random() < 0.5:
        return (("x-api-key", key),)
    return (("Authorization", f"Bearer {key}"),)


def bad_auth(rng: random.Random, key: str) -> Headers:
    """Headers without an accepted key: none, wrong, empty, malformed, huge or odd bytes."""
    return rng.choice([
        (),
        (("Authorization", "Bearer wrong"),),
        (("Authorization", "Bearer"),),
        (("Authorization", "Bearer "),),
        (("Authorization", f"Basic {key}"),),
        (("Authorization", f"Bearer {key}x"),),
        (("Authorization", f"{key}"),),
        (("x-api-key", ""),),
        (("x-api-key", "wrong"),),
        (("x-api-key", f" {key[:-1]} "),),
        (("Authorization", "Bearer wrong"), ("x-api-key", key)),  # Authorization is read first
        (("Authorization", "Bearer " + "k" * 6000),),
        (("Authorization", "Bearer \xff\xfe"),),
        (("x-api-key", "\xe9" * 8),),
    ])


def auth_headers(rng: random.Random, path: str, key: str | None, bad: bool) -> Headers:
    """The request's key headers: the right key (``key`` set), or ``bad_auth``'s."""
    if key is None:
        return bad_auth(rng, "none") if bad else ()
    return bad_auth(rng, key) if bad else key_header(path, key, rng)


def error_problem(path: str, status: int | None, body: bytes) -> str | None:
    """What is wrong with an error answer's body for its route (None: nothing, or not an
    error): OpenAI's shape, or Anthropic's on the Messages API's routes."""
    if status is None or status < 400:
        return None
    try:
        decoded = json.loads(body)
    except ValueError:
        return f"not JSON: {body[:200]!r}"
    if path in MESSAGES:
        err = decoded.get("error") if isinstance(decoded, dict) else None
        ok = (isinstance(err, dict) and decoded.get("type") == "error" and set(err) ==
              {"type", "message"} and all(isinstance(v, str) and v for v in err.values()))
        return None if ok else f"not Anthropic's error shape: {decoded!r:.300}"
    err = decoded.get("error") if isinstance(decoded, dict) else None
    ok = (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
          and isinstance(err["message"], str) and isinstance(err["type"], str))
    return None if ok else f"not OpenAI's error shape: {decoded!r:.300}"
