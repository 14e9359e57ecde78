"""Hashing at the edge (issue 18, item 1): workers publish the router's own block hashes with
each ``BlockStored`` and declare the scheme; the router then indexes them without decoding the
token ids, and ends up with exactly the index it builds from the tokens.

The property test drives the real wire path (``encode_batch`` -> bytes -> ``decode_batch`` /
``decode_edge_batch`` -> ``KvIndexer``); the end-to-end test runs mocker workers and a kv-mode
frontend (and ``python -m router``) as real processes.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamo_zmq.llm import (
    BlockStored,
    EngineConfig,
    KvHashScheme,
    OwnHashLedger,
    encode_batch,
    encode_own_batch,
)
from engines.vllm._edge import EdgeHasher
from router import events as events_mod
from router._own_events import decode_own_batch
from router.events import decode_batch, decode_edge_batch
from router.hashing import ROOT_SEED, block_hashes
from router.indexer import KvIndexer
from tests.support.completions import complete_header_body
from tests.support.fixtures import vllm_kv_events
from tests.support.indexer_models import scenarios
from tests.support.metrics import metrics_page
from tests.support.mocker_fleet import mocker_fleet
from tests.support.waiting import eventually

BLOCK = 16
PREFIX_BLOCKS = 6
#: The mocker workers' flags: two data-parallel ranks each.
WORKER = ("--block-size", str(BLOCK), "--data-parallel-size", "2", "--num-gpu-blocks-override",
          "256")

# --- the property: edge-hashed and token-hashed ingestion build the same index -------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 3), st.sampled_from([0, events_mod.SMALL_BATCH_BYTES]))
def test_edge_hashed_and_token_hashed_ingestion_build_the_same_index(scenario, dp_rank,
                                                                     small) -> None:
    size, batches, queries = scenario
    by_tokens, by_edge = KvIndexer(size), KvIndexer(size)
    edge_blocks = 0
    saved, events_mod.SMALL_BATCH_BYTES = events_mod.SMALL_BATCH_BYTES, small
    try:  # small == 0: every batch takes the path that skips the token ids
        for events in batches:
            payload = encode_batch(events, dp_rank)
            by_tokens.apply_batch(7, decode_batch(payload))
            batch, n = decode_edge_batch(payload)
            if len(payload) > small:
                assert all(ev.token_ids == [] for ev in batch.events
                           if isinstance(ev, BlockStored))
            edge_blocks += n
            by_edge.apply_batch(7, batch)
    finally:
        events_mod.SMALL_BATCH_BYTES = saved
    assert edge_blocks == sum(len(ev.block_hashes) for events in batches for ev in events
                              if isinstance(ev, BlockStored))
    assert by_edge.num_blocks() == by_tokens.num_blocks()
    assert by_edge.num_unique_blocks() == by_tokens.num_unique_blocks()
    assert by_edge.keys() == by_tokens.keys()
    for lora in (None, "ad"):
        for q in queries:
            assert by_edge.find_matches(q, lora=lora) == by_tokens.find_matches(q, lora=lora), q
    tok, edge = by_tokens.stats, by_edge.stats
    for field in ("stored_blocks", "removed_blocks", "unknown_parent", "duplicate_stores",
                  "conflicts", "unknown_removed", "clears"):
        assert getattr(edge, field) == getattr(tok, field), field


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 3))
def test_own_hash_deltas_and_token_hashed_ingestion_build_the_same_index(scenario,
                                                                         dp_rank) -> None:
    """The same engine events, once as vLLM's events hashed by the router and once through the
    publishers' ledger (``OwnHashLedger``) as own-hash deltas, index to the same answers."""
    size, batches, queries = scenario
    by_tokens, by_deltas, ledger = KvIndexer(size), KvIndexer(size), OwnHashLedger()
    for events in batches:
        by_tokens.apply_batch(7, decode_batch(encode_batch(events, dp_rank)))
        batch, _ = decode_own_batch(encode_own_batch(ledger.apply(events), dp_rank))
        by_deltas.apply_batch(7, batch)
    assert by_deltas.num_unique_blocks() == by_tokens.num_unique_blocks() == len(ledger.held())
    for lora in (None, "ad"):
        for q in queries:
            assert by_deltas.find_matches(q, lora=lora) == by_tokens.find_matches(q, lora=lora), q
    # A router that follows only from here on gets the same index from the ledger's dump.
    late = KvIndexer(size)
    late.apply_batch(7, decode_own_batch(encode_own_batch(ledger.snapshot(), dp_rank))[0])
    for q in queries:
        assert late.find_matches(q) == by_tokens.find_matches(q), q


# --- the wire stays compatible -------------------------------------------------------------------


def test_token_path_ignores_own_hashes_and_edge_path_takes_old_events() -> None:
    tokens = list(range(4 * BLOCK))
    own = block_hashes(tokens, BLOCK)
    lying = BlockStored([1, 2, 3, 4], None, tokens, BLOCK, own_hashes=[9, 9, 9, 9])
    # A publisher the router does not trust (no or another declared scheme): its own hashes are
    # dropped and its tokens hashed.
    decoded = decode_batch(encode_batch([lying]))
    assert decoded.events[0].own_hashes is None and decoded.events[0].token_ids == tokens
    idx = KvIndexer(BLOCK)
    idx.apply_batch(1, decoded)
    assert idx.find_matches(tokens) == {(1, 0): 4}
    # An old publisher's events (no own hashes; SGLang's tagged arrays too) through the edge
    # decoder: indexed from their tokens, counted as not edge-hashed.
    for payload in (encode_batch([BlockStored([1, 2, 3, 4], None, tokens, BLOCK)]),
                    msgspec.msgpack.encode([0.0, [["BlockStored", [1, 2, 3, 4], None, tokens,
                                                   BLOCK]], None])):
        batch, n = decode_edge_batch(payload)
        assert n == 0 and batch.events[0].token_ids == tokens
        idx = KvIndexer(BLOCK)
        idx.apply_batch(1, batch)
        assert idx.find_matches(tokens) == {(1, 0): 4}
    # The edge path itself.
    batch, n = decode_edge_batch(encode_batch([BlockStored([1, 2, 3, 4], None, tokens, BLOCK,
                                                           own_hashes=own)]))
    assert n == 4 and batch.events[0].own_hashes == own


