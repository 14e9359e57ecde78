"""``python -m dynamo_zmq status --watch``: a live view of every discovered instance.

Each ``--interval`` seconds it redraws one row per live (instance, namespace, component): role,
model, state, in-flight and queued requests, KV usage, load (active / total KV blocks), the
model's KV hit rate and the age of its last load report. The numbers come from what the
processes already publish, so watching costs them nothing per token:

- liveness and the model and role from the runtime's own peer connections (DESCRIBE and pings):
  an instance whose connection is lost (a crashed worker) drops from the view;
- in-flight, queued and KV numbers from the worker's load reports (the PUB socket advertised as
  ``load_endpoint``, the one KV routers follow);
- the hit rate from the ``dynamo_router_*`` metrics of the frontends named with ``--frontend``
  (frontends advertise nothing, so they cannot be discovered); each also gets a row.

On a terminal a frame replaces the last one in place (ANSI cursor home and clear); otherwise the
frames are printed one after another, separated by a blank line. Ctrl-C or SIGTERM ends it (exit
0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import zmq
from prometheus_client.parser import text_string_to_metric_families

from ..discovery import DiscoveryConfig
from ..errors import DynamoError
from ..llm import LOAD_TOPIC, LoadReport, advert_of, decode_report
from ..resources import Resources, wait_event
from ..runtime import DistributedRuntime, RuntimeConfig
from ..transport import AsyncSocket, PeerConnection, PeerState, make_socket, peer_key
from ._status_rows import rows_of

__all__ = ["LoadFollower", "format_frame", "watch"]

#: Columns of the live view: (header, row key).
COLUMNS = (
    ("ROLE", "role"), ("MODEL", "model"), ("NAMESPACE", "namespace"), ("COMPONENT", "component"),
    ("INSTANCE", "instance_id"), ("ADDRESS", "address"), ("STATE", "state"),
    ("INFLIGHT", "inflight"), ("QUEUED", "queued"), ("KV", "kv_usage"), ("LOAD", "load"),
    ("HIT", "hit_rate"), ("SEEN", "seen"),
)
#: Seconds to wait for a frontend's /metrics.
SCRAPE_TIMEOUT = 2.0
_INFLIGHT, _MATCHED, _PROMPT = (
    "dynamo_frontend_inflight_requests", "dynamo_router_matched_blocks_total",
    "dynamo_router_prompt_blocks_total",
)
_SCRAPED = (_INFLIGHT, _MATCHED, _PROMPT)


@dataclass
class _Latest:
    report: LoadReport
    at: float  # time.monotonic() it was received


class LoadFollower:
    """Follows the load reports of the instances it is told about: one SUB socket each."""

    def __init__(self, owner: Resources) -> None:
        self._res = owner.child("load-follower")
        self._subs: dict[int, tuple[str, Resources]] = {}
        #: The last report of each followed instance.
        self.latest: dict[int, _Latest] = {}

    def follow(self, instance_id: int, endpoint: str) -> None:
        """Subscribe to ``endpoint`` for ``instance_id`` (nothing if already)."""
        if self._subs.get(instance_id, ("",))[0] == endpoint:
            return
        self._drop(instance_id)
        sock = make_socket(self._res.zctx, zmq.SUB, heartbeat_ms=0,
                           server_key=peer_key(instance_id))
        try:
            sock.setsockopt(zmq.SUBSCRIBE, LOAD_TOPIC)
            sock.connect(endpoint)
            asock = AsyncSocket(sock)
        except BaseException:
            sock.close(linger=0)
            raise
        res = self._res.child(f"load {instance_id:x}")
        res.on_close(asock.close)
        res.spawn(self._run(instance_id, asock), f"watch-load-{instance_id:x}")
        self._subs[instance_id] = (endpoint, res)

    def keep_only(self, instance_ids: set[int]) -> None:
        """Stop following every instance not in ``instance_ids``."""
        for iid in [i for i in self._subs if i not in instance_ids]:
            self._drop(iid)

    def _drop(self, instance_id: int) -> None:
        found = self._subs.pop(instance_id, None)
        self.latest.pop(instance_id, None)
        if found is not None:
            self._res.spawn(found[1].close(), f"watch-unload-{instance_id:x}")

    async def _run(self, instance_id: int, sock: AsyncSocket) -> None:
        while not sock.closed:
            frames = sock.recv_nowait()
            if frames is None:
                await sock.wait_readable()
                continue
            if len(frames) != 2 or frames[0] != LOAD_TOPIC:
                continue
            with contextlib.suppress(ValueError):  # a malformed report: wait for the next
                report = decode_report(frames[1])
                if report.instance_id == instance_id:
                    self.latest[instance_id] = _Latest(report, time.monotonic())


def _load_columns(latest: _Latest | None) -> dict[str, Any]:
    if latest is None:
        return {}
    ranks = latest.report.ranks
    running = sum(r.num_running for r in ranks)
    waiting = sum(r.num_waiting for r in ranks)
    active = sum(r.active_blocks for r in ranks)
    total = sum(r.total_blocks for r in ranks)
    return {
        "inflight": running + waiting,
        "queued": waiting,
        "kv_usage": f"{100 * active / total:.0f}%" if total else None,
        "load": f"{active}/{total}" if total else str(active),
    }


def _scrape(url: str) -> dict[str, dict[str, float]]:
    """A frontend's in-flight requests and KV router block counts, summed per model, from its
    /metrics: ``{series name: {model: value}}``."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=SCRAPE_TIMEOUT) as resp:
        page = resp.read().decode()
    sums: dict[str, dict[str, float]] = {name: {} for name in _SCRAPED}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name in sums:
                model = s.labels.get("model", "")
                sums[s.name][model] = sums[s.name].get(model, 0.0) + s.value
    return sums


