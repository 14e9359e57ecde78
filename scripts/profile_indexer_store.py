"""Where a batched KV store's time goes: the indexer's 64-block store, taken apart.

    .venv/bin/python scripts/profile_indexer_store.py [--chains 1000] [--block-size 32] [--rounds 5]
        [--target-rate 1.85]

Builds chains of 256 blocks stored as 4 events of 64 blocks (as scripts/bench_indexer.py's
batched row), then times, each on a fresh index and best of ``--rounds``: the whole
``KvIndexer.apply_stored``, its pieces one by one (token decode from msgpack bytes, packing to
uint32, chained hashing, the two dict updates) and prints a table in µs per event.
The pieces are re-enacted here, so they show proportions; the whole store is the real code.

It also prints a floor for stores from bytes: only the C calls no Python store path can avoid
(msgspec decoding the token ids, hashing already-packed blocks, one ``dict.update`` per map),
with no checks, packing or bookkeeping, against the per-event budget of a target rate.
"""

from __future__ import annotations

import argparse
import array
import itertools
import operator
import random
import time
from collections.abc import Callable

import msgspec

from router.hashing import ROOT_SEED, block_hashes
from router.indexer import _CHILD, _HAS_PARENT, KvIndexer  # the packed-value flags, as stored

_or, _lshift = operator.or_, operator.lshift


def _events(chains: int, bs: int) -> list[tuple[list[int], int | None, list[int], list[int]]]:
    rng = random.Random(0)
    out = []
    for _ in range(chains):
        parent, seed = None, ROOT_SEED
        for _ in range(4):
            eh = [rng.getrandbits(64) for _ in range(64)]
            toks = [rng.randrange(150_000) for _ in range(64 * bs)]
            owns = block_hashes(toks, bs, seed)
            out.append((eh, parent, toks, owns))
            parent, seed = eh[-1], owns[-1]
    return out


def _best(fn: Callable[[], None], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", type=int, default=1000)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target-rate", type=float, default=1.85,
                    help="M blocks/s to compare the floor with (DESIGN.md's Dynamo figure)")
    args = ap.parse_args()
    bs = args.block_size
    events = _events(args.chains, bs)
    payloads = [msgspec.msgpack.encode(toks) for _, _, toks, _ in events]
    n = len(events)

    def whole() -> None:
        idx = KvIndexer(bs)
        for eh, parent, toks, _ in events:
            idx.apply_stored((0, 0), eh, parent, toks, bs)

    def decode() -> None:
        for p in payloads:
            msgspec.msgpack.decode(p)

    def pack() -> None:
        for _, _, toks, _ in events:
            array.array("I", toks).tobytes()

    def pack_hash() -> None:
        for _, _, toks, owns in events:
            block_hashes(toks, bs, owns[0])

    packed = [array.array("I", toks).tobytes() for _, _, toks, _ in events]

    def hash_only() -> None:
        for data, (_, _, _, owns) in zip(packed, events, strict=True):
            block_hashes(data, bs, owns[0])

    def masks_plain() -> None:
        m: dict[int, int] = {}
        for _, _, _, owns in events:
            m.update(zip(owns, itertools.repeat(1, 64), strict=False))

    def masks() -> None:
        m: dict[int, int] = {}
        for _, _, _, owns in events:
            if m.keys().isdisjoint(owns):
                m.update(zip(owns, itertools.repeat(1, 64), strict=False))

    def e2o_plain() -> None:
        d: dict[int, int] = {}
        for eh, _, _, owns in events:
            d.update(zip(eh, owns, strict=True))

    def e2o_packed() -> None:
        d: dict[int, int] = {}
        for eh, parent, _, owns in events:
            flags = [_HAS_PARENT | _CHILD] * 64
            flags[-1] = _HAS_PARENT
            parents = itertools.chain((parent or 0,), eh)
            d.keys().isdisjoint(eh)
            d.update(zip(eh, map(_or, map(_or, owns, map(_lshift, parents, itertools.repeat(64))),
                                 flags), strict=False))

    rows = [
        ("whole apply_stored (real code)", whole),
        ("decode 2,048 token ids from msgpack (from-bytes path only)", decode),
        ("pack token ids to uint32", pack),
        ("pack + chain 64 xxh3 hashes", pack_hash),
        ("bitmask dict: isdisjoint + update", masks),
        ("engine-hash dict, plain own hashes", e2o_plain),
        ("engine-hash dict, packed values + isdisjoint (as stored)", e2o_packed),
        ("chain 64 xxh3 hashes from packed bytes (no packing)", hash_only),
        ("bitmask dict: update alone", masks_plain),
    ]
    print(f"# 64-block stores, {n} events, block size {bs}, best of {args.rounds}\n")
    print("| piece | µs / event |\n|---|---|")
    per_event: dict[str, float] = {}
    for name, fn in rows:
        per_event[name] = us = _best(fn, args.rounds) / n * 1e6
        print(f"| {name} | {us:.1f} |")
    t = _best(whole, args.rounds)
    print(f"\nwhole store: {n * 64 / t / 1e6:.2f}M blocks/s")
    floor = sum(per_event[name] for name, fn in rows
                if fn in (decode, hash_only, masks_plain, e2o_plain))
    budget = 64 / args.target_rate
    print(f"floor from bytes (decode + hash + two bare dict updates): {floor:.1f} µs/event = "
          f"{64 / floor:.2f}M blocks/s; {args.target_rate:.2f}M blocks/s allows {budget:.1f} µs")


if __name__ == "__main__":
    main()
