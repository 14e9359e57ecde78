"""Starting vLLM when its KV-event ports (and our KV connector's port) may be taken.

vLLM binds the KV-event and replay ports in its engine core, after loading the model. A port
picked free (``free_port``) can be taken by another process meanwhile, and a port given on the
command line can still be held by a dead predecessor's engine core that is shutting down
(``_parent_watch`` ends it within seconds). So before each attempt ``start_llm`` waits (a
bounded time) for the ports to be free, and when vLLM fails while one of them is in use, it
tries again: with freshly picked ports where they were picked, with the same ones where they
were given; at most ``ATTEMPTS`` times. The KV relay's loopback ports for vLLM are picked too,
and picked again (``repick``) for another attempt.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from ._endpoints import KV_CONNECTOR_MODULE

__all__ = ["ATTEMPTS", "PORT_WAIT", "address_in_use", "kv_ports", "port_free", "start_llm"]

log = logging.getLogger("engines.vllm")

#: vLLM starts tried when its KV-event ports are in use.
ATTEMPTS = 3
#: Seconds an attempt waits for taken KV-event ports to become free before it starts anyway.
PORT_WAIT = 10.0


def port_free(port: int) -> bool:
    """Whether a wildcard TCP bind of ``port`` works now (as ZeroMQ binds: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def address_in_use(exc: BaseException, ports: tuple[int, ...]) -> bool:
    """Whether vLLM's start failed because a port was taken: ZeroMQ's EADDRINUSE somewhere in
    the exception's chain (vLLM in this process), or one of ``ports`` taken now (an engine-core
    process only reports that it failed)."""
    seen: BaseException | None = exc
    for _ in range(20):
        if seen is None:
            break
        if "Address already in use" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return any(not port_free(p) for p in ports)


def kv_ports(args: Any) -> tuple[int, ...]:
    """The TCP ports vLLM will bind for KV events with engine args ``args`` (the events
    endpoint when it is a wildcard one, the replay endpoint always, loopback included; each
    data-parallel rank's port is offset by its rank), and our KV connector's block server's."""
    cfg = getattr(args, "kv_events_config", None)
    if cfg is None or not cfg.enable_kv_cache_events:
        return ()
    ranks = int(getattr(args, "data_parallel_size", 1) or 1)
    ports: list[int] = []
    for endpoint in (cfg.endpoint if cfg.endpoint and "*" in cfg.endpoint else None,
                     cfg.replay_endpoint):
        if not endpoint or not endpoint.startswith("tcp://"):
            continue
        port = int(endpoint.rpartition(":")[2])
        if port:
            ports.extend(port + r for r in range(ranks))
    transfer = getattr(args, "kv_transfer_config", None)
    if transfer is not None and transfer.kv_connector_module_path == KV_CONNECTOR_MODULE:
        port = int((transfer.kv_connector_extra_config or {}).get("port") or 0)
        if port:  # our KV connector's block server (disaggregated prefill/decode)
            ports.append(port)
    return tuple(ports)


async def _wait_free(ports: tuple[int, ...], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    taken = [p for p in ports if not port_free(p)]
    if not taken:
        return
    log.warning("KV-event ports %s are in use (a previous worker's engine core shutting down?): "
                "waiting up to %gs", taken, timeout)
    while taken and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        taken = [p for p in taken if not port_free(p)]


async def start_llm(
    build: Callable[[], tuple[Any, tuple[int, ...]]],
    create: Callable[[Any], Any],
    attempts: int = ATTEMPTS,
    port_wait: float = PORT_WAIT,
    prepare: Callable[[], None] | None = None,
    repick: Callable[[], None] | None = None,
) -> Any:
    """``create(args)`` in a thread, with ``args, kv_ports = build()`` (``build`` picks free
    ports afresh each call where they were not given), after ``prepare()`` (in the loop: the KV
    relay binding its ports); tried again when either fails with a KV-event port in use, at most
    ``attempts`` times, after ``repick()`` (the relay's fresh loopback ports for vLLM). Raises
    the last failure."""
    for attempt in range(1, attempts + 1):
        if attempt > 1 and repick is not None:
            repick()
        args, ports = build()
        await _wait_free(ports, port_wait)
        try:
            if prepare is not None:
                prepare()
            return await asyncio.to_thread(create, args)
        except Exception as exc:
            if attempt == attempts or not ports or not address_in_use(exc, ports):
                raise
            gc.collect()  # a half-built vLLM in this process may still hold a bound socket
            log.warning("vLLM could not bind its KV-event ports %s (address in use): "
                        "starting it again (attempt %d of %d)", ports, attempt + 1, attempts)
    raise AssertionError("unreachable")  # pragma: no cover
