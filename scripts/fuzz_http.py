"""Long HTTP fuzz run against a frontend: many hostile bodies, then a table.

    python scripts/fuzz_http.py [--bodies 10000] [--max-seconds 600] [--concurrency 8]
        [--seed 0] [--url http://HOST:PORT --model NAME] [--body-timeout 1]

Draws bodies from ``dynamo_zmq.tools.http_fuzz`` (the suite's ``tests/test_http_fuzz.py``
draws from the same families: invalid UTF-8, wrong types, huge and non-finite numbers, depth
bombs, huge strings, truncated JSON, random bytes, bodies short of their Content-Length, a few
valid requests; the Responses and Messages APIs' content blocks, stored-response ids and bad
API-key headers) and sends each over a raw socket to every route of ``http_fuzz.ROUTES``, with
``--api-key`` (the started frontend's; the ``auth`` family sends none or a wrong one).
Without ``--url`` it
starts a mocker worker (tiny model, built under a temporary directory) and a frontend with
``--body-timeout``, on loopback with mDNS pinned there, and stops both by pid at the end.

Prints: bodies sent, answers by status code, 5xx, unanswered (connection closed with no
status), hangs (no answer within ``--wait`` seconds), errors not in their route's shape
(``http_fuzz.error_problem``), the frontend's RSS before and after (when it started the
frontend), and whether the frontend still serves a chat completion through the ``openai``
client. Exits 1 on any 5xx, hang, unanswered body or misshapen error, or when it no longer
serves.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import openai
from _bench_child import Child

from dynamo_zmq.tools.http_fuzz import FAMILIES, Answer, Case, error_problem, make_case, send

os.environ.setdefault("DYN_MDNS_INTERFACES", "127.0.0.1")


async def wait_models(url: str, model: str, key: str, seconds: float = 60.0) -> None:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as c:
        deadline = time.monotonic() + seconds
        while True:
            try:
                if model in {m.id for m in (await c.models.list()).data}:
                    return
            except openai.APIError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"model {model!r} not served at {url}")
            await asyncio.sleep(0.2)


async def still_serves(url: str, model: str, key: str) -> bool:
    try:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                                      timeout=30) as client:
            resp = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=3
            )
        return resp.usage is not None and resp.usage.completion_tokens == 3
    except openai.APIError as exc:
        print(f"still-serving check failed: {exc}", file=sys.stderr)
        return False


async def run(args: argparse.Namespace, url: str) -> tuple[collections.Counter[str], list[str]]:
    """Send the bodies; returns answers counted by status (or 'hang'/'none') and examples of
    every failure."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    counts: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    queue: asyncio.Queue[Case] = asyncio.Queue(args.concurrency * 2)
    deadline = time.monotonic() + args.max_seconds

    async def producer() -> None:
        for i in range(args.bodies):
            if time.monotonic() > deadline:
                break
            await queue.put(make_case(random.Random(args.seed + i), args.model, args.huge_cap,
                                      args.api_key))
        for _ in range(args.concurrency):
            await queue.put(Case("stop", "", b""))

    async def consumer() -> None:
        while (case := await queue.get()).family != "stop":
            try:
                answer = await send(host, port, case, args.wait)
            except OSError as exc:
                answer = Answer(None)
                failures.append(f"connect failed: {exc!r}")
            key = "hang" if answer.hung else "none" if answer.status is None else str(answer.status)
            counts[key] += 1
            counts[f"family:{case.family}"] += 1
            path = case.path.split("?")[0]
            shape = "/v1/responses/x" if path.startswith("/v1/responses/") else path
            problem = error_problem(shape, answer.status, answer.body)
            counts["misshapen"] += problem is not None
            bad = answer.hung or answer.status is None or answer.status >= 500 or problem
            if bad and len(failures) < 20:
                failures.append(f"{key}: {case!r} -> {problem or answer.body[:200]!r}")

    await asyncio.gather(producer(), *(consumer() for _ in range(args.concurrency)))
    return counts, failures


def mib(value: int | None) -> str:
    return "n/a (--url)" if value is None else f"{value / 2**20:.0f} MiB"


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k.ljust(width)} | {v} |" for k, v in rows)


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bodies", type=int, default=10_000)
    p.add_argument("--max-seconds", type=float, default=600.0,
                   help="stop drawing new bodies after this long")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait", type=float, default=30.0, help="seconds before an answer is a hang")
    p.add_argument("--huge-cap", type=int, default=4_000_000,
                   help="longest huge string, in characters")
    p.add_argument("--url", help="a running frontend (default: start a worker and a frontend)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--body-timeout", default="1", help="the started frontend's --body-timeout")
    p.add_argument("--api-key", default="fuzz-key", help="the frontend's API key")
    args = p.parse_args()

    procs: list[Child] = []
    try:
        url = args.url
        if url is None:
            from dynamo_zmq.tools.tiny_model import build_tiny_model

            tmp = tempfile.mkdtemp(prefix="fuzz-http-")
            model = build_tiny_model(Path(tmp) / "model")
            ns = f"fuzz{uuid.uuid4().hex[:8]}"
            procs.append(Child(["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path",
                                str(model), "--model-name", args.model, "--namespace", ns,
                                "--host", "127.0.0.1", "--speedup-ratio", "1000",
                                "--mock-embedding-dim", "8"]).wait_ready(60))
            front = Child(["-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", ns,
                           "--body-timeout", args.body_timeout, "--api-key", args.api_key])
            procs.append(front.wait_ready(60))
            url = front.address
        await wait_models(url, args.model, args.api_key)
        rss_before = procs[-1].process.memory_info().rss if procs else None
        started = time.monotonic()
        counts, failures = await run(args, url)
        elapsed = time.monotonic() - started
        rss_after = procs[-1].process.memory_info().rss if procs else None
        serving = await still_serves(url, args.model, args.api_key)
    finally:
        for proc in reversed(procs):
            proc.stop()

    statuses = sorted(k for k in counts if k[0].isdigit())
    sent = sum(counts[k] for k in statuses) + counts["hang"] + counts["none"]
    five = sum(counts[k] for k in statuses if k.startswith("5"))
    rows = [("bodies sent", f"{sent} in {elapsed:.0f} s"),
            *((f"status {k}", str(counts[k])) for k in statuses),
            ("5xx", str(five)), ("unanswered", str(counts["none"])), ("hangs", str(counts["hang"])),
            ("errors not in their route's shape", str(counts["misshapen"])),
            ("frontend RSS before", mib(rss_before)), ("frontend RSS after", mib(rss_after)),
            ("still serving", "yes" if serving else "NO"),
            ("bodies by family", ", ".join(f"{f} {counts[f'family:{f}']}" for f in FAMILIES))]
    print(table(rows))
    for line in failures:
        print(line)
    failed = five or counts["hang"] or counts["none"] or counts["misshapen"]
    return 0 if serving and not failed else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