def _hit_rates(matched: dict[str, float], prompt: dict[str, float]) -> dict[str, float]:
    return {m: matched.get(m, 0.0) / n for m, n in prompt.items() if n}


def _percent(rates: Sequence[float]) -> str | None:
    """One rate as ``62%``; None for none or several (a row of several models)."""
    return f"{100 * rates[0]:.0f}%" if len(rates) == 1 else None


class _Watcher:
    """Builds each frame's rows; keeps the load subscriptions between frames."""

    def __init__(self, runtime: DistributedRuntime, namespace: str | None,
                 frontends: Sequence[str]) -> None:
        self._runtime = runtime
        self._namespace = namespace
        self._frontends = list(frontends)
        self._loads = LoadFollower(runtime.resources)
        #: When each ``--frontend`` last answered (monotonic), by row key.
        self._seen: dict[tuple[str, str, str], float] = {}

    async def rows(self) -> list[dict[str, Any]]:
        """One frame's rows: the ``--frontend`` ones first, then every live instance's."""
        pool = await self._runtime.peer_pool(self._namespace)
        now, mono = time.time(), time.monotonic()
        seen: dict[tuple[str, str, str], float] = {}
        matched: dict[str, float] = {}
        prompt: dict[str, float] = {}
        rows = [await self._frontend_row(url, seen, matched, prompt, mono)
                for url in self._frontends]
        hits = _hit_rates(matched, prompt)  # every frontend's routing of the model together
        live: set[int] = set()
        workers: list[dict[str, Any]] = []
        for conn in sorted(pool.peers.values(), key=lambda c: c.address):
            if conn.description is None or conn.state is not PeerState.READY:
                continue  # liveness lost (or not yet described): not in the view
            live.add(conn.instance_id)
            self._follow(conn)
            latest = self._loads.latest.get(conn.instance_id)
            for row in rows_of(conn, None, self._namespace, now):
                if row["state"] not in ("ready", "draining"):
                    continue
                row.update(_load_columns(latest))
                row["role"] = row["role"] or row["component"] or "-"
                row["hit_rate"] = _percent(
                    [hits[m] for m in (row["model"] or "").split(",") if m in hits]
                )
                # The row itself is there only while the liveness pings are answered; this is
                # how fresh its numbers are.
                row["seen"] = f"{max(0.0, mono - latest.at):.1f}s" if latest else None
                workers.append(row)
        self._loads.keep_only(live)
        self._seen = seen
        workers.sort(key=lambda r: (r["namespace"] or "~", r["component"] or "",
                                    r["model"] or "", r["instance_id"] or ""))
        return rows + workers

    def _follow(self, conn: PeerConnection) -> None:
        desc = conn.description
        assert desc is not None
        for ep in desc.endpoints:
            advert = advert_of(conn, ep.path)
            if advert is not None and advert.load_endpoint:
                # e.g. a worker whose key is not authorized: its row, without numbers
                with contextlib.suppress(DynamoError, zmq.ZMQError):
                    self._loads.follow(conn.instance_id, advert.load_endpoint)
                return

    async def _frontend_row(
        self, url: str, seen: dict[tuple[str, str, str], float], matched: dict[str, float],
        prompt: dict[str, float], mono: float,
    ) -> dict[str, Any]:
        key = ("frontend", url, "")
        row: dict[str, Any] = {"role": "frontend", "address": url, "state": "ready"}
        try:
            got = await asyncio.to_thread(_scrape, url)
        except (OSError, ValueError):
            row["state"] = "unreachable"
        else:
            self._seen[key] = mono
            for name, into in ((_MATCHED, matched), (_PROMPT, prompt)):
                for model, value in got[name].items():
                    into[model] = into.get(model, 0.0) + value
            models = sorted(m for m in {*got[_INFLIGHT], *got[_PROMPT]} if m)
            row.update(model=",".join(models) or None,
                       inflight=int(sum(got[_INFLIGHT].values())),
                       hit_rate=_percent(list(_hit_rates(got[_MATCHED], got[_PROMPT]).values())))
        if (last := self._seen.get(key)) is not None:
            seen[key] = last
            row["seen"] = f"{mono - last:.1f}s"
        return row


