"""A vLLM stat logger that keeps the last scheduler numbers of each engine (data-parallel rank),
for ``VllmEngine.stats()`` and ``VllmEngine.load()``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RankStats", "make_stat_logger"]


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
