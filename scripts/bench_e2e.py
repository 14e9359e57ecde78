"""End-to-end streaming load against any OpenAI-compatible server.

    python scripts/bench_e2e.py --url http://127.0.0.1:8000 --model NAME
        [--concurrency 1,16,64] [--requests-per-level 200] [--max-seconds 60]
        [--endpoint chat|completions] [--max-tokens 100] [--prompt-tokens 100-500]
        [--tokenizer DIR] [--pids frontend=PID,worker=PID] [--json OUT] [--plot OUT.png]

    python scripts/bench_e2e.py --compare OURS.json BASE.json [--labels ours,dynamo]
        [--plot OUT.png]

    python scripts/bench_e2e.py --summary RESULTS_DIR... [--plot OUT.png]

``--summary`` reads the ``ours-rN.json`` / ``dynamo-rN.json`` pairs that
``scripts/bench_vs_dynamo.sh`` leaves in each results directory and prints, per concurrency, one
row per pair (tok/s, TTFT and ITL p50/p99, CPU per request, SSE events per request, the
frontend's peak fds and RSS) and the medians of the ratios; ``--plot`` draws the ratios per pair.

For each concurrency level C, C closed-loop clients (one keep-alive HTTP/1.1 connection each)
issue streaming requests (``stream: true``, ``max_tokens``, ``min_tokens``, ``ignore_eos``,
``stream_options.include_usage``) until ``--requests-per-level`` were issued or
``--max-seconds`` passed; requests in flight then finish (each is cut at ``--request-timeout``).

Prompts are random pseudo-words from a seeded generator. With ``--tokenizer DIR`` (or a
``--model`` that is a local directory holding tokenizer.json) each prompt is sized to a token
count drawn uniformly from ``--prompt-tokens``; otherwise a words-per-token estimate is used.
The server's own ``usage.prompt_tokens`` is reported as a check.

Reported per level: requests ok / errors, req/s, output tok/s (``usage.completion_tokens``
when the server sends it, else content-bearing chunks), TTFT p50/p99, ITL p50/p99 (over
requests of (last - first token time) / (tokens - 1)), CPU milliseconds per request of every
``--pids`` process (with its children) and of this client, read with psutil around the measured
window, and each ``--pids`` process tree's peak open fds and resident MB (sampled twice a
second).

The HTTP client is hand-rolled on asyncio streams (uvloop when installed) and decodes chunks with
msgspec when installed, so the load generator itself stays cheap on a small machine: its CPU
per request is printed next to the servers'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

try:
    import msgspec
except ImportError:  # pragma: no cover - optional
    msgspec = None  # type: ignore[assignment]

try:
    import psutil
except ImportError:  # pragma: no cover - optional
    psutil = None  # type: ignore[assignment]


# -- chunk decoding ---------------------------------------------------------------------------

if msgspec is not None:

    class _Delta(msgspec.Struct):
        content: str | None = None
        reasoning_content: str | None = None

    class _Choice(msgspec.Struct):
        delta: _Delta | None = None
        text: str | None = None
        finish_reason: str | None = None

    class _Usage(msgspec.Struct):
        prompt_tokens: int | None = None
        completion_tokens: int | None = None

    class _Chunk(msgspec.Struct):
        choices: list[_Choice] = []
        usage: _Usage | None = None
        error: Any = None

    _decode = msgspec.json.Decoder(_Chunk).decode

    def _read_chunk(payload: bytes) -> tuple[bool, int | None, int | None, str | None]:
        """(has content, prompt tokens, completion tokens, error) of one SSE data payload."""
        c = _decode(payload)
        has = False
        for ch in c.choices:
            d = ch.delta
            if ch.text or (d is not None and (d.content or d.reasoning_content)):
                has = True
        u = c.usage
        err = None if c.error is None else str(c.error)[:200]
        if u is None:
            return has, None, None, err
        return has, u.prompt_tokens, u.completion_tokens, err

else:

    def _read_chunk(payload: bytes) -> tuple[bool, int | None, int | None, str | None]:
        c = json.loads(payload)
        has = False
        for ch in c.get("choices") or ():
            d = ch.get("delta") or {}
            if ch.get("text") or d.get("content") or d.get("reasoning_content"):
                has = True
        u = c.get("usage") or {}
        err = None if c.get("error") is None else str(c["error"])[:200]
        return has, u.get("prompt_tokens"), u.get("completion_tokens"), err


# -- one request ------------------------------------------------------------------------------


@dataclass
class Result:
    ok: bool
    t_send: float
    t_first: float = math.nan
    t_last: float = math.nan
    t_end: float = math.nan
    chunks: int = 0
    tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None


class HttpError(Exception):
    pass


class Conn:
    """One keep-alive HTTP/1.1 connection that streams SSE responses."""

    def __init__(self, host: str, port: int, quickack: bool = False) -> None:
        self.host, self.port = host, port
        self.quickack = quickack and hasattr(socket, "TCP_QUICKACK")
        self.sock: socket.socket | None = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(
            self.host, self.port, limit=1 << 20
        )
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock if self.quickack else None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def stream(self, head: bytes, body: bytes, res: Result) -> None:
        if self.writer is None:
            await self.open()
        assert self.reader is not None and self.writer is not None
        reader = self.reader
        res.t_send = time.perf_counter()
        self.writer.write(head + body)
        buf = bytearray()
        while (i := buf.find(b"\r\n\r\n")) < 0:
            data = await reader.read(65536)
            if not data:
                raise HttpError("connection closed before response headers")
            now = time.perf_counter()
            buf += data
        lines = bytes(buf[:i]).split(b"\r\n")
        del buf[: i + 4]
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip().lower()
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"")
        remaining = int(headers[b"content-length"]) if b"content-length" in headers else -1
        keep = headers.get(b"connection") != b"close" and (chunked or remaining >= 0)

        sse = bytearray()
        body_bytes = bytearray()  # error bodies only
        size = -1  # bytes left in the chunk; -1 size line next, -2 CRLF next, -3 final CRLF next
        finished = False  # HTTP body complete
        done = False  # SSE [DONE] seen
        while True:
            # de-frame whatever is buffered
            if chunked:
                pos = 0
                while not finished:
                    if size == -1:  # expecting a size line
                        j = buf.find(b"\r\n", pos)
                        if j < 0:
                            break
                        size = int(bytes(buf[pos:j]).split(b";")[0], 16)
                        pos = j + 2
                        if size == 0:
                            size = -3
                        continue
                    if size == -3:  # last chunk seen: the empty line ends the body (no trailers)
                        if len(buf) - pos < 2:
                            break
                        pos += 2
                        finished = True
                        continue
                    if size == -2:  # expecting the CRLF after chunk data
                        if len(buf) - pos < 2:
                            break
                        pos += 2
                        size = -1
                        continue
                    take = min(size, len(buf) - pos)
                    if take <= 0:
                        break
                    sse += buf[pos : pos + take]
                    pos += take
                    size -= take
                    if size == 0:
                        size = -2
                del buf[:pos]
            else:
                sse += buf
                if remaining >= 0:
                    remaining -= len(buf)
                    finished = remaining <= 0
                buf.clear()
            if status != 200:
                body_bytes += sse
                sse.clear()
            elif sse:
                if b"\r" in sse:
                    sse[:] = sse.replace(b"\r\n", b"\n")
                end = sse.rfind(b"\n\n")
                if end >= 0:
                    for event in bytes(sse[:end]).split(b"\n\n"):
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data:"):
                                continue
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                done = True
                                continue
                            has, ptok, ctok, err = _read_chunk(payload)
                            if err is not None:
                                res.error = err
                            if has:
                                res.chunks += 1
                                if res.chunks == 1:
                                    res.t_first = now
                                res.t_last = now
                            if ptok is not None:
                                res.prompt_tokens = ptok
                            if ctok is not None:
                                res.tokens = ctok
                    del sse[: end + 2]
            if finished:
                break
            data = await reader.read(65536)
            now = time.perf_counter()
            if self.sock is not None:  # Linux resets QUICKACK after use: ack at once, every read
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            if not data:
                keep = False
                if chunked or remaining > 0:
                    raise HttpError("connection closed mid-response")
                break
            buf += data
        res.t_end = now
        if not keep:
            self.close()
        if status != 200:
            raise HttpError(f"HTTP {status}: {bytes(body_bytes[:200]).decode(errors='replace')}")
        if res.error is not None:
            raise HttpError(f"stream error: {res.error}")
        if not done:
            raise HttpError("stream ended without [DONE]")
        if res.tokens == 0:
            res.tokens = res.chunks
        res.ok = True


# -- prompts ----------------------------------------------------------------------------------

_SYLLABLES = [a + b for a in "bcdfghjklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ai", "ou")]


class PromptMaker:
    """Seeded random pseudo-word prompts sized in tokens (exactly with a tokenizer)."""

    def __init__(
        self, seed: int, lo: int, hi: int, tokenizer: str | None, tokens_per_word: float
    ) -> None:
        self.rng = random.Random(seed)
        self.lo, self.hi = lo, hi
        self.words = [
            "".join(self.rng.choice(_SYLLABLES) for _ in range(self.rng.randint(1, 3)))
            for _ in range(2000)
        ]
        self.tok = None
        self.tokens_per_word = tokens_per_word
        if tokenizer:
            try:
                from tokenizers import Tokenizer

                self.tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
            except Exception as exc:
                print(f"note: tokenizer at {tokenizer} not usable ({exc}); "
                      "estimating prompt length", file=sys.stderr)
        if self.tok is not None:
            sample = " ".join(self.rng.choice(self.words) for _ in range(2000))
            self.tokens_per_word = len(self.tok.encode(sample, add_special_tokens=False).ids) / 2000

    def make(self) -> tuple[str, int]:
        target = self.rng.randint(self.lo, self.hi)
        n = max(1, round(target / self.tokens_per_word))
        words = [self.rng.choice(self.words) for _ in range(n + n // 2 + 8)]
        if self.tok is None:
            return " ".join(words[:n]), target
        lo, hi = 1, len(words)
        count = lambda k: len(self.tok.encode(" ".join(words[:k]), add_special_tokens=False).ids)  # noqa: E731
        while count(hi) < target:
            words += [self.rng.choice(self.words) for _ in range(n)]
            hi = len(words)
        while lo < hi:  # smallest k with count(k) >= target
            mid = (lo + hi) // 2
            if count(mid) >= target:
                hi = mid
            else:
                lo = mid + 1
        return " ".join(words[:lo]), count(lo)


# -- load levels ------------------------------------------------------------------------------


def _cpu_tree(p: Any) -> dict[int, float]:
    """CPU seconds (user + system) of a process and its live descendants, by pid."""
    out: dict[int, float] = {}
    try:
        procs = [p, *p.children(recursive=True)]
    except Exception:
        return out
    for q in procs:
        try:
            t = q.cpu_times()
            out[q.pid] = t.user + t.system
        except Exception:
            pass
    return out


def _footprint(p: Any) -> tuple[int, float]:
    """Open fds and resident MB of a process and its live descendants."""
    fds, rss = 0, 0.0
    try:
        procs = [p, *p.children(recursive=True)]
    except Exception:
        return fds, rss
    for q in procs:
        try:
            fds += q.num_fds()
            rss += q.memory_info().rss / 2**20
        except Exception:
            pass
    return fds, rss


def _busy() -> float:
    """Machine-wide busy CPU seconds (all cores), to spot load from processes not measured."""
    if psutil is None:
        return math.nan
    t = psutil.cpu_times()
    return (
        sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0)
        - getattr(t, "guest_nice", 0.0)
    )


def _cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    if not after:
        return math.nan
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


@dataclass
class Level:
    concurrency: int
    requests: int = 0
    ok: int = 0
    errors: int = 0
    wall_s: float = 0.0
    req_s: float = 0.0
    out_tok_s: float = 0.0
    chunks_s: float = 0.0
    ttft_p50_ms: float = math.nan
    ttft_p99_ms: float = math.nan
    itl_p50_ms: float = math.nan
    itl_p99_ms: float = math.nan
    e2e_p50_ms: float = math.nan
    prompt_tokens_mean: float = math.nan
    output_tokens_mean: float = math.nan
    cpu_ms_per_req: dict[str, float] = field(default_factory=dict)
    cpu_cores: dict[str, float] = field(default_factory=dict)
    #: Peak open file descriptors and resident MB of each --pids process tree during the level.
    fds_max: dict[str, int] = field(default_factory=dict)
    rss_mb_max: dict[str, float] = field(default_factory=dict)
    first_errors: list[str] = field(default_factory=list)
    other_cores: float = math.nan  # busy cores not accounted to --pids or this client


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        u = urlsplit(args.url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        base = u.path.rstrip("/")
        self.path = (
            f"{base}/v1/chat/completions" if args.endpoint == "chat" else f"{base}/v1/completions"
        )
        tok = args.tokenizer
        if tok is None and (Path(args.model) / "tokenizer.json").is_file():
            tok = args.model
        lo, _, hi = args.prompt_tokens.partition("-")
        self.prompts = PromptMaker(args.seed, int(lo), int(hi or lo), tok, args.tokens_per_word)
        self.procs: dict[str, Any] = {}
        for item in filter(None, (args.pids or "").split(",")):
            name, _, pid = item.partition("=")
            if psutil is None:
                print("note: psutil missing; no CPU figures", file=sys.stderr)
                break
            self.procs[name] = psutil.Process(int(pid))
        if psutil is not None:
            self.procs["client"] = psutil.Process()

    def body(self) -> tuple[bytes, int]:
        a = self.args
        text, ptoks = self.prompts.make()
        req: dict[str, Any] = {"model": a.model, "stream": True, "max_tokens": a.max_tokens}
        if a.endpoint == "chat":
            req["messages"] = [{"role": "user", "content": text}]
        else:
            req["prompt"] = text
        if not a.no_ignore_eos:
            req["ignore_eos"] = True
            req["min_tokens"] = a.max_tokens
        req["stream_options"] = {"include_usage": True}
        if a.temperature is not None:
            req["temperature"] = a.temperature
        data = json.dumps(req).encode()
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        return head + data, ptoks

    async def one(self, conn: Conn, payload: bytes) -> Result:
        res = Result(ok=False, t_send=time.perf_counter())
        try:
            await asyncio.wait_for(conn.stream(payload, b"", res), self.args.request_timeout)
        except (
            HttpError, OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError
        ) as exc:
            res.ok = False
            res.error = f"{type(exc).__name__}: {exc}"[:300]
            res.t_end = time.perf_counter()
            conn.close()
        return res

    async def run_level(self, conc: int, total: int, max_s: float) -> Level:
        payloads = [self.body()[0] for _ in range(total)]
        conns = [Conn(self.host, self.port, self.args.quickack) for _ in range(conc)]
        for c, e in zip(
            conns,
            await asyncio.gather(*(c.open() for c in conns), return_exceptions=True),
            strict=True,
        ):
            if isinstance(e, BaseException):
                c.close()  # counted as that client's request errors below
        results: list[Result] = []
        issued = 0
        cpu0 = {n: _cpu_tree(p) for n, p in self.procs.items()}
        busy0 = _busy()
        t0 = time.perf_counter()
        deadline = t0 + max_s

        async def client(conn: Conn) -> None:
            nonlocal issued
            while issued < total and time.perf_counter() < deadline:
                payload = payloads[issued]
                issued += 1
                results.append(await self.one(conn, payload))

        peaks: dict[str, tuple[int, float]] = {}

        async def sample() -> None:  # the processes' fds and RSS, twice a second
            while True:
                for n, p in self.procs.items():
                    fds, rss = _footprint(p)
                    old = peaks.get(n, (0, 0.0))
                    peaks[n] = (max(old[0], fds), max(old[1], rss))
                await asyncio.sleep(0.5)

        sampler = asyncio.ensure_future(sample())
        await asyncio.gather(*(client(c) for c in conns))
        wall = time.perf_counter() - t0
        sampler.cancel()
        cpu1 = {n: _cpu_tree(p) for n, p in self.procs.items()}
        busy1 = _busy()
        for c in conns:
            c.close()
        lvl = summarize(conc, results, wall, cpu0, cpu1)
        lvl.fds_max = {n: v[0] for n, v in peaks.items()}
        lvl.rss_mb_max = {n: round(v[1], 1) for n, v in peaks.items()}
        measured = sum(v for v in lvl.cpu_cores.values() if not math.isnan(v))
        lvl.other_cores = (busy1 - busy0) / wall - measured if wall > 0 else math.nan
        return lvl

    async def run(self) -> list[Level]:
        a = self.args
        if a.warmup:
            await self.run_level(min(a.warmup, max(self.levels())), a.warmup, a.max_seconds)
        out = []
        for conc in self.levels():
            lvl = await self.run_level(conc, max(a.requests_per_level, conc), a.max_seconds)
            out.append(lvl)
            if a.verbose:
                print(f"level {conc}: {lvl.ok} ok, {lvl.errors} errors in {lvl.wall_s:.1f}s",
                      file=sys.stderr)
            await asyncio.sleep(a.pause)
        return out

    def levels(self) -> list[int]:
        return [int(c) for c in self.args.concurrency.split(",") if c.strip()]


def summarize(conc: int, results: list[Result], wall: float, cpu0: dict, cpu1: dict) -> Level:
    ok = [r for r in results if r.ok]
    lvl = Level(concurrency=conc, requests=len(results), ok=len(ok),
                errors=len(results) - len(ok), wall_s=wall)
    lvl.first_errors = sorted({r.error or "?" for r in results if not r.ok})[:5]
    if wall > 0:
        lvl.req_s = len(ok) / wall
        lvl.out_tok_s = sum(r.tokens for r in ok) / wall
        lvl.chunks_s = sum(r.chunks for r in ok) / wall
    ttft = [(r.t_first - r.t_send) * 1e3 for r in ok if r.chunks]
    lvl.ttft_p50_ms, lvl.ttft_p99_ms = pct(ttft, 0.5), pct(ttft, 0.99)
    itl = [(r.t_last - r.t_first) * 1e3 / (r.tokens - 1) for r in ok if r.chunks and r.tokens > 1]
    lvl.itl_p50_ms, lvl.itl_p99_ms = pct(itl, 0.5), pct(itl, 0.99)
    lvl.e2e_p50_ms = pct([(r.t_end - r.t_send) * 1e3 for r in ok], 0.5)
    pt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    lvl.prompt_tokens_mean = statistics.fmean(pt) if pt else math.nan
    lvl.output_tokens_mean = statistics.fmean([r.tokens for r in ok]) if ok else math.nan
    for name in cpu0:
        used = _cpu_used(cpu0[name], cpu1[name])
        lvl.cpu_ms_per_req[name] = used * 1e3 / len(ok) if ok else math.nan
        lvl.cpu_cores[name] = used / wall if wall > 0 else math.nan
    return lvl


# -- output -----------------------------------------------------------------------------------


def f(x: float, nd: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{nd}f}"


def table(levels: list[dict[str, Any]], title: str | None = None) -> str:
    names = list(levels[0]["cpu_ms_per_req"]) if levels else []
    head = ["conc", "ok", "err", "wall s", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
            "ITL p50 ms", "ITL p99 ms", "prompt tok", "out tok"]
    head += [f"{n} CPU ms/req (cores)" for n in names]
    head += [f"{n} fds / RSS MB" for n in names] + ["other cores"]
    rows = [f"### {title}", ""] if title else []
    rows += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lv in levels:
        cells = [str(lv["concurrency"]), str(lv["ok"]), str(lv["errors"]), f(lv["wall_s"], 2),
                 f(lv["req_s"]), f(lv["out_tok_s"], 0), f(lv["ttft_p50_ms"], 2),
                 f(lv["ttft_p99_ms"], 2), f(lv["itl_p50_ms"], 3),
                 f(lv.get("itl_p99_ms", math.nan), 3),
                 f(lv["prompt_tokens_mean"], 0), f(lv["output_tokens_mean"], 0)]
        cells += [f"{f(lv['cpu_ms_per_req'][n], 2)} ({f(lv['cpu_cores'][n], 2)})" for n in names]
        fds, rss = lv.get("fds_max", {}), lv.get("rss_mb_max", {})
        cells += [f"{fds.get(n, '-')} / {f(rss.get(n, math.nan), 0)}" for n in names]
        cells.append(f(lv.get("other_cores", math.nan), 2))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def compare(a: dict[str, Any], b: dict[str, Any], la: str, lb: str) -> str:
    bl = {lv["concurrency"]: lv for lv in b["levels"]}
    names = [n for n in (a["levels"][0]["cpu_ms_per_req"] if a["levels"] else {}) if n in
             (b["levels"][0]["cpu_ms_per_req"] if b["levels"] else {})]
    head = ["conc", f"out tok/s {la}", f"out tok/s {lb}", "tok/s ratio", "req/s ratio",
            "TTFT p50 ratio"]
    head += [f"{n} CPU/req ratio" for n in names]
    rows = [f"### {la} / {lb}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def r(x: float, y: float) -> str:
        return "-" if not y or math.isnan(x) or math.isnan(y) else f"{x / y:.2f}x"

    for lv in a["levels"]:
        o = bl.get(lv["concurrency"])
        if o is None:
            continue
        cells = [str(lv["concurrency"]), f(lv["out_tok_s"], 0), f(o["out_tok_s"], 0),
                 r(lv["out_tok_s"], o["out_tok_s"]), r(lv["req_s"], o["req_s"]),
                 r(lv["ttft_p50_ms"], o["ttft_p50_ms"])]
        cells += [r(lv["cpu_ms_per_req"][n], o["cpu_ms_per_req"][n]) for n in names]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def summary_pairs(dirs: list[str]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, ours level, Dynamo level) for every level of every ours-rN / dynamo-rN pair."""
    pairs = []
    for d in dirs:
        for ours in sorted(Path(d).glob("ours-r*.json"), key=lambda p: int(p.stem[6:])):
            other = ours.with_name(ours.name.replace("ours-", "dynamo-"))
            if not other.is_file():
                continue
            a, b = json.loads(ours.read_text()), json.loads(other.read_text())
            for la, lb in zip(a["levels"], b["levels"], strict=False):
                pairs.append((f"{Path(d).name} {ours.stem[5:]}", la, lb))
    return pairs


