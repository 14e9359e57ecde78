"""The KV transfer's Prometheus metrics (on the worker's registry, under its labels)::

    dynamo_component_kv_transfer_sent_bytes_total       counter    payload bytes served
    dynamo_component_kv_transfer_received_bytes_total   counter    payload bytes pulled
    dynamo_component_kv_transfer_held                   gauge      transfers offered, not released
    dynamo_component_kv_transfer_held_bytes             gauge      bytes those hold
    dynamo_component_kv_transfer_expired_total          counter    transfers dropped unpulled
    dynamo_component_kv_transfer_refused_total          counter    offers refused (max bytes)
    dynamo_component_kv_transfer_failed_total           counter    pulls that failed
    dynamo_component_kv_transfer_seconds                histogram  one pull, first to last batch
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["KvTransferMetrics"]

_P = "dynamo_component_kv_transfer_"
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class KvTransferMetrics:
    """The transfer's metrics. With no ``registry`` they get one of their own (tests).

    Args:
        registry: where to register (the worker's).
        labels: label names and their values (the worker's Dynamo labels).
    """

    def __init__(self, registry: CollectorRegistry | None = None,
                 labels: dict[str, str] | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        names, values = list((labels or {}).keys()), list((labels or {}).values())

        def make(kind: Any, name: str, doc: str, **kw: Any) -> Any:
            metric = kind(f"{_P}{name}", doc, names, registry=r, **kw)
            return metric.labels(*values) if names else metric

        self.sent_bytes = make(Counter, "sent_bytes", "KV payload bytes served")
        self.received_bytes = make(Counter, "received_bytes", "KV payload bytes pulled")
        self.held = make(Gauge, "held", "KV transfers offered and not yet released")
        self.held_bytes = make(Gauge, "held_bytes", "Bytes held for KV transfers")
        self.expired = make(Counter, "expired", "KV transfers dropped before their pull ended")
        self.refused = make(Counter, "refused", "KV transfer offers refused (max bytes)")
        self.failed = make(Counter, "failed", "KV transfer pulls that failed")
        self.seconds = make(Histogram, "seconds", "Duration of one KV pull", buckets=_BUCKETS)
