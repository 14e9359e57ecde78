"""``LiveRequests``: an engine's requests in flight by context id, the one registry behind
``LLMEngine.abort`` (a stop or kill that reaches the worker frees what the context started)."""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["LiveRequests"]

H = TypeVar("H")


class LiveRequests(Generic[H]):
    """Handles (an engine's own: a sequence, a request id) of the requests in flight, grouped
    by the ``Context`` id that started them. One context may start several (a fan-out)."""

    def __init__(self) -> None:
        self._by_context: dict[str, list[H]] = {}

    def add(self, context_id: str, handle: H) -> None:
        """``handle`` runs for ``context_id`` (call ``remove`` when it ends, in a finally)."""
        self._by_context.setdefault(context_id, []).append(handle)

    def remove(self, context_id: str, handle: H) -> None:
        """``handle`` ended; a handle not (or no longer) registered is ignored."""
        handles = self._by_context.get(context_id)
        if handles is None:
            return
        try:
            handles.remove(handle)
        except ValueError:
            return
        if not handles:
            del self._by_context[context_id]

    def of(self, context_id: str) -> list[H]:
        """The handles running for ``context_id`` (a copy: aborting may remove them)."""
        return list(self._by_context.get(context_id, ()))

    def all(self) -> list[H]:
        """Every handle in flight."""
        return [h for handles in self._by_context.values() for h in handles]

    def clear(self) -> None:
        self._by_context.clear()

    def __len__(self) -> int:
        return sum(len(handles) for handles in self._by_context.values())
