"""``LoraResidency``: which LoRA adapters the KV router predicts resident on each (worker, rank),
and the cost of sending an adapter's request where its adapter is not (``--kv-lora-miss-blocks``).

An engine keeps at most ``max_loras`` adapters resident per rank (vLLM's ``--max-loras``, the
mocker's); a request for another one loads it first and evicts the least recently used. The
router cannot see the engines' slots, so it predicts them from its own decisions (and its
replicas'): a rank's resident adapters are the last ``max_loras`` distinct adapters routed
there (an LRU, the engines' policy), ``max_loras`` read from the worker's advert
(``EngineConfig.extra["max_loras"]``; unknown: 1). A candidate where the request's adapter is
not predicted resident costs ``miss_blocks`` more, in blocks, as load does (the adapter load),
and half as much again when all its slots are taken (the load evicts an adapter, which its
next request will load back): a cost term, so a resident rank loaded ``miss_blocks`` above
another still loses to it. Base-model requests (no adapter) and a penalty of 0 change
nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from .scheduler import Candidate

__all__ = ["EVICT_FACTOR", "LoraResidency", "max_loras_of"]

#: A miss on a rank whose predicted slots are all taken costs this many ``miss_blocks``.
EVICT_FACTOR = 1.5


def max_loras_of(extra: object) -> int:
    """The adapters a worker keeps resident per rank, from its ``EngineConfig.extra``
    (``max_loras``); 1 when it does not say (or says nonsense)."""
    value = extra.get("max_loras") if isinstance(extra, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return 1


class LoraResidency:
    """Predicted resident adapters per (worker, rank), and their miss penalty.

    Args:
        miss_blocks: cost, in blocks, of a candidate where the adapter is not predicted
            resident (0: off; ``penalties`` returns None).
        capacity: ``max_loras`` of a worker id (its advert's).
    """

    def __init__(self, miss_blocks: float, capacity: Callable[[int], int]) -> None:
        if not miss_blocks >= 0:
            raise ValueError(f"miss_blocks must be >= 0, got {miss_blocks}")
        self.miss_blocks = miss_blocks
        self._capacity = capacity
        #: (worker, rank) -> its predicted resident adapters, least recently routed first.
        self._resident: dict[Candidate, OrderedDict[str, None]] = {}

    @property
    def enabled(self) -> bool:
        return self.miss_blocks > 0

    def resident(self, candidate: Candidate) -> list[str]:
        """The adapters predicted resident on ``candidate``, least recently routed first."""
        found = self._resident.get(candidate)
        return list(found) if found is not None else []

    def penalties(self, candidates: Sequence[Candidate], lora: str | None) -> list[float] | None:
        """Each candidate's added cost for a request under adapter ``lora``; None when nothing
        is added (off, or a base-model request)."""
        if lora is None or not self.enabled:
            return None
        miss, resident, cap = self.miss_blocks, self._resident, self._capacity
        out: list[float] = []
        for c in candidates:
            slots = resident.get(c)
            if slots is None:
                out.append(miss)
            elif lora in slots:
                out.append(0.0)
            else:
                out.append(miss * EVICT_FACTOR if len(slots) >= max(1, cap(c[0])) else miss)
        return out

    def routed(self, candidate: Candidate, lora: str | None) -> None:
        """A request under ``lora`` was sent to ``candidate``: it is resident there now, the
        most recently used, evicting the least recently used beyond the worker's capacity."""
        if lora is None or not self.enabled:
            return
        slots = self._resident.get(candidate)
        if slots is None:
            slots = self._resident[candidate] = OrderedDict()
        slots[lora] = None
        slots.move_to_end(lora)
        cap = max(1, self._capacity(candidate[0]))
        while len(slots) > cap:
            slots.popitem(last=False)

    def remove_worker(self, worker_id: int) -> None:
        """Forget every rank of ``worker_id`` (it left)."""
        for c in [c for c in self._resident if c[0] == worker_id]:
            del self._resident[c]