def _total(lv: dict[str, Any]) -> float:
    cpu = lv["cpu_ms_per_req"]
    return float(cpu.get("frontend", math.nan) + cpu.get("worker", math.nan))


def summary(dirs: list[str]) -> str:
    """Per concurrency: a row per pair and the medians of the ratios (ours / Dynamo)."""
    pairs = summary_pairs(dirs)
    out = []
    for conc in sorted({la["concurrency"] for _, la, _ in pairs}):
        rows = [(n, a, b) for n, a, b in pairs if a["concurrency"] == conc]
        out += [f"### c={conc}", "",
                "| pair | out tok/s ours / Dynamo | tok/s ratio | TTFT p50 / p99 ms ours | "
                "TTFT p50 / p99 ms Dynamo | ITL p50 / p99 ms ours | ITL p50 / p99 ms Dynamo | "
                "frontend CPU ms/req ours / Dynamo | worker CPU ms/req ours / Dynamo | "
                "total CPU/req ratio | SSE events/req ours / Dynamo | frontend peak fds "
                "ours / Dynamo | frontend peak RSS MB ours / Dynamo | errors ours / Dynamo |",
                "|" + "---|" * 14]
        tok, cpu = [], []
        for name, a, b in rows:
            tok.append(a["out_tok_s"] / b["out_tok_s"] if b["out_tok_s"] else math.nan)
            cpu.append(_total(a) / _total(b))
            ca, cb = a["cpu_ms_per_req"], b["cpu_ms_per_req"]

            def ev(lv: dict[str, Any]) -> str:
                return f(lv["chunks_s"] / lv["req_s"], 0) if lv["req_s"] else "-"

            def peak(lv: dict[str, Any], key: str) -> str:
                return f(float(lv.get(key, {}).get("frontend", math.nan)), 0)

            out.append(
                f"| {name} | {f(a['out_tok_s'], 0)} / {f(b['out_tok_s'], 0)} | {tok[-1]:.2f}x | "
                f"{f(a['ttft_p50_ms'], 0)} / {f(a['ttft_p99_ms'], 0)} | "
                f"{f(b['ttft_p50_ms'], 0)} / {f(b['ttft_p99_ms'], 0)} | "
                f"{f(a['itl_p50_ms'], 2)} / {f(a.get('itl_p99_ms', math.nan), 2)} | "
                f"{f(b['itl_p50_ms'], 2)} / {f(b.get('itl_p99_ms', math.nan), 2)} | "
                f"{f(ca['frontend'], 2)} / {f(cb['frontend'], 2)} | "
                f"{f(ca['worker'], 2)} / {f(cb['worker'], 2)} | {cpu[-1]:.2f}x | "
                f"{ev(a)} / {ev(b)} | {peak(a, 'fds_max')} / {peak(b, 'fds_max')} | "
                f"{peak(a, 'rss_mb_max')} / {peak(b, 'rss_mb_max')} | "
                f"{a['errors']} / {b['errors']} |")
        out += ["", f"median of {len(rows)} pairs: {statistics.median(tok):.2f}x Dynamo's "
                f"output tok/s at {statistics.median(cpu):.2f}x its CPU per request (frontend + "
                "worker)", ""]
    return "\n".join(out)


