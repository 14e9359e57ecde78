"""Simulated placements over many windows of a trace: does knowing the caches help placement?

    python scripts/sim_placements.py [--trace ../shared/traces/conversation_trace.jsonl]
        [--starts 1800:10800:1800] [--warmup 1200] [--requests 600] [--workers 4]
        [--blocks 2048,4096]

For each cache size, the mean hit rate over the windows of: the balanced greedy placement (an
ideal router that sees every KV event), the balanced approximate one (an ideal router that sees
none), each at balance 0.25 and 1 (``router.oracle.simulate``), and an eviction-aware greedy
that only an event-driven router could run: score = hit - lambda x (blocks the request would
push out of that LRU cache that some earlier request hit), or only those held nowhere else
(``uniq``). The last column counts the windows where each placement beat the approximate one at
the same balance. No processes: the caches are ``router.oracle``'s LRU model.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_router_trace import Prompts, load_trace  # noqa: E402

from router.oracle import _Cache, _next_uses, block_keys, simulate  # noqa: E402


def eviction_aware(reqs: Sequence[Sequence[int]], workers: int, capacity: int, value: str,
                   lam: float, balance: float, measure_from: int, window: int = 32,
                   slack: float = 1.5) -> float:
    """Greedy on the LRU caches, less ``lam`` per valuable block the request would evict."""
    caches = [_Cache(capacity, False) for _ in range(workers)]
    nexts = _next_uses(reqs)
    cap = math.ceil(slack * window / workers)
    recent: collections.deque[int] = collections.deque()
    counts = [0] * workers
    hit_before: collections.Counter[int] = collections.Counter()
    holders: collections.Counter[int] = collections.Counter()
    hits = blocks = 0
    for i, keys in enumerate(reqs):
        pinned = set(keys)

        def score(c: int, keys: Sequence[int] = keys, pinned: set[int] = pinned) -> tuple:
            cache = caches[c]
            h = cache.match(keys)
            evicted = max(0, len(keys) - h - (capacity - len(cache.lru)))
            damage = n = 0
            for k in cache.lru:  # oldest first: what LRU would push out
                if n >= evicted:
                    break
                if k in pinned:
                    continue
                n += 1
                damage += hit_before[k] > 0 and (value == "hit" or holders[k] == 1)
            return (h - lam * damage - balance * counts[c], -counts[c], -c)

        w = max((c for c in range(workers) if counts[c] < cap), key=score)
        h = caches[w].match(keys)
        if i >= measure_from:
            hits, blocks = hits + h, blocks + len(keys)
        for k in keys[:h]:
            hit_before[k] += 1
        before = set(caches[w].lru)
        caches[w].admit(keys, nexts[i])
        after = caches[w].lru
        for k in before - after.keys():
            holders[k] -= 1
        for k in keys:
            if k in after and k not in before:
                holders[k] += 1
        recent.append(w)
        counts[w] += 1
        if len(recent) > window - 1:
            counts[recent.popleft()] -= 1
    return hits / blocks if blocks else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(ROOT.parent / "shared/traces/conversation_trace.jsonl"))
    ap.add_argument("--starts", default="1800:10800:1800", help="first:last:step trace rows")
    ap.add_argument("--warmup", type=int, default=1200)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--blocks", default="2048,4096", help="cache sizes per worker")
    ap.add_argument("--tokens-per-block", type=int, default=64)
    args = ap.parse_args()
    first, last, step = (int(x) for x in args.starts.split(":"))
    windows = []
    for start in range(first, last + 1, step):
        warm = min(args.warmup, start)
        rows = load_trace(args.trace, start - warm, warm + args.requests)
        pm = Prompts(args.tokens_per_block, 3000)
        windows.append((block_keys([pm.build(r) for r in rows], args.tokens_per_block), warm))
    print(f"{Path(args.trace).name}: {len(windows)} windows of {args.requests} requests, "
          f"{args.warmup} warm-up rows, {args.workers} LRU caches\n")
    print("| blocks | balance | placement | mean hit rate | windows ahead of approx |")
    print("|---|---|---|---|---|")
    for blocks in (int(b) for b in args.blocks.split(",")):
        for balance in (0.25, 1.0):
            rates: dict[str, list[float]] = {}
            for reqs, warm in windows:
                for p in ("approx", "greedy"):
                    rates.setdefault(p, []).append(simulate(
                        reqs, args.workers, blocks, p, "lru", measure_from=warm,
                        balance=balance).rate)
                for value, lam in (("hit", 0.2), ("hit", 0.5), ("uniq", 0.5)):
                    rates.setdefault(f"evict-aware {value} {lam}", []).append(eviction_aware(
                        reqs, args.workers, blocks, value, lam, balance, warm))
            for name, rs in rates.items():
                ahead = sum(r > a for r, a in zip(rs, rates["approx"], strict=True))
                print(f"| {blocks} | {balance} | {name} | {100 * statistics.mean(rs):.2f}% | "
                      f"{ahead if name != 'approx' else '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
