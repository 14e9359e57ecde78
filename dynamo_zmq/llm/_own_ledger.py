"""``OwnHashLedger``: one data-parallel rank's own hashes, turned from vLLM-shaped KV events into
own-hash deltas (``OwnStored`` / ``OwnRemoved`` / ``AllBlocksCleared``, docs/wire.md
"Own-hash deltas").

A publisher that hashes at the edge (the mocker; the vLLM relay) feeds it the events it would
publish in the ``"stores"`` form (``BlockStored`` with ``own_hashes``) and publishes what comes
back instead. The ledger keeps engine hash -> own hash (a duplicate store of one engine hash is
counted and needs as many removals; several engine hashes may share an own hash), per own hash
the number of engine hashes holding it and its parent own hash, and per own hash how many held
own hashes name it as parent: with these ``holes`` (held own hashes whose parent is not held) is
exact after every event. A store without own hashes, or whose engine parent the ledger does not
hold, is not hashed exactly and is left out (its blocks are unknown here, so are their removals).
"""

from __future__ import annotations

from collections.abc import Iterable

from ._kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    OwnEvent,
    OwnRemoved,
    OwnStored,
)

__all__ = ["SNAPSHOT_OWN_HASHES", "OwnHashLedger"]

_MASK64 = (1 << 64) - 1
#: Most own hashes per ``OwnStored`` of a snapshot (about 150 KiB on the wire).
SNAPSHOT_OWN_HASHES = 16_384


class _OwnSet:
    """Held own hashes with reference counts, parents, held-children counts and ``holes``."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}
        self.parent: dict[int, int | None] = {}
        #: own hash -> how many held own hashes have it as parent (held or not itself).
        self.children: dict[int, int] = {}
        self.holes = 0

    def enter(self, own: int, parent: int | None) -> bool:
        """One more reference to ``own``; True when it is new (0 -> 1)."""
        refs = self.refs
        n = refs.get(own)
        if n is not None:
            refs[own] = n + 1
            return False
        self.holes -= self.children.get(own, 0)  # they had no held parent until now
        refs[own] = 1
        self.parent[own] = parent
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1
            if parent not in refs:
                self.holes += 1
        return True

    def leave(self, own: int) -> bool:
        """One reference less; True when it was the last (1 -> 0)."""
        refs = self.refs
        n = refs[own]
        if n > 1:
            refs[own] = n - 1
            return False
        parent = self.parent.pop(own)
        if parent is not None:
            if parent not in refs:
                self.holes -= 1
            left = self.children[parent] - 1
            if left:
                self.children[parent] = left
            else:
                del self.children[parent]
        del refs[own]
        self.holes += self.children.get(own, 0)  # now orphans
        return True

    def clear(self) -> None:
        self.refs.clear()
        self.parent.clear()
        self.children.clear()
        self.holes = 0


class OwnHashLedger:
    """One rank's own hashes: ``apply`` events in publishing order, publish what it returns."""

    def __init__(self) -> None:
        #: engine hash -> its own hash (the first store's), and the extra stores of it.
        self._own: dict[int, int] = {}
        self._dups: dict[int, int] = {}
        self._set = _OwnSet()

    def __len__(self) -> int:
        """Own hashes held."""
        return len(self._set.refs)

    @property
    def holes(self) -> int:
        """Held own hashes whose parent own hash is not held."""
        return self._set.holes

    def held(self) -> set[int]:
        """The own hashes held now."""
        return set(self._set.refs)

    def apply(self, events: Iterable[KvEvent]) -> list[OwnEvent]:
        """The deltas of ``events`` (consecutive stores or removals merged; nothing for events
        that change no own hash's presence)."""
        out: list[OwnEvent] = []
        for ev in events:
            if type(ev) is BlockStored:
                self._emit(out, OwnStored, self._store(ev))
            elif type(ev) is BlockRemoved:
                self._emit(out, OwnRemoved, self._remove(ev.block_hashes))
            elif type(ev) is AllBlocksCleared:
                self.clear()
                out.append(AllBlocksCleared())
        return out

    def _emit(self, out: list[OwnEvent], kind: type[OwnStored] | type[OwnRemoved],
              owns: list[int]) -> None:
        """Add ``owns`` to ``out`` as a ``kind`` event, merged into the last one if it is one."""
        if not owns:
            return
        last = out[-1] if out else None
        if type(last) is kind:
            last.own_hashes.extend(owns)
            last.holes = self._set.holes
        else:
            out.append(kind(owns, self._set.holes))

    def clear(self) -> None:
        """Forget everything (the rank holds nothing)."""
        self._own.clear()
        self._dups.clear()
        self._set.clear()

    def _store(self, ev: BlockStored) -> list[int]:
        owns = ev.own_hashes
        hashes = ev.block_hashes
        if owns is None or len(owns) != len(hashes):
            return []
        own_of = self._own
        if ev.parent_block_hash is None:
            parent: int | None = None
        else:
            parent = own_of.get(ev.parent_block_hash & _MASK64)
            if parent is None:
                return []  # not hashed exactly here: left out, as the contract says
        new: list[int] = []
        enter = self._set.enter
        for eh, oh in zip(hashes, owns, strict=True):
            eh &= _MASK64
            held = own_of.get(eh)
            if held is None:
                own_of[eh] = oh
                if enter(oh, parent):
                    new.append(oh)
            else:  # vLLM keeps a duplicate block and stores its hash again
                self._dups[eh] = self._dups.get(eh, 0) + 1
                oh = held
            parent = oh
        return new

    def _remove(self, hashes: list[int]) -> list[int]:
        gone: list[int] = []
        own_of, dups, leave = self._own, self._dups, self._set.leave
        for eh in hashes:
            eh &= _MASK64
            extra = dups.get(eh)
            if extra is not None:
                if extra > 1:
                    dups[eh] = extra - 1
                else:
                    del dups[eh]
                continue
            oh = own_of.pop(eh, None)
            if oh is not None and leave(oh):
                gone.append(oh)
        return gone

    def snapshot(self, per_event: int = SNAPSHOT_OWN_HASHES) -> list[OwnEvent]:
        """``OwnStored`` events of every held own hash, parents first, each with the ``holes``
        the events so far leave (the last: ``self.holes``); none when nothing is held."""
        parent = self._set.parent
        replay = _OwnSet()
        out: list[OwnEvent] = []
        chunk: list[int] = []
        for oh in _parents_first(parent):
            replay.enter(oh, parent[oh])
            chunk.append(oh)
            if len(chunk) >= per_event:
                out.append(OwnStored(chunk, replay.holes))
                chunk = []
        if chunk:
            out.append(OwnStored(chunk, replay.holes))
        return out


def _parents_first(parent: dict[int, int | None]) -> list[int]:
    """The keys of ``parent``, each after its parent when that is a key too."""
    order: list[int] = []
    done: set[int] = set()
    for start in parent:
        chain: list[int] = []
        seen: set[int] = set()
        h: int | None = start
        while h is not None and h not in done and h not in seen:  # a cycle is garbage
            chain.append(h)
            seen.add(h)
            h = parent[h]
            if h not in parent:
                break
        for x in reversed(chain):
            done.add(x)
            order.append(x)
    return order
