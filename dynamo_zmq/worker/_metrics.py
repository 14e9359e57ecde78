"""The worker's Prometheus metrics, under Dynamo's component names (served on the system port).

Dynamo's work-handler metrics, labelled ``dynamo_namespace``, ``dynamo_component``,
``dynamo_endpoint`` (and ``model``):

    dynamo_component_requests_total              counter    requests received
    dynamo_component_inflight_requests           gauge      requests being served
    dynamo_component_request_duration_seconds    histogram  request start to its last output
    dynamo_component_errors_total{error_type}    counter    failed requests, by error kind
    dynamo_component_cancellation_total          counter    requests the caller stopped or killed
    dynamo_component_kvstats_active_blocks       gauge      KV blocks held by running requests
    dynamo_component_kvstats_total_blocks        gauge      KV blocks in all
    dynamo_component_kvstats_gpu_cache_usage_percent  gauge  active / total (0.0-1.0)
    dynamo_component_uptime_seconds              gauge      seconds since the worker started
    dynamo_component_waiting_requests            gauge      requests the engine queued, not running
    dynamo_component_kv_transfer_*               KV transfer of a prefill or decode worker
        (``dynamo_zmq.kv_transfer.KvTransferMetrics``: bytes sent and received, transfers and
        bytes held, expired, refused and failed transfers, pull seconds)
    dynamo_component_malformed_input_total{kind}  counter   bad input from peers, by kind
        (``frame``: a request-plane frame refused as malformed; ``request``: a request refused
        as invalid, e.g. an undecodable payload; ``kv_replay_request``: a malformed KV replay
        request to the mocker); each kind is also logged at most once per 10 s

and this project's own, under the same prefix and labels: ``time_to_first_token_seconds``,
``inter_token_latency_seconds``, ``output_tokens_total`` and ``healthy`` (1 while the health
canary passes). An engine's own metrics (``LLMEngine.metrics_collector``, e.g. vLLM's ``vllm:*``)
are served beside them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ..histogram import Histogram as TokenHistogram
from ..transport import bad_input_totals

__all__ = ["METRIC_LABELS", "ModelMetrics", "WorkerMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_P = "dynamo_component_"
_LABELS = ("dynamo_namespace", "dynamo_component", "dynamo_endpoint", "model")
#: The label names of every worker metric (``WorkerMetrics.labels`` holds their values).
METRIC_LABELS = _LABELS


class WorkerMetrics:
    """The worker's counters, gauges and histograms, in their own registry.

    Args:
        model: the served model name (``model`` label).
        namespace, component, endpoint: where the worker serves (Dynamo's labels).
    """

    def __init__(
        self,
        model: str,
        namespace: str = "dynamo",
        component: str = "backend",
        endpoint: str = "generate",
    ) -> None:
        self.registry = r = CollectorRegistry()
        self.model = model
        self.labels = (namespace, component, endpoint, model)
        names = _LABELS
        self.requests = Counter(f"{_P}requests_total", "Requests received", names, registry=r)
        self.inflight = Gauge(
            f"{_P}inflight_requests", "Requests being served", names, registry=r
        )
        self.duration = Histogram(
            f"{_P}request_duration_seconds", "Time from a request's start to its last output",
            names, buckets=_DURATION_BUCKETS, registry=r,
        )
        self.errors = Counter(
            f"{_P}errors_total", "Requests failed, by error type", [*names, "error_type"],
            registry=r,
        )
        self.cancellations = Counter(
            f"{_P}cancellation_total", "Requests the caller stopped or killed", names, registry=r
        )
        self.ttft = TokenHistogram(
            f"{_P}time_to_first_token_seconds", "Time to first token", names,
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = TokenHistogram(
            f"{_P}inter_token_latency_seconds", "Time between chunks", names,
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.output_tokens = Counter(
            f"{_P}output_tokens_total", "Tokens generated", names, registry=r
        )
        gauge = _gauges(r, names, self.labels)
        self.kv_active = gauge("kvstats_active_blocks", "KV blocks held by running requests")
        self.kv_total = gauge("kvstats_total_blocks", "KV blocks in all")
        self.kv_usage = gauge(
            "kvstats_gpu_cache_usage_percent", "Active KV blocks / total (0.0-1.0)"
        )
        self.waiting = gauge(
            "waiting_requests", "Requests the engine has queued and not started (its num_waiting)"
        )
        self.healthy = gauge("healthy", "1 while the health canary passes")
        started = time.monotonic()
        gauge("uptime_seconds", "Seconds since the worker started").set_function(
            lambda: time.monotonic() - started
        )

        r.register(_MalformedInput(self.labels))

    def register_engine(self, collector: Any) -> None:
        """Serve an engine's own metrics (a prometheus_client collector) beside these."""
        self.registry.register(collector)

    def refresh(self, stats: dict[str, float]) -> None:
        """Copy the engine's live numbers (``LLMEngine.stats``) into the KV gauges."""
        active, total = stats.get("kv_active_blocks"), stats.get("kv_total_blocks")
        if (waiting := stats.get("num_waiting")) is not None:
            self.waiting.set(waiting)
        if active is not None:
            self.kv_active.set(active)
            if total:
                self.kv_total.set(total)
                self.kv_usage.set(active / total)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def for_model(self) -> ModelMetrics:
        """The children of the served endpoint, resolved once (``labels()`` costs microseconds
        per call)."""
        v = self.labels
        return ModelMetrics(
            requests=self.requests.labels(*v),
            inflight=self.inflight.labels(*v),
            duration=self.duration.labels(*v),
            cancellations=self.cancellations.labels(*v),
            ttft=self.ttft.labels(*v),
            itl=self.itl.labels(*v),
            output_tokens=self.output_tokens.labels(*v),
            engine_errors=self.errors.labels(*v, "EngineError"),
        )

    def error(self, kind: str) -> Any:
        """The error counter of one error kind."""
        return self.errors.labels(*self.labels, kind)


def _gauges(registry: CollectorRegistry, names: tuple[str, ...], values: tuple[str, ...]) -> Any:
    def make(name: str, doc: str) -> Any:
        return Gauge(f"{_P}{name}", doc, names, registry=registry).labels(*values)

    return make


@dataclass(frozen=True)
class ModelMetrics:
    requests: Any
    inflight: Any
    duration: Any
    cancellations: Any
    ttft: Any
    itl: Any
    output_tokens: Any
    engine_errors: Any


class _MalformedInput(Collector):
    """``dynamo_component_malformed_input_total{kind}``, read from the process's bad-input
    counts (``transport.bad_input_totals``) at each scrape."""

    def __init__(self, labels: tuple[str, ...]) -> None:
        self._labels = labels

    def collect(self) -> Any:
        family = CounterMetricFamily(
            f"{_P}malformed_input", "Bad input from peers (malformed frames, invalid requests)",
            labels=[*_LABELS, "kind"],
        )
        for kind, n in sorted(bad_input_totals().items()):
            family.add_metric([*self._labels, kind], n)
        yield family
