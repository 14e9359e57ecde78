"""``KvRouterConfig``: the options of a ``KvRouter`` (``router/options.py`` builds them from
flags), and the index they configure."""

from __future__ import annotations

import dataclasses

from ._packed_indexer import PackedKvIndexer
from .approx import DEFAULT_TTL
from .indexer import KvIndexer
from .scheduler import REPORT_TTL

__all__ = ["DEFAULT_LORA_MISS_BLOCKS", "KvRouterConfig", "kv_indexer"]

#: ``--kv-lora-miss-blocks``'s default.
DEFAULT_LORA_MISS_BLOCKS = 32.0


@dataclasses.dataclass(frozen=True)
class KvRouterConfig:
    """Options of a ``KvRouter`` (Dynamo's flag names in brackets)."""

    #: Weight of blocks to prefill against decode load [--kv-overlap-score-weight].
    overlap_score_weight: float = 1.0
    #: Event-driven mode: the prompt blocks of requests in flight count as matched on the rank
    #: they went to, before its KV events arrive (router/_inflight.py) [--no-kv-inflight-overlap].
    inflight_overlap: bool = True
    #: Weight of a candidate's queued prefill (uncached prompt blocks routed to it and not yet
    #: prefilled) added to its load; 0: off, Dynamo's cost [--kv-prefill-load-weight].
    prefill_load_weight: float = 0.0
    #: Cost, in blocks, of a candidate where the request's LoRA adapter is not predicted
    #: resident (router/_lora_residency.py); 0: off [--kv-lora-miss-blocks].
    lora_miss_blocks: float = DEFAULT_LORA_MISS_BLOCKS
    #: 0: cheapest candidate; > 0: softmax sampling [--router-temperature].
    router_temperature: float = 0.0
    #: Index from the engines' KV events; False: from routing decisions [--no-kv-events].
    use_kv_events: bool = True
    #: Approximate mode: seconds a routed prefix counts as cached [--router-ttl].
    approx_ttl: float = DEFAULT_TTL
    #: Output tokens a request is expected to add to its worker's load (capped max_tokens).
    max_expected_output_tokens: int = 256
    #: Seconds a KV-event replay may take before the worker's state is dropped instead.
    replay_timeout: float = 3.0
    #: Seconds a worker's load report stays authoritative [--load-report-ttl].
    load_report_ttl: float = REPORT_TTL
    #: Requests routed less than this many seconds before a worker's load report stay counted
    #: on top of it (the engine may not have held them yet when it measured; a few of the
    #: workers' 0.1 s publish intervals) [--load-report-grace].
    load_report_grace: float = 0.3
    #: Cap on the KV index's (worker, block) entries; when full the oldest blocks are evicted.
    #: None: no cap but the index's safety bound, which refuses [--kv-index-max-blocks].
    index_max_blocks: int | None = None
    #: The index's storage: "packed" (uint64 tables: a third of the memory) or "dicts" (the
    #: fastest stores) [--kv-index-layout].
    index_layout: str = "packed"
    #: A rank is busy above this fraction of its KV blocks active (0: off) [--busy-kv-threshold].
    busy_kv_threshold: float = 0.95
    #: ... or above this many prompt tokens not yet prefilled (0: off) [--busy-prefill-tokens].
    busy_prefill_tokens: int = 0
    #: Requests that may wait while every rank is busy [--busy-queue-size].
    busy_queue_size: int = 1024
    #: Seconds one may wait before its 503 [--busy-queue-timeout].
    busy_queue_timeout: float = 30.0
    #: Share routing decisions with the other replicas of this router [--router-replica-sync].
    replica_sync: bool = False
    #: Seconds a replica's request counts at most without its end [--router-replica-ttl].
    replica_ttl: float = 600.0


def kv_indexer(block_size: int, max_blocks: int | None, layout: str = "packed") -> KvIndexer:
    """The event-driven index, capped with eviction of the oldest blocks when ``max_blocks``
    is set; ``layout`` "packed" stores it in packed uint64 tables (``PackedKvIndexer``)."""
    if layout not in ("dicts", "packed"):
        raise ValueError(f"unknown KV index layout {layout!r} (dicts or packed)")
    cls = PackedKvIndexer if layout == "packed" else KvIndexer
    if max_blocks is None:
        return cls(block_size)
    return cls(block_size, max_blocks, evict_oldest=True)
