"""Token-id completions of model 'tiny' through a frontend, for routing tests; each name says
what it returns (the ``x-dynamo-worker`` header, ``WORKER/RANK``, or its worker alone)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from openai import OpenAI


def _post(url: str, tokens: list[int], max_tokens: int,
          headers: dict[str, str] | None = None) -> tuple[str, bytes]:
    """POST the completion; asserts a 200 and returns (x-dynamo-worker header, body)."""
    body = json.dumps({"model": "tiny", "prompt": tokens, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return str(resp.headers["x-dynamo-worker"]), resp.read()


def complete_header_body(url: str, tokens: list[int],
                         max_tokens: int = 4) -> tuple[str, dict[str, Any]]:
    """A completion: (its x-dynamo-worker header, its JSON body)."""
    header, body = _post(url, tokens, max_tokens)
    return header, json.loads(body)


def complete_header(url: str, tokens: list[int], instance: int | None = None) -> str:
    """A 4-token completion (to worker ``instance`` in direct mode): its x-dynamo-worker
    header."""
    headers = {} if instance is None else {"x-worker-instance-id": f"{instance:x}"}
    return _post(url, tokens, 4, headers)[0]


def complete_worker(url: str, tokens: list[int], max_tokens: int = 4) -> str:
    """A completion: the worker (hex) its x-dynamo-worker header names."""
    return _post(url, tokens, max_tokens)[0].split("/")[0]


def complete_worker_tokens(url: str, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    """A completion through the real openai client, ``ignore_eos``: (the worker (hex) its
    x-dynamo-worker header names, its completion tokens)."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True}
    )
    body = raw.parse()
    assert body.usage is not None
    return raw.headers["x-dynamo-worker"].split("/")[0], body.usage.completion_tokens
