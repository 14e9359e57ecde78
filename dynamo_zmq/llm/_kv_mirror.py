"""``KvStateMirror``: the blocks a publisher's own events say each data-parallel rank holds now,
so a router that subscribes late gets a full dump instead of a window of recent batches.

The mirror follows the published events (``BlockStored`` adds, ``BlockRemoved`` drops,
``AllBlocksCleared`` empties a rank), one entry per held block with its own slice of the tokens
(no reference to the storing event, which would keep all its blocks alive). ``snapshot`` turns
the state back into ``BlockStored`` events, parents before children, runs of a chain merged
into one event. A block stored with its router hash (``own_hashes``, hashed at the edge) keeps
it, so a dump is indexed from those hashes like the live events, its tokens unread.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ._kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

__all__ = ["SNAPSHOT_BLOCKS", "KvStateMirror"]

#: Most blocks per snapshot batch (a batch of 64-token blocks stays near 1 MiB on the wire).
SNAPSHOT_BLOCKS = 4096


class _Block(NamedTuple):
    parent: int | None
    tokens: tuple[int, ...]
    size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra: Any
    own: int | None


class KvStateMirror:
    """Per rank: engine hash -> the held block (its parent, tokens and event fields)."""

    def __init__(self) -> None:
        self._ranks: dict[int | None, dict[int, _Block]] = {}

    def apply(self, events: list[KvEvent], dp_rank: int | None) -> None:
        """Follow one published batch of ``dp_rank``."""
        blocks = self._ranks.get(dp_rank)
        if blocks is None:
            blocks = self._ranks[dp_rank] = {}
        for ev in events:
            if isinstance(ev, BlockStored):
                parent, size, extra = ev.parent_block_hash, ev.block_size, ev.extra_keys
                owns = ev.own_hashes
                if owns is not None and len(owns) != len(ev.block_hashes):
                    owns = None
                for i, h in enumerate(ev.block_hashes):
                    if h not in blocks:
                        blocks[h] = _Block(parent, tuple(ev.token_ids[i * size : (i + 1) * size]),
                                           size, ev.lora_id, ev.medium, ev.lora_name,
                                           None if extra is None else extra[i],
                                           None if owns is None else owns[i])
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    blocks.pop(h, None)
            elif isinstance(ev, AllBlocksCleared):
                blocks.clear()

    def num_blocks(self, dp_rank: int | None) -> int:
        return len(self._ranks.get(dp_rank, ()))

    def snapshot(self) -> list[tuple[int | None, list[KvEvent]]]:
        """``(dp_rank, events)`` batches storing every held block, each rank's parents first."""
        out: list[tuple[int | None, list[KvEvent]]] = []
        for rank, blocks in sorted(self._ranks.items(), key=_rank_order):
            events: list[KvEvent] = [AllBlocksCleared()]
            count = 0
            run: BlockStored | None = None
            last: int | None = None
            for h in _parents_first(blocks):
                b = blocks[h]
                extra = b.extra
                if count >= SNAPSHOT_BLOCKS:
                    out.append((rank, events))
                    events, count, run = [], 0, None
                if (run is not None and b.parent == last and run.block_size == b.size
                        and run.lora_id == b.lora_id and run.lora_name == b.lora_name
                        and run.medium == b.medium
                        and (run.extra_keys is None) == (extra is None)
                        and (run.own_hashes is None) == (b.own is None)):
                    run.block_hashes.append(h)
                    run.token_ids.extend(b.tokens)
                    if run.extra_keys is not None:
                        run.extra_keys.append(extra)
                    if run.own_hashes is not None and b.own is not None:
                        run.own_hashes.append(b.own)
                else:
                    run = BlockStored([h], b.parent, list(b.tokens), b.size, b.lora_id, b.medium,
                                      b.lora_name, None if extra is None else [extra],
                                      None if b.own is None else [b.own])
                    events.append(run)
                last = h
                count += 1
            out.append((rank, events))
        return out


def _rank_order(item: tuple[int | None, object]) -> int:
    return -1 if item[0] is None else item[0]


def _parents_first(blocks: dict[int, _Block]) -> list[int]:
    """The held hashes, each after its parent when the parent is held too (a parent evicted
    and stored again comes after its surviving children in insertion order)."""
    order: list[int] = []
    done: set[int] = set()
    for start in blocks:
        chain: list[int] = []
        seen: set[int] = set()
        h = start
        while h not in done and h not in seen:  # (a cycle of hashes is garbage, not a chain)
            chain.append(h)
            seen.add(h)
            parent = blocks[h].parent
            if parent is None or parent not in blocks:
                break
            h = parent
        for x in reversed(chain):
            done.add(x)
            order.append(x)
    return order
