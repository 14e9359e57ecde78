"""The worker's Prometheus metrics (served by its ``StatusServer``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ModelMetrics", "WorkerMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class WorkerMetrics:
    """The worker's counters, gauges and histograms, in their own registry."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model"]
        r = self.registry
        self.requests = Counter("dynamo_worker_requests", "Requests received", labels, registry=r)
        self.inflight = Gauge(
            "dynamo_worker_inflight_requests", "Requests in flight", labels, registry=r
        )
        self.errors = Counter(
            "dynamo_worker_errors", "Requests failed, by error kind", [*labels, "kind"], registry=r
        )
        self.cancellations = Counter(
            "dynamo_worker_cancellations", "Requests stopped or killed", labels, registry=r
        )
        self.ttft = Histogram(
            "dynamo_worker_time_to_first_token_seconds", "Time to first token", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "dynamo_worker_inter_token_latency_seconds", "Time between chunks", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.output_tokens = Counter(
            "dynamo_worker_output_tokens", "Tokens generated", labels, registry=r
        )
        self.kv_usage = Gauge(
            "dynamo_worker_kv_usage_ratio", "Active KV blocks / total", labels, registry=r
        )
        self.kv_active = Gauge(
            "dynamo_worker_kv_active_blocks", "Active KV blocks", labels, registry=r
        )
        self.healthy = Gauge(
            "dynamo_worker_healthy", "1 when the health canary passes", labels, registry=r
        )
        self.model = model

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def for_model(self) -> ModelMetrics:
        """The per-model children, resolved once (``labels()`` costs microseconds per call)."""
        m = self.model
        return ModelMetrics(
            requests=self.requests.labels(m),
            inflight=self.inflight.labels(m),
            cancellations=self.cancellations.labels(m),
            ttft=self.ttft.labels(m),
            itl=self.itl.labels(m),
            output_tokens=self.output_tokens.labels(m),
            engine_errors=self.errors.labels(m, "EngineError"),
        )


@dataclass(frozen=True)
class ModelMetrics:
    requests: Any
    inflight: Any
    cancellations: Any
    ttft: Any
    itl: Any
    output_tokens: Any
    engine_errors: Any