def plot_summary(dirs: list[str], out: str) -> None:
    """The ratios per pair, one panel per concurrency: tok/s and total CPU per request."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; skipping the plot {out}", file=sys.stderr)
        return
    pairs = summary_pairs(dirs)
    levels = sorted({a["concurrency"] for _, a, _ in pairs})
    fig, axes = plt.subplots(1, len(levels), figsize=(5 * len(levels), 4), squeeze=False)
    for ax, conc in zip(axes[0], levels, strict=True):
        rows = [(a, b) for _, a, b in pairs if a["concurrency"] == conc]
        x = range(1, len(rows) + 1)
        ax.plot(x, [a["out_tok_s"] / b["out_tok_s"] for a, b in rows], "o-",
                label="output tok/s, ours / Dynamo")
        ax.plot(x, [_total(a) / _total(b) for a, b in rows], "s--",
                label="CPU per request (frontend + worker), ours / Dynamo")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"c={conc}")
        ax.set_xlabel("pair (Dynamo, then ours)")
        ax.set_ylim(0, max(2.0, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot saved to {out}", file=sys.stderr)


def plot(runs: list[tuple[str, dict[str, Any]]], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; skipping the plot {out} "
              "(pip install '.[bench]')", file=sys.stderr)
        return
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for label, data in runs:
        lv = data["levels"]
        x = [v["concurrency"] for v in lv]
        axes[0][0].plot(x, [v["out_tok_s"] for v in lv], "o-", label=label)
        axes[0][1].plot(x, [v["ttft_p50_ms"] for v in lv], "o-", label=f"{label} p50")
        axes[0][1].plot(x, [v["ttft_p99_ms"] for v in lv], "x--", label=f"{label} p99")
        axes[1][0].plot(x, [v["itl_p50_ms"] for v in lv], "o-", label=label)
        for n in lv[0]["cpu_ms_per_req"] if lv else ():
            axes[1][1].plot(x, [v["cpu_ms_per_req"][n] for v in lv], "o-", label=f"{label} {n}")
    for ax, title in zip(
        axes.flat, ["output tok/s", "TTFT ms", "ITL p50 ms", "CPU ms per request"], strict=True
    ):
        ax.set_title(title)
        ax.set_xlabel("concurrency")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot saved to {out}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model",
                   help="model name as served (a local dir also sizes prompts with its tokenizer)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--requests-per-level", type=int, default=200, help="at least the concurrency")
    p.add_argument("--max-seconds", type=float, default=60.0,
                   help="stop issuing after this per level")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--warmup", type=int, default=16,
                   help="requests before the first level, not counted")
    p.add_argument("--pause", type=float, default=0.5, help="seconds of rest between levels")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos/min_tokens")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--prompt-tokens", default="100-500", help="LO-HI tokens per prompt, uniform")
    p.add_argument("--tokenizer", help="model dir with tokenizer.json to size prompts exactly")
    p.add_argument("--tokens-per-word", type=float, default=2.0, help="estimate when no tokenizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pids", help="name=pid,... processes whose CPU is charged per request")
    p.add_argument("--label", help="title of the printed table")
    p.add_argument("--json", help="save results here")
    p.add_argument("--plot", help="save a PNG plot here (needs matplotlib)")
    p.add_argument("--no-uvloop", action="store_true")
    p.add_argument(
        "--quickack", action="store_true",
        help="set TCP_QUICKACK after every read (Linux): no delayed ACKs from this client, which "
        "otherwise stall a server that streams without TCP_NODELAY for up to 40 ms",
    )
    p.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"),
                   help="print A vs B ratios and exit")
    p.add_argument("--labels", default=None, help="names for --compare, e.g. ours,dynamo")
    p.add_argument("--summary", nargs="+", metavar="RESULTS_DIR",
                   help="print every ours/dynamo pair of bench_vs_dynamo.sh runs and exit")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args()

    if args.summary:
        print(summary(args.summary))
        if args.plot:
            plot_summary(args.summary, args.plot)
        return 0
    if args.compare:
        a, b = (json.loads(Path(x).read_text()) for x in args.compare)
        la, lb = (args.labels or f"{a.get('label') or 'A'},{b.get('label') or 'B'}").split(",")
        print(table(a["levels"], la), end="\n\n")
        print(table(b["levels"], lb), end="\n\n")
        print(compare(a, b, la, lb))
        if args.plot:
            plot([(la, a), (lb, b)], args.plot)
        return 0
    if not args.model:
        p.error("--model is required")
    if not args.no_uvloop:
        try:
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        except ImportError:
            pass
    bench = Bench(args)
    levels = asyncio.run(bench.run())
    data = {
        "label": args.label,
        "config": {k: v for k, v in vars(args).items() if k not in ("compare", "labels")},
        "client": {
            "msgspec": msgspec is not None, "uvloop": not args.no_uvloop, "pid": os.getpid()
        },
        "levels": [asdict(lv) for lv in levels],
    }
    print(table(data["levels"], args.label))
    for lv in levels:
        for e in lv.first_errors:
            print(f"  conc {lv.concurrency} error: {e}", file=sys.stderr)
        if lv.other_cores > 0.25:
            print(f"  {args.label or args.model} conc {lv.concurrency}: other processes kept "
                  f"{lv.other_cores:.2f} cores busy; numbers are noisy", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    if args.plot:
        plot([(args.label or args.model, data)], args.plot)
    return 0 if all(lv.ok for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
