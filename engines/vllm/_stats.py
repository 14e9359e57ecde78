"""vLLM's numbers: a stat logger that keeps the last scheduler numbers of each engine
(data-parallel rank), for ``VllmEngine.stats()`` and ``VllmEngine.load()``, and vLLM's own
Prometheus metrics for the worker's ``/metrics``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["RankStats", "make_stat_logger", "vllm_metrics"]

#: Prefix of vLLM's metric names.
VLLM_PREFIX = "vllm:"


class _VllmMetrics:
    """A collector of the ``vllm:*`` families of prometheus_client's default registry, where
    vLLM's ``PrometheusStatLogger`` registers them (vLLM adds it to every ``AsyncLLM`` that
    logs stats). The process's other default metrics (``python_*``, ``process_*``) are left
    out."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client import REGISTRY

        for family in REGISTRY.collect():
            if family.name.startswith(VLLM_PREFIX):
                yield family

    def describe(self) -> list[Any]:
        return []  # names unknown until vLLM registers them; nothing to check at registration


def vllm_metrics() -> Any:
    """vLLM's own metrics, as a collector to register with the worker's registry."""
    return _VllmMetrics()


@dataclass(frozen=True)
class RankStats:
    """One engine's last ``SchedulerStats``."""

    #: Fraction of the KV cache held by running requests (vLLM's ``kv_cache_usage``).
    kv_usage: float
    num_running: int
    num_waiting: int


def make_stat_logger(sink: dict[int, RankStats]) -> Any:
    """A vLLM ``StatLoggerFactory``; its loggers write ``sink[engine index]`` at every engine
    step that reports scheduler stats. vLLM makes one logger per engine (data-parallel rank)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _LastStats(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int | None = None) -> None:
            if scheduler_stats is None:
                return
            index = self.engine_index if engine_idx is None else engine_idx
            sink[int(index)] = RankStats(
                float(scheduler_stats.kv_cache_usage),
                int(scheduler_stats.num_running_reqs),
                int(scheduler_stats.num_waiting_reqs),
            )

        def log_engine_initialized(self) -> None:
            pass

    return _LastStats
