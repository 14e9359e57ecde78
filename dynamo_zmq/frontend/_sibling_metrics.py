"""One ``/metrics`` page for the children of ``--http-workers N`` (``_http_workers.py``).

A scrape of the shared port lands on any child, so each child's page holds every child's
series, each with an ``http_worker`` label (``"0"`` .. ``"N-1"``, the child's slot, kept by a
restarted child). Labels rather than sums keep every series true: a gauge (in-flight requests,
a router's predicted load) is one process's view; a counter stays monotonic per child, and
a restarted child's reset is one Prometheus ``rate()`` already handles; ``sum without
(http_worker)`` gives the frontend's totals.

Each child answers its own page (``FrontendMetrics.render``) on a Unix socket in the
supervisor's directory (connect, read to the end); the child a scrape reaches reads its
siblings' concurrently and merges the families. A sibling that does not answer within
``SIBLING_TIMEOUT`` (restarting) is left out of that page.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from ._http_workers import WorkerSlot

__all__ = ["LABEL", "SiblingMetrics", "merge_pages"]

log = logging.getLogger(__name__)

#: The label naming the child a series comes from.
LABEL = "http_worker"
#: Seconds a sibling has to send its page.
SIBLING_TIMEOUT = 2.0


class SiblingMetrics:
    """Serve this child's page to its siblings and build the group's page.

    Args:
        slot: this child's slot.
        render: this child's own page (Prometheus text).
    """

    def __init__(self, slot: WorkerSlot, render: Callable[[], bytes]) -> None:
        self._slot, self._render = slot, render
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        path = self._slot.metrics_socket(self._slot.index)
        path.unlink(missing_ok=True)  # left by this slot's previous process
        self._server = await asyncio.start_unix_server(self._answer, path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._slot.metrics_socket(self._slot.index).unlink(missing_ok=True)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(self._render())
            await writer.drain()
        except OSError:  # the asking sibling went away
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def page(self) -> bytes:
        """Every answering child's series, labelled by slot."""
        others = [i for i in range(self._slot.count) if i != self._slot.index]
        fetched = await asyncio.gather(*(self._fetch(i) for i in others))
        pages = {self._slot.index: self._render()}
        pages.update((i, body) for i, body in zip(others, fetched, strict=True) if body is not None)
        return merge_pages(pages)

    async def _fetch(self, index: int) -> bytes | None:
        try:
            async with asyncio.timeout(SIBLING_TIMEOUT):
                reader, writer = await asyncio.open_unix_connection(
                    self._slot.metrics_socket(index))
                try:
                    return await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as exc:
            log.debug("http worker %d sent no metrics: %s", index, exc)
            return None


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_pages(pages: dict[int, bytes]) -> bytes:
    """One Prometheus text page of ``pages`` (slot -> page), each sample labelled with its
    slot; families of the same name are joined (each appears once, as the format requires)."""
    merged: dict[str, Metric] = {}
    for index, page in sorted(pages.items()):
        for family in text_string_to_metric_families(page.decode()):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation,
                                                    family.type, family.unit)
            elif into.type != family.type:
                continue  # (the children run the same code: never seen)
            into.samples += [Sample(s.name, {**s.labels, LABEL: str(index)}, s.value,
                                    s.timestamp, s.exemplar) for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
