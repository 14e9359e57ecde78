"""Hostile HTTP bodies for the frontend, and a raw-socket client that sends them.

``make_case(rng)`` draws one ``Case``: a JSON route and a body from one of the families below,
and how to send it (a body shorter than its ``Content-Length``, left open, waits for the
frontend's body timeout). ``send(host, port, case, wait)`` sends it over a plain socket (no
client library checks or fixes anything) and reads the status of the answer, or reports a hang.
``tests/test_http_fuzz.py`` draws cases through hypothesis (``random.Random`` it controls);
``scripts/fuzz_http.py`` draws many more from seeds.

Families: invalid UTF-8 inside strings (0xFF, overlong C0 80, surrogate ED A0 80, F5.., lone
continuation and cut sequences), wrong types, huge and non-finite numbers (NaN, Infinity,
1e999, 400-digit integers), depth bombs (arrays and objects nested thousands deep), huge
strings, truncated JSON, random bytes, bodies left short of their ``Content-Length``, and a few
valid requests. For the Responses and Messages APIs (``http_fuzz_apis.py``) also messages,
input items and content blocks of random types and shapes (``blocks``), odd stored-response ids
on ``GET`` / ``DELETE /v1/responses/{id}`` (``ids``), and, against a frontend with an API key,
requests without an accepted key (``auth``: none, wrong, malformed, huge).
``error_problem`` says when an error is not in its route's shape (Anthropic's on
``/v1/messages``, OpenAI's elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

from .http_fuzz_apis import STORED, auth_headers, blocks, error_problem, stored_id, valid_body

__all__ = ["FAMILIES", "ROUTES", "Answer", "Case", "error_problem", "make_case", "send"]

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/clear_kv_blocks",
          "/v1/responses", STORED, "/v1/messages", "/v1/messages/count_tokens")
FAMILIES = ("utf8", "types", "numbers", "depth", "huge", "truncated", "bytes", "short", "valid",
            "blocks", "auth", "ids")
_NEW_APIS = ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens")
_BAD_UTF8 = (b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf5\x80\x80\x80", b"\x80", b"\xe2\x82",
             b"\xf0\x9f\x98", b"\xfe\xfe", b"\xc1\xbf", b"\xf4\x90\x80\x80")
_NUMBERS = ("NaN", "-NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "-0",
            "9" * 400, "-" + "9" * 400, "18446744073709551616", "-9223372036854775809",
            "0.1e", "1.5", "01", "1e5", "2147483648", "-1")
_NUMERIC_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
                   "min_tokens", "top_k", "min_p", "logprobs", "top_logprobs", "best_of",
                   "frequency_penalty", "presence_penalty", "repetition_penalty", "dimensions",
                   "max_output_tokens")
_FIELDS = ("model", "messages", "prompt", "input", "max_tokens", "temperature", "stream", "stop",
           "n", "top_p", "stream_options", "seed", "logit_bias", "tools", "tool_choice",
           "response_format", "guided_json", "chat_template_kwargs", "encoding_format", "echo",
           "best_of", "logprobs", "stop_token_ids", "min_tokens", "instructions", "text",
           "max_output_tokens", "previous_response_id", "store", "include", "reasoning",
           "system", "stop_sequences", "thinking", "metadata", "top_k")
#: Fields a huge string goes into. Not ``stop``: a long stop string is the stop-string item of
#: issue 20 (bounded by the frontend there), not this fuzzer's.
_STRING_FIELDS = ("model", "user", "content", "prompt", "input", "name", "encoding_format",
                  "instructions", "system")


@dataclass(frozen=True)
class Case:
    """One request: ``body`` sent to ``path`` with ``method`` and ``headers``; ``declared``
    overrides its Content-Length (more than ``len(body)``: the rest never comes and the
    connection stays open)."""

    family: str
    path: str
    body: bytes
    declared: int | None = None
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:
        head = self.body[:120]
        more = f"... ({len(self.body)} bytes)" if len(self.body) > 120 else ""
        return (f"Case({self.family}, {self.method} {self.path[:120]}, {head!r}{more}, "
                f"declared={self.declared}, headers={[(k, v[:40]) for k, v in self.headers]})")


@dataclass(frozen=True)
class Answer:
    """What came back: the status (None: none), or ``hung`` when nothing came in time."""

    status: int | None
    body: bytes = b""
    hung: bool = False


def _valid(rng: random.Random, path: str, model: str) -> dict[str, Any]:
    if path in _NEW_APIS:
        return valid_body(rng, path, model)
    if path.endswith("chat/completions"):
        return {"model": model, "messages": [{"role": "user", "content": "hi there"}],
                "max_tokens": rng.randint(1, 4), "stream": rng.random() < 0.3}
    if path.endswith("/completions"):
        return {"model": model, "prompt": "hello", "max_tokens": rng.randint(1, 4),
                "stream": rng.random() < 0.3}
    if path.endswith("embeddings"):
        return {"model": model, "input": rng.choice(["hello", ["a", "b"], [1, 2, 3]])}
    return {"model": model} if rng.random() < 0.5 else {}


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31, 2**63, -(2**63) - 1, 2**70, rng.randint(-9, 9)])
    if kind == 3:
        return rng.choice([0.5, -2.5, 1e308, 3.0, float("nan"), float("inf")])
    if kind == 4:
        return "".join(chr(rng.randrange(0x20, 0x2FF)) for _ in range(rng.randrange(12)))
    if kind in (5, 6):
        return [_json_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {str(_json_value(rng, 3)): _json_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def _utf8(rng: random.Random, base: dict[str, Any]) -> bytes:
    """``base`` with an invalid UTF-8 sequence spliced into one of its strings (or a key)."""
    raw = _dumps(base)
    bad = rng.choice(_BAD_UTF8)
    quotes = [i for i, c in enumerate(raw) if c == ord('"')]
    at = rng.choice(quotes) + 1 if quotes else 0
    return raw[:at] + bad + raw[at:]


def _numbers(rng: random.Random, base: dict[str, Any]) -> bytes:
    fields = rng.sample(_NUMERIC_FIELDS, rng.randint(1, 3))
    raw = _dumps({k: v for k, v in base.items() if k not in fields})[:-1]
    extra = ", ".join(f'"{k}": {rng.choice(_NUMBERS)}' for k in fields)
    if rng.random() < 0.3:
        extra += f', "logit_bias": {{"5": {rng.choice(_NUMBERS)}}}'
    return raw + b", " + extra.encode() + b"}"


def _depth(rng: random.Random, base: dict[str, Any]) -> bytes:
    depth = rng.choice([64, 500, 1100, 5000, 100_000])
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    bomb = opener * depth + b"1" + closer * depth
    if rng.random() < 0.2:
        bomb = opener * depth  # never closed
    field = rng.choice(["messages", "prompt", "input", "guided_json", "chat_template_kwargs",
                        "tools", "model", "stop", "logit_bias", "response_format", "text",
                        "system", "metadata"])
    raw = _dumps({k: v for k, v in base.items() if k != field})[:-1]
    return raw + b', "' + field.encode() + b'": ' + bomb + b"}"


def _huge(rng: random.Random, base: dict[str, Any], cap: int) -> bytes:
    size = rng.choice([10_000, 100_000, cap])
    text = rng.choice(["a", "hello world ", "\u00e9", "\U0001f600", "\\u0000", '\\"'])
    huge = text * max(1, size // len(text))
    field = rng.choice(_STRING_FIELDS)
    body = dict(base)
    if field == "content":
        body["messages"] = [{"role": "user", "content": "x"}]
        raw = _dumps(body).replace(b'"content": "x"', b'"content": "' + huge.encode() + b'"')
        return raw
    raw = _dumps({k: v for k, v in body.items() if k != field})[:-1]
    return raw + b', "' + field.encode() + b'": "' + huge.encode() + b'"}'


def make_case(rng: random.Random, model: str = "tiny", huge_cap: int = 1_000_000,
              api_key: str | None = None) -> Case:
    """One hostile (or, rarely, valid) request for the routes in ``ROUTES``.

    Args:
        rng: the source of every choice (seeded, or hypothesis's).
        model: the served model's name (half the bodies name it, so they get past the lookup).
        huge_cap: the largest "huge string", in characters.
        api_key: the frontend's key: every case but the ``auth`` family's sends it (None:
            the frontend has none).
    """
    path = rng.choice(ROUTES)
    if path == STORED:
        family = rng.choice(("ids", "auth"))
        method = rng.choice(("GET", "GET", "DELETE", "DELETE", "POST", "PUT", "PATCH"))
        return Case(family, f"/v1/responses/{stored_id(rng)}", b"", method=method,
                    headers=auth_headers(rng, path, api_key, family == "auth"))
    family = rng.choice([f for f in FAMILIES if f != "ids"])
    headers = auth_headers(rng, path, api_key, family == "auth")
    return _body_case(rng, family, path, model, huge_cap, headers)


def _body_case(rng: random.Random, family: str, path: str, model: str, huge_cap: int,
               headers: tuple[tuple[str, str], ...]) -> Case:
    base = _valid(rng, path, model if rng.random() < 0.8 else "nope")

    def case(body: bytes, declared: int | None = None) -> Case:
        return Case(family, path, body, declared, headers=headers)

    if family == "utf8":
        return case(_utf8(rng, base))
    if family == "types":
        fields = rng.sample(_FIELDS, rng.randint(1, 4))
        return case(_dumps({**base, **{k: _json_value(rng) for k in fields}}))
    if family == "numbers":
        return case(_numbers(rng, base))
    if family == "depth":
        return case(_depth(rng, base))
    if family == "huge":
        return case(_huge(rng, base, huge_cap))
    if family == "truncated":
        raw = _dumps(base)
        return case(raw[: rng.randrange(len(raw))])
    if family == "bytes":
        return case(rng.randbytes(rng.randrange(300)))
    if family == "short":
        raw = _dumps(base)
        return case(raw[: rng.randrange(len(raw))], declared=len(raw))
    if family == "blocks":
        return case(_dumps(blocks(rng, path, base)))
    return case(_dumps(base))


async def _read_answer(reader: asyncio.StreamReader) -> Answer:
    line = await reader.readline()
    if not line:
        return Answer(None)
    parts = line.split()
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    length, chunked = None, False
    while True:
        header = await reader.readline()
        if header in (b"\r\n", b"\n", b""):
            break
        name, _, value = header.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
        elif name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if length is not None:
        return Answer(status, await reader.readexactly(length))
    body = b""
    if chunked:
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                break
            body += await reader.readexactly(size + 2)
        return Answer(status, body)
    return Answer(status, await reader.read())


async def send(host: str, port: int, case: Case, wait: float = 30.0) -> Answer:
    """Send ``case`` over a fresh connection and read the answer (a whole SSE stream included).

    Args:
        wait: seconds to wait for the whole answer; past it the answer is ``hung``.
    """
    reader, writer = await asyncio.open_connection(host, port)
    try:
        declared = len(case.body) if case.declared is None else case.declared
        extra = "".join(f"{name}: {value}\r\n" for name, value in case.headers)
        head = (f"{case.method} {case.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {declared}\r\n{extra}"
                "Connection: close\r\n\r\n").encode("latin-1")
        writer.write(head + case.body)
        await writer.drain()
        try:
            async with asyncio.timeout(wait):
                return await _read_answer(reader)
        except TimeoutError:
            return Answer(None, hung=True)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return Answer(None)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass
