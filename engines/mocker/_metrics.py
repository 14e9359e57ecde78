"""The mocker's own Prometheus metrics (served on the worker's ``/metrics``)::

    mocker_prefill_tokens_total            prompt tokens computed by prefill steps
    mocker_kv_handoffs_total               prompts whose KV a prefill worker offered
    mocker_remote_prefills_total           prompts whose KV a decode worker pulled (no prefill)
    mocker_remote_prefill_blocks_total     KV blocks those pulls brought
    mocker_remote_prefill_fallbacks_total  pulls that failed: prefilled locally instead
    mocker_kv_transfer_modeled_seconds_total  transfer time modeled from bytes and bandwidth
    mocker_lora_loads_total                LoRA adapters made resident (each a simulated load)
    mocker_lora_evictions_total            resident LoRA adapters evicted for another one
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ._disagg import DisaggStats

__all__ = ["MockerCollector"]


class MockerCollector(Collector):
    """Reads the counts at each scrape (nothing on the token path)."""

    def __init__(self, prefill_tokens: Callable[[], int], stats: DisaggStats,
                 lora: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        self._prefill_tokens = prefill_tokens
        self._stats = stats
        self._lora = lora

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = self._stats
        loads, evictions = self._lora()
        for name, doc, value in (
            ("prefill_tokens", "Prompt tokens computed by prefill steps", self._prefill_tokens()),
            ("kv_handoffs", "Prompts whose KV was offered for a transfer", s.handoffs),
            ("remote_prefills", "Prompts whose KV was pulled instead of prefilled",
             s.remote_prefills),
            ("remote_prefill_blocks", "KV blocks pulled", s.remote_blocks),
            ("remote_prefill_fallbacks", "KV pulls that failed (prefilled locally)",
             s.fallbacks),
            ("kv_transfer_modeled_seconds", "Modeled KV transfer time", s.modeled_seconds),
            ("lora_loads", "LoRA adapters made resident (simulated loads)", loads),
            ("lora_evictions", "Resident LoRA adapters evicted for another one", evictions),
        ):
            yield CounterMetricFamily(f"mocker_{name}", doc, value=value)