def format_frame(rows: Sequence[dict[str, Any]], header: str) -> str:
    """One frame of the view: ``header``, then the rows as an aligned table."""
    cells = [[h for h, _ in COLUMNS]]
    for row in rows:
        cells.append([str(row[k]) if row.get(k) not in (None, "") else "-" for _, k in COLUMNS])
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    lines = [header] + [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in cells
    ]
    if not rows:
        lines.append("(no live instances)")
    return "\n".join(lines)


async def watch(
    discovery: DiscoveryConfig, namespace: str | None = None, interval: float = 1.0,
    auth: dict[str, Any] | None = None, frontends: Sequence[str] = (), as_json: bool = False,
    out: TextIO = sys.stdout,
) -> None:
    """Redraw the view every ``interval`` seconds until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runtime = DistributedRuntime(config=RuntimeConfig(discovery=discovery, **(auth or {})))
    tty = out.isatty() and not as_json
    try:
        watcher = _Watcher(runtime, namespace, frontends)
        if tty:
            out.write("\x1b[2J")
        while not stop.is_set():
            rows = await watcher.rows()
            if as_json:
                out.write(json.dumps({"time": time.time(), "rows": rows}) + "\n")
            else:
                where = f"namespace {namespace}" if namespace else "all namespaces"
                header = (f"dynamo-zmq status --watch: {where}, every {interval:g}s, "
                          f"{time.strftime('%H:%M:%S')} (Ctrl-C to quit)")
                frame = format_frame(rows, header)
                if tty:  # home, each line cleared to its end, the rest of the screen cleared
                    out.write("\x1b[H" + frame.replace("\n", "\x1b[K\n") + "\x1b[K\n\x1b[J")
                else:
                    out.write(frame + "\n\n")
            out.flush()
            await wait_event(stop, interval)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runtime.close()

