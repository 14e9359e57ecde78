"""``Diagnostics``: loud warnings and metrics for the misconfigurations that quietly make KV
routing no better than load balancing.

* **Block size mismatch.** An instance advertising another KV block size than the router indexes
  with (``dynamo_router_mismatched_workers{reason="block_size"}``, one warning per instance), and
  KV events ignored because their block size differs, whatever the advert says
  (``dynamo_router_kv_block_size_mismatches``, a warning at most once per ``WARN_EVERY``).
* **Hash scheme mismatch.** In kv mode, an instance that hashes the blocks it publishes under
  another scheme than the router's (name, version, block size or root seed; ``KvHashScheme``):
  its hashes cannot be used, the router hashes its events' token ids instead, which costs the
  router CPU on every store, and a scheme that differs from the other workers' usually means
  mixed versions or settings (``dynamo_router_mismatched_workers{reason="hash_scheme"}``, one
  warning per instance).
* **Silent workers.** In kv mode, an instance that advertises no KV-event endpoint, or one that
  has published nothing ``SILENT_AFTER`` seconds after the router first sent it a request with a
  full prompt block (prefix caching off, events pointed elsewhere): the router knows nothing of
  its cache and routes it on load alone (``dynamo_router_silent_workers``, one warning per
  instance when it turns silent, one line when it speaks after all).
* **Flat scores.** Decisions among several candidates where none held any of the prompt: the
  KV overlap scored every worker the same, the choice was on load alone, arbitrary between
  idle workers (``dynamo_router_flat_decisions``). After ``FLAT_STREAK`` such decisions in a
  row, one line with the likely reason, at most once per ``WARN_EVERY``: a warning when the
  index is empty or workers are mismatched, info when the traffic just shares no prefixes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from dynamo_zmq.llm import ModelAdvert

from .approx import ApproxIndexer
from .hashing import KvHashScheme
from .indexer import KvIndexer
from .metrics import RouterMetrics
from .subscriber import KvEventSubscriber

__all__ = ["FLAT_STREAK", "SILENT_AFTER", "WARN_EVERY", "Diagnostics"]

log = logging.getLogger("router.diagnostics")

#: Seconds after the first request routed to a worker before it counts as silent.
SILENT_AFTER = 10.0
#: Flat decisions in a row before the flat-scores warning.
FLAT_STREAK = 32
#: Least seconds between two warnings of one kind (per router).
WARN_EVERY = 60.0


class Diagnostics:
    """The self-checks of one ``KvRouter`` (one model)."""

    def __init__(self, metrics: RouterMetrics, model: str, block_size: int,
                 expect_events: bool) -> None:
        self._metrics = metrics
        self._model = model
        self._block_size = block_size
        self._expect_events = expect_events
        self._mismatched: set[int] = set()
        self._hash_mismatched: set[int] = set()
        #: Instance -> when the router first sent it a request with a full prompt block.
        self._first_routed: dict[int, float] = {}
        self._silent: set[int] = set()
        self._ignored_events = 0
        self._flat_streak = 0
        self._last_warned: dict[str, float] = {}

    # -- block size ----------------------------------------------------------------------------

    def check_advert(self, iid: int, advert: ModelAdvert | None) -> None:
        """A newly followed instance: warn if its block size or hash scheme differs from the
        router's."""
        if advert is None:
            return
        self._check_scheme(iid, advert)
        if advert.kv_block_size in (0, self._block_size):
            return
        self._mismatched.add(iid)
        log.warning("instance %x uses KV block size %d but the router indexes with %d: its KV "
                    "events are ignored and its prefixes never match (start every worker of "
                    "model %r with one block size)", iid, advert.kv_block_size, self._block_size,
                    self._model)

    def _check_scheme(self, iid: int, advert: ModelAdvert) -> None:
        scheme = advert.engine.kv_hash_scheme
        if not self._expect_events or scheme is None or scheme.usable_by(self._block_size):
            return
        self._hash_mismatched.add(iid)
        ours = KvHashScheme.ours(self._block_size)
        log.warning("instance %x of model %r hashes its KV blocks as %s %d (block size %d, seed "
                    "%d), not the router's %s %d (block size %d, seed %d): the router hashes the "
                    "token ids of its events instead, at a CPU cost on every store (start every "
                    "worker with the router's scheme: same version, block size and seed)",
                    iid, self._model, scheme.name, scheme.version, scheme.block_size, scheme.seed,
                    ours.name, ours.version, ours.block_size, ours.seed)

    def check_index(self, indexer: KvIndexer | ApproxIndexer) -> None:
        """Count KV events the index ignored for their block size since the last call."""
        stats = getattr(indexer, "stats", None)
        ignored = getattr(stats, "block_size_mismatch", 0)
        new = ignored - self._ignored_events
        if new <= 0:
            return
        self._ignored_events = ignored
        self._metrics.block_size_mismatches.labels(self._model).inc(new)
        if self._may_warn("block_size_events"):
            log.warning("%d KV event(s) of model %r ignored: their block size is not the "
                        "router's %d (dynamo_router_kv_block_size_mismatches)", new, self._model,
                        self._block_size)

    # -- silent workers ------------------------------------------------------------------------

    def note_routed(self, worker_id: int) -> None:
        """A request with at least one full prompt block went to ``worker_id``."""
        if worker_id not in self._first_routed:
            self._first_routed[worker_id] = time.monotonic()

    def check_silent(
        self, instances: Iterable[tuple[int, ModelAdvert | None, KvEventSubscriber | None]]
    ) -> None:
        """Update the silent set from ``(iid, advert, subscriber)`` of every followed instance."""
        if not self._expect_events:
            return
        now = time.monotonic()
        silent: set[int] = set()
        for iid, advert, sub in instances:
            if advert is None or not advert.kv_events_endpoint:
                why = "advertises no KV-event endpoint"
            elif sub is None:
                why = "advertises a KV-event endpoint the router cannot connect to"
            elif sub.stats.received or sub.stats.applied:
                continue
            else:
                first = self._first_routed.get(iid)
                if first is None or now - first < SILENT_AFTER:
                    continue
                why = f"has published no KV event {now - first:.0f}s after it was sent a request"
            silent.add(iid)
            if iid not in self._silent:
                log.warning("instance %x of model %r %s: kv routing knows nothing of its cache "
                            "and routes it on load alone, like the approximate mode (enable "
                            "prefix caching and KV events on the engine)", iid, self._model, why)
        for iid in self._silent - silent:
            log.info("instance %x of model %r is no longer silent", iid, self._model)
        self._silent = silent
        self._metrics.silent_workers.labels(self._model).set(len(silent))

    def forget(self, iid: int) -> None:
        """An instance that left."""
        self._mismatched.discard(iid)
        self._hash_mismatched.discard(iid)
        self._first_routed.pop(iid, None)
        self._silent.discard(iid)

    def update_gauges(self) -> None:
        self._metrics.mismatched_workers.labels(self._model, "block_size").set(
            len(self._mismatched))
        self._metrics.mismatched_workers.labels(self._model, "hash_scheme").set(
            len(self._hash_mismatched))

    # -- flat scores ---------------------------------------------------------------------------

    def note_decision(self, flat: bool, indexer: KvIndexer | ApproxIndexer) -> None:
        """One routing decision; ``flat``: no candidate held any of the prompt."""
        if not flat:
            self._flat_streak = 0
            return
        self._metrics.flat_decisions.labels(self._model).inc()
        self._flat_streak += 1
        if self._flat_streak >= FLAT_STREAK and self._may_warn("flat"):
            reason, suspicious = self._flat_reason(indexer)
            level = logging.WARNING if suspicious else logging.INFO
            log.log(level, "the last %d routing decisions for model %r found none of the prompt "
                    "cached on any worker, so KV overlap scored every worker the same and routing "
                    "was on load alone: %s", self._flat_streak, self._model, reason)

    def _flat_reason(self, indexer: KvIndexer | ApproxIndexer) -> tuple[str, bool]:
        """Why, and whether it looks like a misconfiguration (a warning) or the traffic (info)."""
        if isinstance(indexer, ApproxIndexer):
            return "approximate mode, and no prompt repeated a prefix routed before", False
        if indexer.num_blocks() == 0:
            if self._silent:
                return (f"the index is empty: {len(self._silent)} worker(s) publish no KV "
                        "events (dynamo_router_silent_workers)", True)
            return "the index is empty: no KV events received from any worker", True
        if self._mismatched:
            return "no prompt matched a cached prefix; some workers use another block size", True
        return "no prompt matched a cached prefix (no shared prefixes in the traffic?)", False

    def _may_warn(self, kind: str) -> bool:
        now = time.monotonic()
        last = self._last_warned.get(kind)
        if last is not None and now - last < WARN_EVERY:
            return False
        self._last_warned[kind] = now
        return True
