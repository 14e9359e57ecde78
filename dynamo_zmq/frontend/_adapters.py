"""The frontend's table of LoRA adapters, learned from the workers' model adverts
(``ModelAdvert.lora_adapters``): which base model each adapter is of, its path, and which live
instances hold it.

An adapter is listed while a live instance advertises it. One whose holders all died is still
*known* (requests for it get 503: no live worker holds it); one that a live former holder no
longer advertises was unloaded and is forgotten (requests for it get 404, as for any unknown
model).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from ..llm import ServedModel

__all__ = ["Adapter", "AdapterTable"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter as the workers advertise it."""

    name: str
    #: The base model it is an adapter of (its workers' model name).
    base: str
    #: Its path on the workers (the first holder's, if they differ).
    path: str
    #: The live instances holding it now (empty: known, but none is live).
    holders: frozenset[int]
    #: When this frontend first saw it (``/v1/models``' ``created``).
    created: int


class AdapterTable:
    """Adapters by name, brought up to date from every refresh of the model table."""

    def __init__(self) -> None:
        self._by_name: dict[str, Adapter] = {}
        self._warned: set[tuple[str, str]] = set()

    def get(self, name: str) -> Adapter | None:
        return self._by_name.get(name)

    def live(self) -> list[Adapter]:
        """The adapters some live instance holds, by name."""
        return [a for _, a in sorted(self._by_name.items()) if a.holders]

    def update(self, served: Iterable[ServedModel]) -> None:
        """Take in what the live instances advertise now."""
        seen: dict[str, tuple[str, str, set[int]]] = {}
        live: set[int] = set()
        for s in served:
            live.add(s.instance_id)
            for name, path in s.advert.lora_adapters.items():
                base, _path, holders = seen.setdefault(name, (s.advert.name, path, set()))
                if base != s.advert.name:
                    self._warn_bases(name, base, s.advert.name)
                    continue
                holders.add(s.instance_id)
        now = int(time.time())
        table: dict[str, Adapter] = {}
        for name, old in self._by_name.items():
            if name not in seen and not old.holders & live:  # its holders died: still known
                table[name] = Adapter(name, old.base, old.path, frozenset(), old.created)
        for name, (base, path, holders) in seen.items():
            old = self._by_name.get(name)
            created = old.created if old is not None else now
            table[name] = Adapter(name, base, path, frozenset(holders), created)
        self._by_name = table

    def forget(self, name: str) -> None:
        """Drop ``name`` (unloaded where no live worker holds it)."""
        self._by_name.pop(name, None)

    def _warn_bases(self, name: str, base: str, other: str) -> None:
        if (name, other) not in self._warned:
            self._warned.add((name, other))
            log.warning("LoRA adapter %r is loaded for model %r and for model %r: requests for "
                        "it go to %r's workers only (name adapters uniquely)", name, base, other,
                        base)
