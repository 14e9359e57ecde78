"""The ``dynamo_router_replica_*`` metrics of router replica sync (``router/replica_sync.py``)."""

from __future__ import annotations

import weakref

from prometheus_client import Counter, Gauge

from .metrics import RouterMetrics

__all__ = ["ReplicaMetrics"]


class ReplicaMetrics:
    """The ``dynamo_router_replica_*`` series (one set per registry, ``for_router``)."""

    _by_router: weakref.WeakKeyDictionary[RouterMetrics, ReplicaMetrics] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, metrics: RouterMetrics) -> None:
        r, m = metrics.registry, ["model"]
        self.sent = Counter("dynamo_router_replica_events_sent",
                            "Routing events published to router replicas, by kind",
                            [*m, "kind"], registry=r)
        self.received = Counter("dynamo_router_replica_events_received",
                                "Routing events from router replicas applied, by kind",
                                [*m, "kind"], registry=r)
        self.errors = Counter("dynamo_router_replica_decode_errors",
                              "Messages from router replicas rejected as malformed", m,
                              registry=r)
        self.gaps = Counter("dynamo_router_replica_gaps",
                            "Events of a router replica missed (sequence gaps)", m, registry=r)
        self.expired = Counter("dynamo_router_replica_expired_requests",
                               "Replicas' requests dropped without their FREE, by reason "
                               "(peer_left, ttl, snapshot)", [*m, "reason"], registry=r)
        self.snapshots = Counter("dynamo_router_replica_snapshots",
                                 "Snapshots of a replica's in-flight requests asked for, by "
                                 "outcome (applied, failed)", [*m, "outcome"], registry=r)
        self.peers = Gauge("dynamo_router_replica_peers", "Router replicas followed", m,
                           registry=r)
        self.requests = Gauge("dynamo_router_replica_requests",
                              "Replicas' in-flight requests counted in this router's load", m,
                              registry=r)
        self.blocks = Gauge("dynamo_router_replica_active_blocks",
                            "Blocks of replicas' in-flight requests per worker and rank",
                            [*m, "worker", "dp_rank"], registry=r)

    @classmethod
    def for_router(cls, metrics: RouterMetrics) -> ReplicaMetrics:
        found = cls._by_router.get(metrics)
        if found is None:
            found = cls._by_router[metrics] = cls(metrics)
        return found
