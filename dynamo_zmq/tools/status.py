"""``python -m dynamo_zmq status``: list the instances discovery finds, as a table or JSON.

The tool only calls: it binds no request-plane socket and advertises nothing. It discovers peers
(mDNS browse, or the static list), then checks each itself, the way the runtime's liveness does:
it connects, asks for the description (DESCRIBE) and prints one row per (instance, namespace,
component). Discovery alone is not believed: an mDNS record outlives a crashed (SIGKILLed)
process until its TTL runs out, and a static list names addresses, not live processes. So:

- ``ready`` / ``draining``: the instance answered;
- ``gone``: nothing serves there any more (the connection was refused or dropped before any
  answer, or another instance now holds the address): a crashed worker shows so at once;
- ``unreachable``: no answer before the deadline (host down, filtered, or a hung process).

A row whose component serves a model also says which (``model``) and the worker's
disaggregation role (``role``: ``agg``, ``prefill`` or ``decode``), so a model's prefill and
decode pools are both visible; the table shows MODEL and ROLE columns when any row has a model.

    python -m dynamo_zmq status --namespace demo
    python -m dynamo_zmq status --discovery static --static-workers tcp://10.0.0.5:5555 --json
    python -m dynamo_zmq status --watch [--interval 1] [--frontend http://127.0.0.1:8000]

``--watch`` is a live view (``dynamo_zmq.tools.status_watch``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..discovery import DiscoveryConfig, add_discovery_args
from ..errors import DynamoError
from ..runtime import (
    DistributedRuntime,
    PeerPool,
    RuntimeConfig,
    add_auth_args,
    auth_from_args,
    check_number,
)
from ..transport import PeerConnection, PeerState
from ._status_rows import rows_of

__all__ = ["collect_rows", "format_age", "format_table", "main"]

#: Extra seconds an mDNS peer found near the end of the browse window gets to answer.
ANSWER_GRACE = 1.0
#: Columns of the table, in order: (header, row key).
COLUMNS = (
    ("NAMESPACE", "namespace"),
    ("COMPONENT", "component"),
    ("ENDPOINTS", "endpoints"),
    ("INSTANCE", "instance_id"),
    ("ADDRESS", "address"),
    ("AGE", "age_human"),
    ("STATE", "state"),
)
#: Columns added when any row serves a model.
MODEL_COLUMNS = (("MODEL", "model"), ("ROLE", "role"))


def format_age(seconds: float | None) -> str:
    """``12s``, ``3m``, ``2h``, ``5d`` (``-`` when unknown)."""
    if seconds is None:
        return "-"
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _settled(conn: PeerConnection) -> bool:
    """Whether the liveness check of ``conn`` is over: it answered, or nothing serves there."""
    return conn.description is not None or conn.state is PeerState.DOWN


async def _wait_for_peers(
    runtime: DistributedRuntime, pool: PeerPool, wait: float, static: bool
) -> list[PeerConnection]:
    """Browse for ``wait`` seconds (a static list: until every peer is settled), then give the
    peers found last up to ``ANSWER_GRACE`` more to answer or refuse; returns the snapshot."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        peers = list(pool.peers.values())
        remaining = deadline - loop.time()
        if remaining <= 0 or (static and peers and all(map(_settled, peers))):
            break
        await runtime.wait_peers_changed(min(remaining, 0.1))
    if not static:
        # mDNS may have found a peer just before the deadline: give it a moment to answer.
        grace_end = loop.time() + min(ANSWER_GRACE, wait)
        while not all(map(_settled, peers)) and loop.time() < grace_end:
            await runtime.wait_peers_changed(0.05)
            peers = list(pool.peers.values())
    return peers


async def collect_rows(
    discovery: DiscoveryConfig, namespace: str | None = None, wait: float = 2.0,
    auth: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Discover peers and check each; returns the rows, sorted.

    Args:
        discovery: how to find peers.
        namespace: only rows of this namespace (static peers that did not answer are always
            listed).
        wait: seconds to browse mDNS, or to wait for static peers to answer.
        auth: ``RuntimeConfig`` auth fields (``auth_from_args``); None: auth off.
    """
    runtime = DistributedRuntime(config=RuntimeConfig(discovery=discovery, **(auth or {})))
    try:
        pool = await runtime.peer_pool(namespace)
        peers = await _wait_for_peers(runtime, pool, wait, discovery.backends == ("static",))
        now = time.time()
        rows: list[dict[str, Any]] = []
        seen: set[tuple[Any, ...]] = set()
        for conn in sorted(peers, key=lambda c: c.address):
            for row in rows_of(conn, pool.hints.get(conn.address), namespace, now):
                # One instance reachable at two addresses is listed once.
                key = (row["instance_id"] or row["address"], row["namespace"], row["component"])
                if key not in seen:
                    seen.add(key)
                    rows.append(row)
    finally:
        await runtime.close()
    rows.sort(
        key=lambda r: (
            r["namespace"] or "~",
            r["component"] or "",
            r["instance_id"] or "",
            r["address"],
        )
    )
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as an aligned text table."""
    columns: tuple[tuple[str, str], ...] = COLUMNS
    if any(row.get("model") for row in rows):
        columns += MODEL_COLUMNS
    cells = [[header for header, _ in columns]]
    for row in rows:
        shown = {
            **row,
            "endpoints": ",".join(row["endpoints"]),
            "age_human": format_age(row["age"]),
        }
        cells.append(
            [str(shown.get(key)) if shown.get(key) not in (None, "") else "-"
             for _, key in columns]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_zmq status",
        description="List dynamo-zmq instances: namespace, component, endpoints, id, address, age.",
    )
    parser.add_argument("--namespace", default=None, help="only this namespace (default: all)")
    parser.add_argument(
        "--wait",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how long to browse / wait for answers (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    parser.add_argument(
        "--watch", action="store_true",
        help="a live view, redrawn in place until Ctrl-C: role, model, in-flight, KV usage, "
        "load, hit rate, last seen (with --json: one JSON object per frame)",
    )
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS",
        help="with --watch: seconds between frames (default %(default)s)",
    )
    parser.add_argument(
        "--frontend", action="append", default=[], metavar="URL",
        help="with --watch: a frontend's base URL (http://host:8000), for its row and the KV "
        "hit rate; repeatable",
    )
    add_discovery_args(parser)
    add_auth_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the status tool; returns the exit code (0, or 2 for bad arguments)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        check_number("--wait", args.wait)  # NaN would wait forever
        check_number("--interval", args.interval, positive=True)
    except DynamoError as exc:
        parser.error(exc.message)
    try:
        discovery = DiscoveryConfig.from_args(args)
        if args.watch:
            from .status_watch import watch

            asyncio.run(watch(discovery, args.namespace, args.interval, auth_from_args(args),
                              args.frontend, args.json))
            return 0
        rows = asyncio.run(
            collect_rows(discovery, args.namespace, args.wait, auth_from_args(args))
        )
    except DynamoError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        print(format_table(rows))
    else:
        where = f"namespace {args.namespace!r}" if args.namespace else "any namespace"
        print(f"no instances found in {where} ({args.discovery} discovery, {args.wait:g}s)")
    return 0