def test_scheme_declaration() -> None:
    ours = KvHashScheme.ours(BLOCK)
    assert ours.usable_by(BLOCK) and ours.seed == ROOT_SEED
    assert not ours.usable_by(BLOCK * 2)
    for other in (KvHashScheme("sha256-cbor", 1, BLOCK, ROOT_SEED),
                  KvHashScheme(ours.name, ours.version + 1, BLOCK, ROOT_SEED),
                  KvHashScheme(ours.name, ours.version, BLOCK, ROOT_SEED ^ 1)):
        assert not other.usable_by(BLOCK)
    # An old worker's engine config (no scheme) still decodes; a new one round-trips.
    cfg = EngineConfig("m", kv_hash_scheme=ours)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=EngineConfig) == cfg
    old = msgspec.msgpack.encode({"model_name": "m"})
    assert msgspec.msgpack.decode(old, type=EngineConfig).kv_hash_scheme is None


# --- the vLLM adapter's relay hashes vLLM's own events at the edge --------------------------------


def test_vllm_relay_adds_own_hashes_that_index_as_the_tokens_do() -> None:
    """vLLM 0.32's captured KV events (sha256 int64 hashes), rewritten by the relay's
    ``EdgeHasher``: the router indexes them edge-hashed into the index their tokens give."""
    batches = sorted(vllm_kv_events().glob("batch_seq*.msgpack"))
    payloads = [b.read_bytes() for b in batches]
    size = next(ev.block_size for p in payloads for ev in decode_batch(p).events
                if isinstance(ev, BlockStored))
    hasher = EdgeHasher()
    by_tokens, by_edge = KvIndexer(size), KvIndexer(size)
    edge_blocks = held = 0
    prompts: list[list[int]] = []
    for payload in payloads:  # the indexes agree after every batch (the captures end cleared)
        tokens_batch = decode_batch(payload)
        by_tokens.apply_batch(3, tokens_batch)
        prompts += [ev.token_ids for ev in tokens_batch.events if isinstance(ev, BlockStored)]
        batch, n = decode_edge_batch(hasher.rewrite(payload))
        edge_blocks += n
        by_edge.apply_batch(3, batch)
        assert by_edge.num_blocks() == by_tokens.num_blocks()
        assert by_edge.num_unique_blocks() == by_tokens.num_unique_blocks()
        for p in prompts:
            assert by_edge.find_matches(p) == by_tokens.find_matches(p)
        held = max(held, by_tokens.num_blocks())
    assert edge_blocks > 0 and held > 0
    # Replays and anything not in vLLM's map form pass unchanged.
    assert hasher.rewrite(b"\xc1garbage") == b"\xc1garbage"


# --- real processes ------------------------------------------------------------------------------


def edge_hashed_blocks(metrics: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith('dynamo_router_edge_hashed_blocks_total{model="tiny"}'):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_mocker_edge_hashes_feed_kv_routing(namespace, spawn, tiny_model, make_runtime):
    url = (await mocker_fleet(spawn, namespace, tiny_model, 2, worker_args=WORKER)).url
    rng = random.Random(18)
    prefix = [rng.randrange(10, 500) for _ in range(PREFIX_BLOCKS * BLOCK)]

    async def served() -> bool:
        try:
            await asyncio.to_thread(complete_header_body, url, [1, 2, 3], 1)
        except OSError:
            return False
        return True

    await eventually(served, 30, "the frontend serving 'tiny'")
    target, _ = await asyncio.to_thread(complete_header_body, url, [*prefix, 1, 2, 3])

    async def indexed() -> bool:  # the prefix's blocks arrived edge-hashed
        return edge_hashed_blocks(await metrics_page(url)) >= PREFIX_BLOCKS

    await eventually(indexed, 15, "edge-hashed blocks in the frontend's index")
    for i in range(4):
        suffix = [rng.randrange(10, 500) for _ in range(3 + 5 * i)]
        got, _ = await asyncio.to_thread(complete_header_body, url, prefix + suffix)
        assert got == target, f"request {i} with the shared prefix went to {got}, not {target}"

    # ``python -m router`` takes the same edge hashes and answers with the prefix's worker.
    spawn("-m", "router", "--namespace", namespace, "--host", "127.0.0.1")
    client = await make_runtime().endpoint(f"{namespace}.router.best_worker").client()
    await client.wait_for_instances(timeout=15)

    async def router_knows() -> dict | None:
        try:
            stream = await client.generate({"model": "tiny", "token_ids": [*prefix, 42]})
            (answer,) = [r.data() async for r in stream]
        except Exception:  # the model is not followed yet
            return None
        return answer if answer["overlap_blocks"] >= PREFIX_BLOCKS else None

    answer = await eventually(router_knows, 20, "python -m router following the workers")
    assert f"{answer['worker_id']:x}/{answer['dp_rank']}" == target
