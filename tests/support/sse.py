"""Streaming chats against a frontend, and the server-sent events of their bodies."""

from __future__ import annotations

import asyncio

import httpx

__all__ = ["LONG_STORY", "events", "open_streams"]

#: The chat every stream of ``open_streams`` sends.
LONG_STORY = [{"role": "user", "content": "Tell me a long story."}]


async def open_streams(url: str, count: int, max_tokens: int, started: asyncio.Event,
                       client: httpx.AsyncClient) -> list[asyncio.Task[bytes]]:
    """``count`` streaming chats; ``started`` is set once each has received a content chunk.
    Each task returns the whole body (httpx raises if the chunked body is cut)."""
    seen: set[int] = set()

    async def one(i: int) -> bytes:
        body = b""
        payload = {"model": "tiny", "messages": LONG_STORY, "stream": True,
                   "max_tokens": max_tokens, "ignore_eos": True}
        async with client.stream("POST", f"{url}/v1/chat/completions", json=payload) as resp:
            assert resp.status_code == 200
            async for chunk in resp.aiter_bytes():
                body += chunk
                if b'"content":"' in body.replace(b'"content":""', b""):
                    seen.add(i)
                    if len(seen) == count:
                        started.set()
        return body

    return [asyncio.create_task(one(i)) for i in range(count)]


def events(body: bytes) -> list[bytes]:
    """The SSE events of a streamed body, in order: its non-blank ``\\n\\n``-separated parts."""
    return [e for e in body.split(b"\n\n") if e.strip()]
