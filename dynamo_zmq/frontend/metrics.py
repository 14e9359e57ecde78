"""Frontend Prometheus metrics, with NVIDIA Dynamo's names, labelled by model."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..histogram import Histogram as TokenHistogram

__all__ = ["FrontendMetrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKENS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class FrontendMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "dynamo_frontend_requests", "Requests by model, endpoint, type and status",
            ["model", "endpoint", "request_type", "status"], registry=r,
        )
        self.inflight = Gauge(
            "dynamo_frontend_inflight_requests", "Requests in flight", ["model"], registry=r
        )
        self.ttft = TokenHistogram(
            "dynamo_frontend_time_to_first_token_seconds", "Time to first token", ["model"],
            buckets=_LATENCY, registry=r,
        )
        self.itl = TokenHistogram(
            "dynamo_frontend_inter_token_latency_seconds", "Inter-token latency", ["model"],
            buckets=_LATENCY, registry=r,
        )
        self.isl = Histogram(
            "dynamo_frontend_input_sequence_tokens", "Prompt tokens", ["model"],
            buckets=_TOKENS, registry=r,
        )
        self.osl = Histogram(
            "dynamo_frontend_output_sequence_tokens", "Generated tokens", ["model"],
            buckets=_TOKENS, registry=r,
        )
        self.duration = Histogram(
            "dynamo_frontend_request_duration_seconds", "Request duration", ["model"],
            buckets=_LATENCY, registry=r,
        )
        self.disconnected = Counter(
            "dynamo_frontend_disconnected_clients", "Clients that went away mid-request",
            ["model"], registry=r,
        )
        self.unauthorized = Counter(
            "dynamo_frontend_unauthorized_requests",
            "Requests refused with 401: no API key, or not an accepted one", registry=r,
        )
        self.migrations = Counter(
            "dynamo_frontend_migrations",
            "Requests moved to another worker mid-stream, by model and the error that lost the "
            "first (Disconnected, EngineShutdown, StreamIncomplete)",
            ["model", "reason"], registry=r,
        )

        self.rejected = Counter(
            "dynamo_frontend_rejected_requests",
            "Requests refused before reaching a worker (bad input, limits), by endpoint and "
            "HTTP status", ["endpoint", "status"], registry=r,
        )

        self._children: dict[str, tuple[Any, Any]] = {}

    def token_metrics(self, model: str) -> tuple[Any, Any]:
        """(ttft, itl) children for ``model``, resolved once: they are used per chunk."""
        found = self._children.get(model)
        if found is None:
            found = self._children[model] = (self.ttft.labels(model), self.itl.labels(model))
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
