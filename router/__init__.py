"""KV-cache-aware routing: KV-event ingestion with gap replay (``KvEventSubscriber``), the index
of which (worker, data-parallel rank) holds which blocks (``KvIndexer``, or ``ApproxIndexer``
fed by routing decisions), load reports (``LoadSubscriber``), the cost-based ``Scheduler``, and
``KvRouter``, which routes one model's requests, sharing its decisions with the other replicas
of its router when asked (``ReplicaSync``). The frontend gets it as a router plugin
(``KvRouting``, modes ``kv`` and ``approx``); ``python -m router`` serves ``best_worker``."""

from .approx import ApproxIndexer as ApproxIndexer
from .indexer import KvIndexer as KvIndexer
from .kv_router import Decision as Decision
from .kv_router import KvRouter as KvRouter
from .kv_router import KvRouterConfig as KvRouterConfig
from .load import LoadSubscriber as LoadSubscriber
from .plugin import KvRouting as KvRouting
from .replica_sync import ReplicaSync as ReplicaSync
from .scheduler import LoadTracker as LoadTracker
from .scheduler import Scheduler as Scheduler
from .subscriber import KvEventSubscriber as KvEventSubscriber

__all__ = [
    "ApproxIndexer",
    "Decision",
    "KvEventSubscriber",
    "KvIndexer",
    "KvRouter",
    "KvRouterConfig",
    "KvRouting",
    "LoadSubscriber",
    "LoadTracker",
    "ReplicaSync",
    "Scheduler",
]
