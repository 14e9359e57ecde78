#!/usr/bin/env python3
"""Benchmark of the router's KV indexer (router/indexer.py), side by side with NVIDIA Dynamo's
RadixTree from Python when a venv with ``ai-dynamo-runtime`` is available.

    .venv/bin/python scripts/bench_indexer.py [--quick] [--dynamo-python PATH | --no-dynamo]
        [--workers 64] [--blocks-per-worker 100000] [--block-size 32] [--seed 0]

Prints a markdown table. Workloads (identical for both sides, generated here, handed to Dynamo's
process as arrays; Dynamo's stored events carry the same block hashes as ``tokens_hash``, so both
indexes answer the same questions and the answers are compared):

* stores, 1 block per event: chains of 100 blocks, each block its own event (parent = previous).
* stores, 64 blocks per event: chains of 256 blocks in 4 events.
  Ours is timed three times: ``apply_stored`` on decoded events (it hashes the tokens itself),
  ``decode_batch`` + ``apply_batch`` from vLLM msgpack payloads, and ``decode_edge_batch`` +
  ``apply_batch`` from the same payloads with ``own_hashes`` (hashed at the edge, as our workers
  publish them: the token ids are skipped, not decoded), and ``decode_own_batch`` +
  ``apply_batch`` from own-hash delta payloads (``OwnStored``: the own hashes alone, as a
  worker declaring ``kv_hash_scheme.form = "deltas"`` publishes them). Dynamo's ``apply_event``
  parses JSON whose blocks already carry their hashes (Dynamo hashes tokens in the publisher).
* find_matches, 2,000-block prompt, 8 workers: worker w holds the first 2000*(w+1)/8 blocks plus
  20k unrelated blocks; p50/p99 over repeated queries of the full prompt.
* big index: W workers x B blocks, tree-shaped: 64 shared roots (8-40 blocks), 1,024 prefixes on
  them (4-64 blocks, Zipf popularity), then a unique suffix (8-128 blocks) per request; a worker
  stores only what it does not hold yet, in events of <= 64 blocks. Queries: 200 sampled
  requests plus 4 uncached blocks.
* memory per (worker, block) entry: tracemalloc on the 8-worker index, RSS delta on the big one
  (built first, in a fresh process); Dynamo: RSS delta (it allocates in Rust) of a fresh process
  per index. With ``--delta-keys`` both of our indexes are built from own-hash delta payloads
  (decoded from bytes) instead of token events, so every key is a delta key.

Timings on a shared machine are noisy: the small measurements run in ``--rounds`` alternating
rounds (ours, then Dynamo's process) and each side keeps its best round (store rates: best of 3
runs per round; latencies: the round with the lowest p50).
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: Events per payload in the realistic edge-hashed batched measurement.
EDGE_EVENTS_PER_BATCH = 16
ENGINE_XOR = 0x9E3779B97F4A7C15  # engine hash = own hash ^ this (content-derived, like vLLM's)
VOCAB = 32_000


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# =============================================================================================
# Dynamo side (runs in Dynamo's venv: imports only numpy, msgspec and dynamo)
# =============================================================================================


def _dyn_events(w: dict[str, np.ndarray], prefix: str, lo: int = 0, hi: int | None = None,
                eh: list[int] | None = None, own: list[int] | None = None,
                ) -> list[tuple[int, bytes, int]]:
    """Dynamo's JSON stored events for events [lo, hi) of a workload."""
    import msgspec

    enc = msgspec.json.Encoder()
    eh = w[f"{prefix}_eh"].tolist() if eh is None else eh
    own = w[f"{prefix}_own"].tolist() if own is None else own
    cols = [w[f"{prefix}_{c}"][lo:hi].tolist() for c in ("worker", "parent", "has_parent",
                                                         "start", "len")]
    out = []
    for i, (wid, par, has, s, n) in enumerate(zip(*cols, strict=True)):
        blocks = [{"block_hash": eh[j], "tokens_hash": own[j]} for j in range(s, s + n)]
        ev = {"event_id": lo + i, "data": {"stored": {"parent_hash": par if has else None,
                                                      "blocks": blocks}}}
        out.append((wid, enc.encode(ev), n))
    return out


def _dyn_apply(tree: Any, events: list[tuple[int, bytes, int]]) -> float:
    apply = tree.apply_event
    t = time.perf_counter()
    for wid, b, _ in events:
        apply(wid, b)
    return time.perf_counter() - t


def _ragged(w: dict[str, np.ndarray], prefix: str) -> list[list[int]]:
    flat, offs = w[f"{prefix}_flat"].tolist(), w[f"{prefix}_offs"].tolist()
    return [flat[offs[i]:offs[i + 1]] for i in range(len(offs) - 1)]


