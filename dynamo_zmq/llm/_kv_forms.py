"""``EdgeKvState``: what a publisher that hashes at the edge (the mocker, the vLLM relay) has
published, per data-parallel rank, in its declared form (``KvHashScheme.form``), so it can
encode live batches and answer full dumps (``SNAPSHOT_SEQ``) in that form.

``"stores"``: live batches are the vLLM-shaped events as given (``BlockStored`` with
``own_hashes``); a dump is ``KvStateMirror.snapshot`` (``AllBlocksCleared`` then the held blocks,
parents first). ``"deltas"``: live batches are ``OwnHashLedger.apply``'s deltas (``OwnBatch``);
a dump is the ledger's ``snapshot`` (``OwnStored`` only, parents first, with their ``holes``).
"""

from __future__ import annotations

from ._block_hashing import FORM_DELTAS, FORM_STORES
from ._kv_events import KvEvent, OwnEvent, encode_batch, encode_own_batch
from ._kv_mirror import KvStateMirror
from ._own_ledger import OwnHashLedger

__all__ = ["KV_EVENT_FORMS", "EdgeKvState"]

#: The forms a publisher of ours can declare (``--kv-event-form``).
KV_EVENT_FORMS = (FORM_STORES, FORM_DELTAS)


class EdgeKvState:
    """Per rank: a ``KvStateMirror`` (stores form) or an ``OwnHashLedger`` (deltas form)."""

    def __init__(self, form: str = FORM_STORES) -> None:
        if form not in KV_EVENT_FORMS:
            raise ValueError(f"KV event form must be one of {KV_EVENT_FORMS}, got {form!r}")
        self.form = form
        self.mirror = KvStateMirror()
        self._ledgers: dict[int | None, OwnHashLedger] = {}

    @property
    def deltas(self) -> bool:
        return self.form == FORM_DELTAS

    def live(self, events: list[KvEvent], dp_rank: int | None, keep_empty: bool = False,
             ts: float | None = None) -> bytes | None:
        """The payload publishing ``events`` (edge-hashed, vLLM-shaped) of ``dp_rank``, after
        following them; None in deltas form when they change no own hash (unless
        ``keep_empty``: then an empty ``OwnBatch``, for a relay that keeps the engine's seqs)."""
        if not self.deltas:
            self.mirror.apply(events, dp_rank)
            return encode_batch(events, dp_rank, ts)
        ledger = self._ledgers.get(dp_rank)
        if ledger is None:
            ledger = self._ledgers[dp_rank] = OwnHashLedger()
        deltas = ledger.apply(events)
        if not deltas and not keep_empty:
            return None
        return encode_own_batch(deltas, dp_rank, ts)

    def empty(self, dp_rank: int | None) -> bytes:
        """A payload of no events in this form."""
        return encode_own_batch([], dp_rank) if self.deltas else encode_batch([], dp_rank)

    def snapshot(self) -> list[bytes]:
        """Payloads of a full dump: every rank seen, each rank's held blocks parents first."""
        if not self.deltas:
            return [encode_batch(events, rank) for rank, events in self.mirror.snapshot()]
        out: list[bytes] = []
        for rank, ledger in sorted(self._ledgers.items(), key=lambda kv: kv[0] or 0):
            events: list[OwnEvent] = list(ledger.snapshot())
            if not events:
                out.append(encode_own_batch([], rank))
            out.extend(encode_own_batch([ev], rank) for ev in events)
        return out
