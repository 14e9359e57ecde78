"""Prometheus metrics of the KV router, labelled by model.

One ``RouterMetrics`` per registry: pass the frontend's registry to have the router's series on
the frontend's ``/metrics``, or let it make its own (the standalone ``python -m router``). Every
router and subscriber of a process shares the one instance.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["RouterMetrics"]

_LATENCY = (0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.0025, 0.005,
            0.01, 0.025, 0.05, 0.1)
_LAG = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_WAIT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RATIO = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class RouterMetrics:
    """The router's counters, gauges and histograms.

    Args:
        registry: where to register them; a fresh ``CollectorRegistry`` when None.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        m = ["model"]
        self.decisions = Counter("dynamo_router_decisions", "Routing decisions", m, registry=r)
        self.decision_latency = Histogram(
            "dynamo_router_decision_seconds", "Time to pick a worker (match + cost)", m,
            buckets=_LATENCY, registry=r,
        )
        self.decision_cpu = Histogram(
            "dynamo_router_decision_cpu_seconds",
            "CPU time of picking a worker (this thread's; the wall time less the time spent "
            "waiting for a core)", m, buckets=_LATENCY, registry=r,
        )
        self.prompt_blocks = Counter(
            "dynamo_router_prompt_blocks", "Full prompt blocks of routed requests", m, registry=r
        )
        self.matched_blocks = Counter(
            "dynamo_router_matched_blocks", "Prompt blocks already cached on the chosen worker", m,
            registry=r,
        )
        self.hit_rate = Histogram(
            "dynamo_router_kv_hit_rate", "Matched / prompt blocks of each routed request", m,
            buckets=_RATIO, registry=r,
        )
        self.event_lag = Histogram(
            "dynamo_router_kv_event_lag_seconds", "Receive time minus the batch's timestamp", m,
            buckets=_LAG, registry=r,
        )
        self.event_batches = Counter(
            "dynamo_router_kv_event_batches", "KV-event batches applied", m, registry=r
        )
        self.edge_hashed_blocks = Counter(
            "dynamo_router_edge_hashed_blocks", "Blocks indexed with hashes their worker computed",
            m, registry=r,
        )
        self.event_bytes = Counter(
            "dynamo_router_kv_event_bytes", "Payload bytes of the KV-event batches applied", m,
            registry=r,
        )
        self.decode_errors = Counter(
            "dynamo_router_kv_event_decode_errors", "KV-event messages that could not be decoded",
            m, registry=r,
        )
        self.gaps = Counter(
            "dynamo_router_kv_event_gaps", "Sequence gaps detected in a worker's KV events", m,
            registry=r,
        )
        self.replays = Counter(
            "dynamo_router_kv_event_replays", "Replays asked for, by result (ok, failed)",
            [*m, "result"], registry=r,
        )
        self.state_drops = Counter(
            "dynamo_router_kv_state_drops", "Worker index states dropped (unrecoverable gap)", m,
            registry=r,
        )
        self.load_reports = Counter(
            "dynamo_router_load_reports", "Worker load reports applied", m, registry=r
        )
        self.load_report_bytes = Counter(
            "dynamo_router_load_report_bytes", "Bytes of the worker load messages received", m,
            registry=r,
        )
        self.load_decode_errors = Counter(
            "dynamo_router_load_decode_errors", "Worker load messages rejected as malformed", m,
            registry=r,
        )
        self.index_blocks = Gauge(
            "dynamo_router_kv_index_blocks", "Blocks indexed per worker and data-parallel rank",
            [*m, "worker", "dp_rank"], registry=r,
        )
        self.index_size = Gauge(
            "dynamo_router_kv_index_size_blocks",
            "Blocks in the KV index, all workers (at most --kv-index-max-blocks)", m, registry=r,
        )
        self.index_evicted = Counter(
            "dynamo_router_kv_index_evicted_blocks",
            "Blocks evicted from the KV index at its cap (--kv-index-max-blocks)", m, registry=r,
        )
        self.active_blocks = Gauge(
            "dynamo_router_predicted_active_blocks", "Predicted active blocks per worker and rank",
            [*m, "worker", "dp_rank"], registry=r,
        )
        self.reported_blocks = Gauge(
            "dynamo_router_reported_active_blocks",
            "Active blocks per worker and rank in the worker's last load report",
            [*m, "worker", "dp_rank"], registry=r,
        )
        self.busy_queued = Gauge(
            "dynamo_router_busy_queued_requests",
            "Requests waiting because every worker is busy", m, registry=r,
        )
        self.busy_rejected = Counter(
            "dynamo_router_busy_rejected",
            "Requests refused (503) because every worker stayed busy",
            m, registry=r,
        )
        self.busy_wait = Histogram(
            "dynamo_router_busy_wait_seconds", "Time a request waited for a non-busy worker", m,
            buckets=_WAIT, registry=r,
        )

        self.mismatched_workers = Gauge(
            "dynamo_router_mismatched_workers",
            "Followed workers whose advertised configuration differs from the router's, by reason",
            [*m, "reason"], registry=r,
        )
        self.block_size_mismatches = Counter(
            "dynamo_router_kv_block_size_mismatches",
            "KV events ignored because their block size is not the router's", m, registry=r,
        )
        self.silent_workers = Gauge(
            "dynamo_router_silent_workers",
            "Workers expected to publish KV events that publish none (routed on load alone)", m,
            registry=r,
        )
        self.flat_decisions = Counter(
            "dynamo_router_flat_decisions",
            "Routing decisions where no candidate held any of the prompt (chosen on load alone)",
            m, registry=r,
        )

    def decided(
        self, model: str, wall: float, cpu: float, prompt_blocks: int, matched_blocks: int
    ) -> None:
        """One routing decision: its wall and CPU seconds, the prompt's full blocks and those
        the chosen worker holds."""
        self.decision_latency.labels(model).observe(wall)
        self.decision_cpu.labels(model).observe(cpu)
        self.decisions.labels(model).inc()
        if prompt_blocks:
            self.prompt_blocks.labels(model).inc(prompt_blocks)
            self.matched_blocks.labels(model).inc(matched_blocks)
            self.hit_rate.labels(model).observe(matched_blocks / prompt_blocks)

    def forget_worker(self, model: str, worker: str, ranks: int) -> None:
        """Drop the per-worker series of a worker that left."""
        for gauge in (self.index_blocks, self.active_blocks, self.reported_blocks):
            for rank in range(ranks):
                try:
                    gauge.remove(model, worker, str(rank))
                except KeyError:
                    pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