def dynamo_side(npz: str, phase: str) -> None:
    """Dynamo's measurements; each phase runs in a fresh process so RSS deltas mean something."""
    import logging

    logging.disable(logging.CRITICAL)
    import msgspec
    from dynamo._core import RadixTree, compute_block_hash_for_seq

    w = dict(np.load(npz))
    res: dict[str, Any] = {}
    if phase == "big":  # built in slices to bound the JSON held at once
        eh, own = w.pop("big_eh").tolist(), w.pop("big_own").tolist()
        gc.collect()
        rss0 = _rss()
        tree = RadixTree()
        total_t, nblocks, nev = 0.0, 0, len(w["big_worker"])
        for lo in range(0, nev, 5_000):
            events = _dyn_events(w, "big", lo, lo + 5_000, eh, own)
            total_t += _dyn_apply(tree, events)
            nblocks += sum(n for _, _, n in events)
            del events
        res["big_rate"] = nblocks / total_t
        res["big_bytes_per_block"] = (_rss() - rss0) / nblocks
        lat, answers = [], []
        for qh in _ragged(w, "bigq"):
            t = time.perf_counter()
            r = tree.find_matches(qh)
            lat.append(time.perf_counter() - t)
            answers.append(sorted([[*k, v] for k, v in r.scores.items()]))
        res["big_lat"], res["big_answers"] = lat, answers
        print("RESULT " + json.dumps(res))
        return
    # 8 workers, 2,000-block prompt (first, for its RSS delta), then stores
    events = _dyn_events(w, "fm8")
    gc.collect()
    rss0 = _rss()
    tree = RadixTree()
    _dyn_apply(tree, events)
    res["fm8_bytes_per_block"] = (_rss() - rss0) / int(w["fm8_len"].sum())
    q = w["fm8_query"].tolist()
    reps = int(w["reps"][0])
    lat = []
    for _ in range(reps):
        t = time.perf_counter()
        tree.find_matches(q)
        lat.append(time.perf_counter() - t)
    res["fm8_lat"] = lat
    res["fm8_answer"] = sorted([[*k, v] for k, v in tree.find_matches(q).scores.items()])
    toks = w["fm8_tokens"].tolist()
    bs = int(w["block_size"][0])
    lat = []
    for _ in range(max(20, reps // 3)):
        t = time.perf_counter()
        compute_block_hash_for_seq(toks, bs)
        lat.append(time.perf_counter() - t)
    res["hash_lat"] = lat
    del tree, events
    enc = msgspec.json.Encoder()
    for name in ("single", "batched"):
        events = _dyn_events(w, name)
        nblocks = sum(n for _, _, n in events)
        best = min(_dyn_apply(RadixTree(), events) for _ in range(3))
        res[f"{name}_rate"] = nblocks / best
        # From Python objects, as a Python caller of the binding has them: JSON-encode each.
        dicts = [(wid, msgspec.json.decode(b)) for wid, b, _ in events]

        def from_dicts(tree: Any, dicts: list[tuple[int, Any]] = dicts) -> float:
            apply, encode = tree.apply_event, enc.encode
            t = time.perf_counter()
            for wid, ev in dicts:
                apply(wid, encode(ev))
            return time.perf_counter() - t

        res[f"{name}_obj_rate"] = nblocks / min(from_dicts(RadixTree()) for _ in range(3))
    print("RESULT " + json.dumps(res))


# =============================================================================================
# Workloads and our side
# =============================================================================================


class Events:
    """Stored events as arrays, for Dynamo's side. ``flush`` moves the Python lists into numpy
    chunks so they do not count in our RSS measurement."""

    _COLS = (("worker", np.int64), ("parent", np.uint64), ("has_parent", bool),
             ("start", np.int64), ("len", np.int64), ("eh", np.uint64), ("own", np.uint64))

    def __init__(self) -> None:
        self.cols: dict[str, list[Any]] = {c: [] for c, _ in self._COLS}
        self.chunks: dict[str, list[np.ndarray]] = {c: [] for c, _ in self._COLS}
        self.nblocks = 0

    def add(self, worker: int, parent: int | None, eh: list[int], own: list[int]) -> None:
        c = self.cols
        c["worker"].append(worker)
        c["parent"].append(parent or 0)
        c["has_parent"].append(parent is not None)
        c["start"].append(self.nblocks)
        c["len"].append(len(eh))
        c["eh"] += eh
        c["own"] += own
        self.nblocks += len(eh)

    def flush(self) -> None:
        for name, dtype in self._COLS:
            self.chunks[name].append(np.array(self.cols[name], dtype=dtype))
            self.cols[name] = []

    def nbytes(self) -> int:
        return sum(a.nbytes for chunks in self.chunks.values() for a in chunks)

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        self.flush()
        return {f"{prefix}_{name}": np.concatenate(self.chunks[name]).astype(dtype)
                for name, dtype in self._COLS}


OurEvent = tuple[tuple[int, int], list[int], "int | None", list[int]]


def chains(rng: np.random.Generator, n_blocks: int, chain: int, per_event: int, bs: int,
           worker: int = 0) -> tuple[list[OurEvent], Events]:
    """Independent chains of ``chain`` blocks, published ``per_event`` blocks at a time."""
    from router.hashing import block_hashes

    ours: list[OurEvent] = []
    arr = Events()
    for _ in range(n_blocks // chain):
        toks = rng.integers(0, VOCAB, size=chain * bs).tolist()
        own = block_hashes(toks, bs)
        eh = [h ^ ENGINE_XOR for h in own]
        for s in range(0, chain, per_event):
            parent = eh[s - 1] if s else None
            ours.append(((worker, 0), eh[s:s + per_event], parent,
                         toks[s * bs:(s + per_event) * bs]))
            arr.add(worker, parent, eh[s:s + per_event], own[s:s + per_event])
    return ours, arr


def apply_all(idx: Any, events: list[OurEvent], bs: int) -> float:
    apply = idx.apply_stored
    t = time.perf_counter()
    for key, eh, parent, toks in events:
        apply(key, eh, parent, toks, bs)
    idx.num_blocks()  # settles what a layout defers (the packed front), timed
    return time.perf_counter() - t


def bench_stores(rng: np.random.Generator, bs: int, n_single: int, n_batched: int,
                 res: dict[str, Any], dyn: dict[str, np.ndarray]) -> None:
    from dynamo_zmq.llm import OwnStored, encode_own_batch
    from router._own_events import decode_own_batch
    from router.events import BlockStored, decode_batch, decode_edge_batch, encode_batch
    from router.indexer import KvIndexer

    for name, n, chain, per_event in (("single", n_single, 100, 1),
                                      ("batched", n_batched, 256, 64)):
        events, arr = chains(rng, n, chain, per_event, bs)
        dyn.update(arr.arrays(name))
        nblocks = sum(len(e[1]) for e in events)
        res[f"{name}_apply_rate"] = nblocks / min(apply_all(KvIndexer(bs), events, bs)
                                                  for _ in range(3))
        payloads = [encode_batch([BlockStored(eh, p, t, bs)], 0, 1.0) for _, eh, p, t in events]

        def run(payloads: list[bytes] = payloads) -> float:
            idx = KvIndexer(bs)
            apply = idx.apply_batch
            t = time.perf_counter()
            for b in payloads:
                apply(0, decode_batch(b))
            idx.num_blocks()  # settles what a layout defers (the packed front), timed
            return time.perf_counter() - t

        res[f"{name}_decode_rate"] = nblocks / min(run() for _ in range(3))
        edge = [encode_batch([BlockStored(eh, p, t, bs, own_hashes=[h ^ ENGINE_XOR for h in eh])],
                             0, 1.0) for _, eh, p, t in events]

        def run_edge(payloads: list[bytes] = edge) -> float:
            idx = KvIndexer(bs)
            apply = idx.apply_batch
            t = time.perf_counter()
            for b in payloads:
                apply(0, decode_edge_batch(b)[0])
            idx.num_blocks()  # settles what a layout defers (the packed front), timed
            return time.perf_counter() - t

        res[f"{name}_edge_rate"] = nblocks / min(run_edge() for _ in range(3))
        if per_event > 1:
            # What a subscriber drains: EDGE_EVENTS_PER_BATCH events per payload.
            per = EDGE_EVENTS_PER_BATCH
            many = [encode_batch([BlockStored(eh, p, t, bs, own_hashes=[h ^ ENGINE_XOR
                                                                        for h in eh])
                                  for _, eh, p, t in events[i:i + per]], 0, 1.0)
                    for i in range(0, len(events), per)]
            res[f"{name}_edge_many_rate"] = nblocks / min(run_edge(many) for _ in range(3))
        deltas = [encode_own_batch([OwnStored([h ^ ENGINE_XOR for h in eh])], 0, 1.0)
                  for _, eh, _, _ in events]

        def run_deltas(payloads: list[bytes] = deltas) -> float:
            idx = KvIndexer(bs)
            apply = idx.apply_batch
            t = time.perf_counter()
            for b in payloads:
                apply(0, decode_own_batch(b)[0])
            idx.num_blocks()  # settles what a layout defers (the packed front), timed
            return time.perf_counter() - t

        res[f"{name}_delta_rate"] = nblocks / min(run_deltas() for _ in range(3))
        if per_event > 1:
            many = [encode_own_batch([OwnStored([h ^ ENGINE_XOR for h in eh])
                                      for _, eh, _, _ in events[i:i + per]], 0, 1.0)
                    for i in range(0, len(events), per)]
            res[f"{name}_delta_many_rate"] = nblocks / min(run_deltas(many) for _ in range(3))
        del events, payloads, edge, deltas


def apply_deltas(idx: Any, events: list[OurEvent]) -> float:
    """Our events as own-hash delta payloads (encoded untimed), decoded and applied (timed)."""
    from dynamo_zmq.llm import OwnStored, encode_own_batch
    from router._own_events import decode_own_batch

    payloads = [(key[0], encode_own_batch([OwnStored([h ^ ENGINE_XOR for h in eh])], key[1], 1.0))
                for key, eh, _, _ in events]
    apply = idx.apply_batch
    t = time.perf_counter()
    for wid, b in payloads:
        apply(wid, decode_own_batch(b)[0])
    idx.num_blocks()  # settles what a layout defers (the packed front), timed
    return time.perf_counter() - t


def bench_fm8(rng: np.random.Generator, bs: int, reps: int, res: dict[str, Any],
              dyn: dict[str, np.ndarray], delta_keys: bool = False) -> None:
    from router.hashing import block_hashes
    from router.indexer import KvIndexer

    prompt = rng.integers(0, VOCAB, size=2000 * bs).tolist()
    own = block_hashes(prompt, bs)
    eh = [h ^ ENGINE_XOR for h in own]
    arr = Events()
    ours: list[OurEvent] = []
    for w in range(8):
        n = 2000 * (w + 1) // 8
        for s in range(0, n, 64):
            e = min(n, s + 64)
            parent = eh[s - 1] if s else None
            ours.append(((w, 0), eh[s:e], parent, prompt[s * bs:e * bs]))
            arr.add(w, parent, eh[s:e], own[s:e])
        bg, bg_arr = chains(rng, 20_480, 64, 64, bs, worker=w)
        ours += bg
        c = bg_arr.cols
        for s_, n_ in zip(c["start"], c["len"], strict=True):
            arr.add(w, None, c["eh"][s_:s_ + n_], c["own"][s_:s_ + n_])
    dyn.update(arr.arrays("fm8"))
    dyn["fm8_query"] = np.array(own, dtype=np.uint64)
    dyn["fm8_tokens"] = np.array(prompt, dtype=np.int64)
    nblocks = sum(len(e[1]) for e in ours)

    # Memory: tracemalloc over a build whose engine-hash ints are created inside the trace.
    flat = [
        (k, np.array(e, dtype=np.uint64), p, np.array(t, dtype=np.int64)) for k, e, p, t in ours
    ]
    gc.collect()
    tracemalloc.start()
    idx = KvIndexer(bs)
    if delta_keys:
        from dynamo_zmq.llm import OwnBatch, OwnStored

        for key, e_arr, _, _ in flat:
            owns = (e_arr ^ np.uint64(ENGINE_XOR)).tolist()
            idx.apply_batch(key[0], OwnBatch(1.0, [OwnStored(owns)], key[1]))
    else:
        for key, e_arr, parent, t_arr in flat:
            idx.apply_stored(key, e_arr.tolist(), parent, t_arr.tolist(), bs)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    res["fm8_traced_bpb"] = traced / idx.num_blocks()
    res["fm8_computed_bpb"] = idx.bytes_per_block()
    del flat
    res["fm8_blocks"] = nblocks
    lat = []
    for _ in range(reps):
        t = time.perf_counter()
        idx.find_matches_for_hashes(own)
        lat.append(time.perf_counter() - t)
    res["fm8_lat"] = lat
    res["fm8_answer"] = sorted(
        [[k[0], k[1], v] for k, v in idx.find_matches_for_hashes(own).items()]
    )
    lat = []
    for _ in range(max(20, reps // 3)):
        t = time.perf_counter()
        idx.find_matches(prompt)
        lat.append(time.perf_counter() - t)
    res["fm8_tok_lat"] = lat
    lat = []
    for _ in range(max(20, reps // 3)):
        t = time.perf_counter()
        block_hashes(prompt, bs)
        lat.append(time.perf_counter() - t)
    res["hash_lat"] = lat
    packed = np.asarray(prompt, dtype="<u4")
    lat = []
    for _ in range(max(20, reps // 3)):
        t = time.perf_counter()
        block_hashes(packed, bs)
        lat.append(time.perf_counter() - t)
    res["hash_np_lat"] = lat


def bench_big(rng: np.random.Generator, bs: int, workers: int, per_worker: int,
              res: dict[str, Any], dyn: dict[str, np.ndarray], delta_keys: bool = False) -> None:
    from router.hashing import block_hashes
    from router.indexer import KvIndexer

    def chunked(key: tuple[int, int], eh: list[int], own: list[int], toks: list[int],
                parent: int | None, out: list[OurEvent], arr: Events) -> None:
        for s in range(0, len(eh), 64):
            p = eh[s - 1] if s else parent
            out.append((key, eh[s:s + 64], p, toks[s * bs:(s + 64) * bs]))
            arr.add(key[0], p, eh[s:s + 64], own[s:s + 64])

    roots = []
    for _ in range(64):
        toks = rng.integers(0, VOCAB, size=int(rng.integers(8, 41)) * bs).tolist()
        own = block_hashes(toks, bs)
        roots.append((toks, own, [h ^ ENGINE_XOR for h in own]))
    prefixes = []
    for _ in range(1024):
        r = int(rng.integers(0, 64))
        toks = rng.integers(0, VOCAB, size=int(rng.integers(4, 65)) * bs).tolist()
        own = block_hashes(toks, bs, roots[r][1][-1])
        prefixes.append((r, toks, own, [h ^ ENGINE_XOR for h in own]))
    popularity = 1.0 / np.arange(1, 1025) ** 1.1
    popularity /= popularity.sum()

    idx = KvIndexer(bs)
    arr = Events()
    q_hashes: list[np.ndarray] = []
    q_toks: list[np.ndarray] = []
    build_t = 0.0
    gc.collect()
    rss0 = _rss()
    for w in range(workers):
        key = (w, 0)
        held_r: set[int] = set()
        held_p: set[int] = set()
        count = 0
        events: list[OurEvent] = []
        while count < per_worker:
            p = int(rng.choice(1024, p=popularity))
            r, ptoks, pown, peh = prefixes[p]
            if r not in held_r:
                held_r.add(r)
                chunked(key, roots[r][2], roots[r][1], roots[r][0], None, events, arr)
                count += len(roots[r][1])
            if p not in held_p:
                held_p.add(p)
                chunked(key, peh, pown, ptoks, roots[r][2][-1], events, arr)
                count += len(pown)
            stoks = rng.integers(0, VOCAB, size=int(rng.integers(8, 129)) * bs).tolist()
            sown = block_hashes(stoks, bs, pown[-1])
            seh = [h ^ ENGINE_XOR for h in sown]
            chunked(key, seh, sown, stoks, peh[-1], events, arr)
            count += len(sown)
            if rng.random() < 200 / (workers * per_worker / 80):
                tail = rng.integers(0, VOCAB, size=4 * bs).tolist()
                full = roots[r][0] + ptoks + stoks + tail
                q_hashes.append(np.array(block_hashes(full, bs), dtype=np.uint64))
                q_toks.append(np.array(full, dtype=np.uint32))
        build_t += apply_deltas(idx, events) if delta_keys else apply_all(idx, events, bs)
        del events
        arr.flush()
    gc.collect()
    held = arr.nbytes() + sum(a.nbytes + 112 for a in q_hashes + q_toks)
    res["big_rss_bpb"] = (_rss() - rss0 - held) / idx.num_blocks()
    queries = [a.tolist() for a in q_hashes[:200]]
    q_tokens = [a.tolist() for a in q_toks[:200]]
    res["big_computed_bpb"] = idx.bytes_per_block()
    res["big_blocks"] = idx.num_blocks()
    res["big_unique"] = idx.num_unique_blocks()
    res["big_rate"] = idx.num_blocks() / build_t
    lat, answers = [], []
    for qh in queries:
        t = time.perf_counter()
        a = idx.find_matches_for_hashes(qh)
        lat.append(time.perf_counter() - t)
        answers.append(sorted([[k[0], k[1], v] for k, v in a.items()]))
    res["big_lat"], res["big_answers"] = lat, answers
    res["big_qlen"] = statistics.median(len(q) for q in queries) if queries else 0
    lat = []
    for toks in q_tokens:
        t = time.perf_counter()
        idx.find_matches(toks)
        lat.append(time.perf_counter() - t)
    res["big_tok_lat"] = lat
    dyn.update(arr.arrays("big"))
    offs = np.cumsum([0] + [len(q) for q in queries])
    dyn["bigq_flat"] = np.array([h for q in queries for h in q], dtype=np.uint64)
    dyn["bigq_offs"] = offs.astype(np.int64)


def find_dynamo_python(given: str | None) -> str | None:
    candidates = (
        [given] if given else sorted(glob.glob(str(ROOT / ".bench" / "*" / "bin" / "python")))
    )
    for py in candidates:
        if not py or not os.path.exists(py):
            continue
        try:
            ok = subprocess.run([py, "-c", "from dynamo._core import RadixTree"], timeout=120,
                                capture_output=True).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return py
    return None


def ours_big_deltas(npz: str) -> None:
    """Our big index from own-hash delta payloads, built alone in this fresh process (as
    Dynamo's is): its RSS delta holds no workload generation. Payloads are encoded 5,000 events
    at a time, then decoded and applied, so the index's ints fill the encoder's freed ones."""
    from dynamo_zmq.llm import OwnStored, encode_own_batch
    from router._own_events import decode_own_batch
    from router.indexer import KvIndexer

    w = dict(np.load(npz))
    own = w.pop("big_own")
    gc.collect()
    rss0 = _rss()
    idx = KvIndexer(int(w["block_size"][0]))
    cols = [w[f"big_{c}"] for c in ("worker", "start", "len")]
    for lo in range(0, len(cols[0]), 5_000):
        payloads = [(wid, encode_own_batch([OwnStored(own[s:s + n].tolist())], 0, 1.0))
                    for wid, s, n in zip(*(c[lo:lo + 5_000].tolist() for c in cols),
                                         strict=True)]
        for wid, b in payloads:
            idx.apply_batch(wid, decode_own_batch(b)[0])
        del payloads
    gc.collect()
    res = {"big_fresh_rss_bpb": (_rss() - rss0) / idx.num_blocks(),
           "big_fresh_computed_bpb": idx.bytes_per_block()}
    print("RESULT " + json.dumps(res))


def _dynamo_phase(py: str, path: str, phase: str, timeout: float,
                  extra: tuple[str, ...] = ()) -> dict[str, Any] | str:
    side = "--ours-side" if phase == "ours" else "--dynamo-side"
    try:
        proc = subprocess.run([py, __file__, side, path, "--phase", phase, *extra],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return f"failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}"
    out: dict[str, Any] = json.loads(lines[-1][7:])
    return out


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    """Keep each measurement's best round: highest rate, lowest median latency."""
    for k, v in new.items():
        if k not in into:
            into[k] = v
        elif k.endswith("_rate"):
            into[k] = max(into[k], v)
        elif k.endswith("_lat") and _pct(v, 0.5) < _pct(into[k], 0.5):
            into[k] = v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dynamo-python", help="python of a venv with ai-dynamo-runtime "
                    "(default: first .bench/*/bin/python that imports dynamo._core)")
    ap.add_argument("--no-dynamo", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks-per-worker", type=int, default=100_000)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds (ours, Dynamo) of the small measurements; best kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dynamo-timeout", type=float, default=900)
    ap.add_argument("--packed", action="store_true",
                    help="time router._packed_indexer.PackedKvIndexer (packed integer tables) "
                    "in place of KvIndexer")
    ap.add_argument("--delta-keys", action="store_true",
                    help="build the 8-worker and big indexes from own-hash delta payloads "
                    "(every key a delta key) instead of token events")
    ap.add_argument("--dynamo-side", help=argparse.SUPPRESS)
    ap.add_argument("--ours-side", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="small", help=argparse.SUPPRESS)
    ap.add_argument("--plot", help="save a bar chart of the store rates and lookup times here "
                    "(needs matplotlib)")
    args = ap.parse_args()
    if args.dynamo_side:
        dynamo_side(args.dynamo_side, args.phase)
        return
    sys.path.insert(0, str(ROOT))
    if args.packed:  # every measurement below imports router.indexer.KvIndexer when it runs
        import router.indexer
        from router._packed_indexer import PackedKvIndexer
        router.indexer.KvIndexer = PackedKvIndexer  # type: ignore[misc]
    if args.ours_side:
        ours_big_deltas(args.ours_side)
        return
    bs = args.block_size
    if args.quick:
        args.workers, args.blocks_per_worker = (
            min(args.workers, 8), min(args.blocks_per_worker, 10_000)
        )
    n_single, n_batched, reps = (20_000, 64_000, 200) if args.quick else (100_000, 256_000, 500)
    py = None if args.no_dynamo else find_dynamo_python(args.dynamo_python)
    res: dict[str, Any] = {}
    dres: dict[str, Any] = {}
    d: dict[str, Any] | str = dres
    if args.no_dynamo:
        d = "skipped (--no-dynamo)"
    elif py is None:
        d = "not available (no venv with ai-dynamo-runtime; see --dynamo-python)"
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        # The big indexes first, each in a fresh process: their RSS deltas mean something.
        dyn: dict[str, np.ndarray] = {"block_size": np.array([bs]), "reps": np.array([reps])}
        bench_big(np.random.default_rng(args.seed), bs, args.workers, args.blocks_per_worker,
                  res, dyn, args.delta_keys)
        gc.collect()
        path = os.path.join(tmp, "big.npz")
        if args.delta_keys:  # the same index again, built alone in a fresh process
            np.savez(path, **dyn)
            got = _dynamo_phase(sys.executable, path, "ours", args.dynamo_timeout,
                                ("--packed",) if args.packed else ())
            if isinstance(got, dict):
                res.update(got)
        if py is not None and isinstance(d, dict):
            np.savez(path, **dyn)
            got = _dynamo_phase(py, path, "big", args.dynamo_timeout)
            d = got if isinstance(got, str) else {**dres, **got}
            os.unlink(path)
        del dyn
        for _ in range(max(1, args.rounds)):
            part: dict[str, Any] = {}
            dyn = {"block_size": np.array([bs]), "reps": np.array([reps])}
            rng = np.random.default_rng(args.seed + 1)  # same workload every round
            bench_fm8(rng, bs, reps, part, dyn, args.delta_keys)
            bench_stores(rng, bs, n_single, n_batched, part, dyn)
            _merge(res, part)
            if py is not None and isinstance(d, dict):
                path = os.path.join(tmp, "small.npz")
                np.savez(path, **dyn)
                got = _dynamo_phase(py, path, "small", args.dynamo_timeout)
                if isinstance(got, str):
                    d = got
                else:
                    _merge(d, got)
    print_table(res, d, py, args, time.time() - t0)
    if args.plot:
        try:
            plot(res, d if isinstance(d, dict) else {}, args.plot)
        except ImportError:
            print("matplotlib missing: no plot", file=sys.stderr)


def plot(r: dict[str, Any], dd: dict[str, Any], out: str) -> None:
    """Store rates from bytes per path (1 and 64 blocks per event) and lookup p50s, ours beside
    Dynamo's, as two bar charts in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    paths = [("token ids", "decode"), ("edge-hashed", "edge"), ("own-hash deltas", "delta")]
    for i, (name, label) in enumerate((("single", "1 block/event"),
                                       ("batched", "64 blocks/event"))):
        xs = [i * (len(paths) + 2) + j for j in range(len(paths) + 1)]
        vals = [r[f"{name}_{k}_rate"] / 1e6 for _, k in paths]
        vals.append(dd.get(f"{name}_rate", 0.0) / 1e6)
        bars = left.bar(xs, vals, color=["#9ecae1", "#4292c6", "#08519c", "#e6550d"])
        left.bar_label(bars, fmt="%.2f", fontsize=7)
        left.text(xs[1] + 0.5, -0.08, label, transform=left.get_xaxis_transform(), ha="center")
    left.set_xticks([])
    left.set_ylabel("stores from bytes, M blocks/s (higher is better)")
    left.legend(handles=left.patches[:4], labels=[p for p, _ in paths] + ["Dynamo RadixTree"],
                fontsize=8)
    names = ["2,000-block prompt, 8 workers", "big index"]
    ours = [_pct(r["fm8_lat"], 0.5) * 1e6, _pct(r["big_lat"], 0.5) * 1e6]
    theirs = ([_pct(dd["fm8_lat"], 0.5) * 1e6, _pct(dd["big_lat"], 0.5) * 1e6]
              if "fm8_lat" in dd else [0.0, 0.0])
    xs = np.arange(len(names))
    right.bar_label(right.bar(xs - 0.2, ours, 0.4, label="ours", color="#08519c"), fmt="%.0f",
                    fontsize=7)
    right.bar_label(right.bar(xs + 0.2, theirs, 0.4, label="Dynamo", color="#e6550d"),
                    fmt="%.0f", fontsize=7)
    right.set_xticks(xs, names, fontsize=8)
    right.set_ylabel("find_matches p50, us (lower is better)")
    right.legend(fontsize=8)
    fig.suptitle("KV indexer: ours vs Dynamo 1.6.1 (scripts/bench_indexer.py)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot saved to {out}")


def print_table(r: dict[str, Any], d: dict[str, Any] | str, py: str | None,
                args: argparse.Namespace, took_s: float) -> None:
    have = isinstance(d, dict)
    dd: dict[str, Any] = d if isinstance(d, dict) else {}

    def rate(x: float) -> str:
        return f"{x / 1e6:.2f}M/s"

    def us(xs: list[float]) -> str:
        return f"{_pct(xs, 0.5) * 1e6:.0f} / {_pct(xs, 0.99) * 1e6:.0f}"

    rows: list[tuple[str, str, str, str]] = []

    def row(name: str, ours: str, theirs: str = "-", ratio: str = "-") -> None:
        rows.append((name, ours, theirs if have else "-", ratio if have else "-"))

    def x(a: float, b: float) -> str:
        return f"{a / b:.2f}x"

    for name, label in (("single", "1 block/event"), ("batched", "64 blocks/event")):
        dr, do = dd.get(f"{name}_rate", 0.0), dd.get(f"{name}_obj_rate", 0.0)
        row(f"stores, {label}, from Python objects: ours apply_stored (hashes the tokens) vs "
            "Dynamo JSON-encode + apply_event (hashes given)",
            rate(r[f"{name}_apply_rate"]), rate(do) if do else "-",
            x(r[f"{name}_apply_rate"], do) if do else "-")
        row(f"stores, {label}, from bytes: ours decode_batch(vLLM msgpack) + apply_batch vs "
            "Dynamo apply_event(JSON bytes)",
            rate(r[f"{name}_decode_rate"]), rate(dr) if dr else "-",
            x(r[f"{name}_decode_rate"], dr) if dr else "-")
        row(f"stores, {label}, from bytes, edge-hashed: ours decode_edge_batch(msgpack with "
            "own_hashes) + apply_batch vs Dynamo apply_event(JSON bytes)",
            rate(r[f"{name}_edge_rate"]), rate(dr) if dr else "-",
            x(r[f"{name}_edge_rate"], dr) if dr else "-")
        if f"{name}_edge_many_rate" in r:
            rm = r[f"{name}_edge_many_rate"]
            row(f"stores, {label}, from bytes, edge-hashed, {EDGE_EVENTS_PER_BATCH} events per "
                "payload (one decode_edge_batch + apply_batch each) vs Dynamo apply_event(JSON "
                "bytes)", rate(rm), rate(dr) if dr else "-", x(rm, dr) if dr else "-")
        rd = r[f"{name}_delta_rate"]
        row(f"stores, {label}, from bytes, own-hash deltas: ours decode_own_batch(OwnStored) + "
            "apply_batch vs Dynamo apply_event(JSON bytes)",
            rate(rd), rate(dr) if dr else "-", x(rd, dr) if dr else "-")
        if f"{name}_delta_many_rate" in r:
            rm = r[f"{name}_delta_many_rate"]
            row(f"stores, {label}, from bytes, own-hash deltas, {EDGE_EVENTS_PER_BATCH} events "
                "per payload vs Dynamo apply_event(JSON bytes)",
                rate(rm), rate(dr) if dr else "-", x(rm, dr) if dr else "-")
    f8 = r["fm8_lat"]
    row("find_matches, 2,000-block prompt, 8 workers (from hashes), p50 / p99 us", us(f8),
        us(dd["fm8_lat"]) if have else "-",
        x(_pct(f8, 0.5), _pct(dd["fm8_lat"], 0.5)) + " time" if have else "-")
    row("find_matches from 64k token ids (hashing included), p50 / p99 us", us(r["fm8_tok_lat"]))
    row("hash 2,000 blocks from a Python list (ours block_hashes, "
        "Dynamo compute_block_hash_for_seq), p50 / p99 us",
        us(r["hash_lat"]), us(dd["hash_lat"]) if have else "-",
        x(_pct(r["hash_lat"], 0.5), _pct(dd["hash_lat"], 0.5)) + " time" if have else "-")
    row("hash 2,000 blocks from a uint32 numpy array, p50 / p99 us", us(r["hash_np_lat"]))
    built = "from own-hash delta bytes" if args.delta_keys else "apply_stored of token events"
    row(f"big index build ({built}): {args.workers} workers x {args.blocks_per_worker:,} blocks "
        f"({r['big_blocks']:,} entries, {r['big_unique']:,} unique), stores/s",
        rate(r["big_rate"]), rate(dd["big_rate"]) if have else "-",
        x(r["big_rate"], dd["big_rate"]) if have else "-")
    bl = r["big_lat"]
    row(f"find_matches on the big index (from hashes, median query {r['big_qlen']:.0f} blocks), "
        "p50 / p99 us", us(bl), us(dd["big_lat"]) if have else "-",
        x(_pct(bl, 0.5), _pct(dd["big_lat"], 0.5)) + " time" if have else "-")
    row("find_matches on the big index from token ids, p50 / p99 us", us(r["big_tok_lat"]))
    row("memory per entry, 8-worker index (ours tracemalloc / bytes_per_block(); "
        "Dynamo RSS delta, fresh process)",
        f"{r['fm8_traced_bpb']:.0f} B / {r['fm8_computed_bpb']:.0f} B",
        f"{dd['fm8_bytes_per_block']:.0f} B" if have else "-")
    row("memory per entry, big index (ours RSS delta / bytes_per_block(); "
        "Dynamo RSS delta, fresh process)",
        f"{r['big_rss_bpb']:.0f} B / {r['big_computed_bpb']:.0f} B",
        f"{dd['big_bytes_per_block']:.0f} B" if have else "-")
    if "big_fresh_rss_bpb" in r:
        row("memory per entry, big index built alone from delta bytes in a fresh process "
            "(ours RSS delta / bytes_per_block(); Dynamo RSS delta, fresh process)",
            f"{r['big_fresh_rss_bpb']:.0f} B / {r['big_fresh_computed_bpb']:.0f} B",
            f"{dd['big_bytes_per_block']:.0f} B" if have else "-")

    print(f"# KV indexer benchmark (block size {args.block_size}, seed {args.seed}, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"{'delta keys, ' if args.delta_keys else ''}best of {args.rounds} "
          f"alternating rounds; took {took_s:.0f} s)\n")
    ours = "PackedKvIndexer" if args.packed else "router.indexer"
    print(f"| measurement | dynamo-zmq {ours} | Dynamo 1.6.1 RadixTree | ours / Dynamo |")
    print("|---|---|---|---|")
    for name, a, b, c in rows:
        print(f"| {name} | {a} | {b} | {c} |")
    print()
    if have:
        agree8 = dd["fm8_answer"] == r["fm8_answer"]
        agree_big = sum(a == b for a, b in zip(dd["big_answers"], r["big_answers"], strict=False))
        print(f"Dynamo: {py}. Same answers: 8-worker query {'yes' if agree8 else 'NO'}; "
              f"big index {agree_big}/{len(r['big_answers'])} queries.")
        print("Rates: higher is better (ratio > 1 = ours faster); "
              "latencies: ratio < 1 = ours faster.")
    else:
        print(f"Dynamo column: {d}")


if __name__ == "__main__":
    main()
