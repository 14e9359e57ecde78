"""A vLLM stat logger that keeps the last scheduler numbers, for ``VllmEngine.stats()``."""

from __future__ import annotations

from typing import Any

__all__ = ["make_stat_logger"]


def make_stat_logger(sink: dict[str, float]) -> Any:
    """A vLLM ``StatLoggerFactory`` whose loggers write ``kv_usage``, ``num_running`` and
    ``num_waiting`` into ``sink`` at every engine step that reports scheduler stats."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _LastStats(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            sink["kv_usage"] = float(scheduler_stats.kv_cache_usage)
            sink["num_running"] = float(scheduler_stats.num_running_reqs)
            sink["num_waiting"] = float(scheduler_stats.num_waiting_reqs)

        def log_engine_initialized(self) -> None:
            pass

    return _LastStats
