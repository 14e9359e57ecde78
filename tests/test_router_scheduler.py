"""The router's choice: Dynamo's cost, ties, softmax sampling, the load it predicts from routing
decisions (and releases when streams end, against a real worker), and the approximate index."""

from __future__ import annotations

import asyncio
import gc
import math
import random
import subprocess
import sys
from collections import Counter

import pytest

import router.__main__ as router_main
from dynamo_zmq import errors
from dynamo_zmq.llm import PrefillRemotely, PreprocessedRequest, RouteOptions, StopConditions
from router.approx import ApproxIndexer
from router.hashing import block_hashes
from router.kv_router import MAX_DP_SIZE, KvRouter, KvRouterConfig
from router.options import check_kv_router_args, kv_router_options
from router.scheduler import LoadTracker, Scheduler, cost, softmax_sample
from tests.support.waiting import until

A, B, C = (1, 0), (1, 1), (2, 0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def loads(table: dict[tuple[int, int], float]):
    return lambda c: table.get(c, 0.0)


# -- cost and selection ------------------------------------------------------------------------


def test_cost_is_weighted_prefill_plus_decode_blocks():
    assert cost(1.0, 10, 4, 3.0) == 6 + 3
    assert cost(2.0, 10, 4, 3.0) == 12 + 3
    assert cost(0.0, 10, 0, 7.0) == 7  # weight 0: load alone
    assert cost(1.0, 4, 9, 0.0) == 0  # overlap beyond the prompt never goes negative


def test_the_cheapest_candidate_wins():
    s = Scheduler(overlap_score_weight=1.0)
    # A holds 8 of 10 blocks but carries 5: 2 + 5 = 7; B: 10 + 0; C: 6 + 2 = 8.
    sel = s.select([A, B, C], 10, {A: 8, C: 4}, loads({A: 5, C: 2}))
    assert (sel.candidate, sel.overlap_blocks, sel.cost, sel.load) == (A, 8, 7.0, 5.0)
    # A heavier weight on prefill favours overlap even more; weight 0 picks the idle one.
    assert Scheduler(0.0).select([A, B, C], 10, {A: 8, C: 4}, loads({A: 5, C: 2})).candidate == B
    sel = Scheduler(1.0).select([A, B, C], 10, {A: 8}, loads({A: 9}))  # A: 11, B: 10, C: 10
    assert sel.candidate in (B, C) and sel.overlap_blocks == 0


def test_temperature_zero_is_deterministic():
    for seed in range(20):
        s = Scheduler(1.0, 0.0, rng=random.Random(seed))
        assert s.select([A, B, C], 12, {B: 6, C: 5}, loads({})).candidate == B


def test_ties_go_to_the_lower_load_then_at_random():
    s = Scheduler(1.0, rng=random.Random(1))
    # Equal cost 6: A = 6 prefill + 0 load, B = 0 prefill + 6 load: A has the lower load.
    assert s.select([A, B], 6, {B: 6}, loads({B: 6})).candidate == A
    # Equal cost and equal load: both get picked over many draws.
    picks = Counter(s.select([A, B, C], 4, {}, loads({})).candidate for _ in range(300))
    assert set(picks) == {A, B, C} and min(picks.values()) > 50


def test_no_candidates_is_an_error():
    with pytest.raises(ValueError):
        Scheduler().select([], 3, {}, loads({}))
    with pytest.raises(ValueError):
        Scheduler(overlap_score_weight=-1)
    with pytest.raises(ValueError):
        Scheduler(temperature=math.inf)


def test_softmax_follows_dynamos_normalisation():
    costs = [0.0, 3.0, 9.0]
    # p_i ~ exp(-(c_i - min) / ((max - min) * T)), T = 1: exp(0), exp(-1/3), exp(-1).
    w = [1.0, math.exp(-1 / 3), math.exp(-1)]
    cum = [w[0] / sum(w), (w[0] + w[1]) / sum(w)]
    assert softmax_sample(costs, 1.0, cum[0] - 1e-9) == 0
    assert softmax_sample(costs, 1.0, cum[0] + 1e-9) == 1
    assert softmax_sample(costs, 1.0, cum[1] + 1e-9) == 2
    # Equal costs: uniform.
    assert [softmax_sample([5.0] * 4, 1.0, x) for x in (0.0, 0.3, 0.6, 0.99)] == [0, 1, 2, 3]
    # The scale of the costs does not matter, only their spread relative to the range.
    assert softmax_sample([0, 300, 900], 1.0, cum[0] + 1e-9) == 1


def test_temperature_spreads_the_choice_and_favours_the_cheap():
    s = Scheduler(1.0, 1.0, rng=random.Random(7))
    picks = Counter(
        s.select([A, B, C], 10, {A: 10, B: 5}, loads({})).candidate for _ in range(2000)
    )
    assert picks[A] > picks[B] > picks[C] > 0
    cold = Scheduler(1.0, 0.01, rng=random.Random(7))
    assert {
        cold.select([A, B, C], 10, {A: 10, B: 5}, loads({})).candidate for _ in range(200)
    } == {A}


# -- load tracking ------------------------------------------------------------------------------


def test_load_counts_from_routing_and_is_released_once():
    t = LoadTracker()
    r1 = t.add(A, [11, 12, 13], extra_blocks=2)
    assert t.load(A) == 5 and t.load(B) == 0
    r2 = t.add(A, [11, 12, 14], extra_blocks=1)  # shares two prompt blocks with r1
    assert t.load(A) == 4 + 3
    t.release(r1)
    t.release(r1)  # idempotent
    assert t.load(A) == 3 + 1
    t.release(r2)
    assert t.load(A) == 0


def test_removed_worker_forgets_its_load_and_late_releases_are_harmless():
    t = LoadTracker()
    old = t.add(A, [1, 2])
    t.remove_worker(A[0])
    assert t.load(A) == 0
    new = t.add(A, [1])  # the same key again (a rank of a new worker with a reused id)
    t.release(old)
    assert t.load(A) == 1
    t.release(new)
    assert t.load(A) == 0


def test_a_worker_report_replaces_the_prediction_until_it_goes_stale():
    clock = Clock()
    t = LoadTracker(report_ttl=5.0, clock=clock)
    before = t.add(A, [1, 2, 3])
    t.report(A, 10)
    assert t.load(A) == 10  # includes everything routed before the report
    after = t.add(A, [4, 5])
    assert t.load(A) == 12
    t.release(before)  # inside the report: its blocks leave the reported figure
    assert t.load(A) == 9
    t.release(after)
    assert t.load(A) == 7
    t.report(A, 7)
    assert t.load(A) == 7
    clock.now += 6  # stale: back to the prediction (nothing active)
    assert t.load(A) == 0


def test_a_finished_request_leaves_the_reported_load_at_once():
    """Sequential turns of a conversation: the next turn must not see the last one's blocks
    (still in the last report) as load on the rank that caches the shared prefix."""
    t = LoadTracker(report_ttl=5.0, clock=Clock())
    first = t.add(A, [1, 2, 3], extra_blocks=1)
    shared = t.add(A, [1, 2])  # shares two blocks with ``first``
    t.report(A, 5)
    t.release(first)  # frees its own block 3 and its output block; 1 and 2 are still in use
    assert t.load(A) == 3
    t.release(shared)
    assert t.load(A) == 1
    t.report(A, 0.5)
    t.release(t.add(A, [9]))
    assert t.load(A) == 0.5
    late = t.add(A, [7, 8])
    t.report(A, 1)
    t.release(late)  # the report may not have counted it yet: never below zero
    assert t.load(A) == 0


def test_a_report_measured_before_a_release_arrives_without_the_released_blocks():
    """A report read while a request ran can arrive after the request finished here; the
    blocks its release freed come off the figure, so the next turn still goes to its prefix."""
    clock = Clock()
    t = LoadTracker(report_ttl=5.0, clock=clock)
    measured = clock.now
    first = t.add(A, [1, 2, 3], extra_blocks=1)
    clock.now += 0.01
    t.release(first)  # frees 4 blocks; no report had counted it yet
    assert t.load(A) == 0
    clock.now += 0.01
    t.report(A, 4, measured_at=measured)  # read while ``first`` ran, delivered after it ended
    assert t.load(A) == 0
    t.report(A, 4)  # when it was read is unknown: taken as current
    assert t.load(A) == 4
    t.report(A, 4, measured_at=clock.now - 0.005)  # read after the release: it is all load
    assert t.load(A) == 4
    clock.now += 3.0  # releases are remembered for a while only
    t.report(A, 4, measured_at=measured)
    assert t.load(A) == 4


def test_a_request_kept_on_top_of_a_report_leaves_it_too_when_it_finishes():
    """Routed just before a report, a request counts on top of it (the engine may not have had
    it yet); the report may have counted it as well, and once it finishes it holds nothing."""
    clock = Clock()
    t = LoadTracker(report_ttl=5.0, clock=clock, report_grace=0.3)
    first = t.add(A, [1, 2, 3, 4], extra_blocks=1)
    clock.now += 0.01
    t.report(A, 5)  # it did count it
    assert t.load(A) == 10
    t.release(first)
    assert t.load(A) == 0
    other = t.add(A, [7])
    clock.now += 0.01
    t.report(A, 3)  # counted something else; ``other`` maybe too
    t.release(other)
    assert t.load(A) == 2  # never more than the report without it


def test_late_reports_never_go_below_zero_or_forget_other_requests():
    clock = Clock()
    t = LoadTracker(report_ttl=5.0, clock=clock)
    measured = clock.now
    done = t.add(A, [1, 2])
    running = t.add(A, [3])
    clock.now += 0.01
    t.release(done)
    t.report(A, 1, measured_at=measured)  # a report that missed ``done`` altogether
    assert t.load(A) == 0
    t.report(A, 3, measured_at=measured)  # one that counted both
    assert t.load(A) == 1
    t.release(running)
    assert t.load(A) == 0


def test_requests_routed_within_the_grace_before_a_report_stay_on_top_of_it():
    clock = Clock()
    t = LoadTracker(report_ttl=5.0, clock=clock, report_grace=0.3)
    old = t.add(A, [1, 2, 3])
    clock.now += 1.0
    recent = t.add(A, [4, 5])  # maybe not yet on the engine when it measured
    clock.now += 0.1
    t.report(A, 10)
    assert t.load(A) == 12
    clock.now += 0.1
    t.report(A, 11)  # still within the grace: still on top
    assert t.load(A) == 13
    clock.now += 0.2
    t.report(A, 12)  # older than the grace: inside the report now
    assert t.load(A) == 12
    t.release(recent)
    t.release(old)
    assert t.load(A) == 7  # both leave the reported figure
    clock.now += 0.1
    late = t.add(A, [6])
    t.release(late)  # released before the next report: never counted again
    t.report(A, 4)
    assert t.load(A) == 4


# -- the approximate index ----------------------------------------------------------------------


def test_approx_index_matches_routed_prefixes_until_their_ttl():
    clock = Clock()
    idx = ApproxIndexer(block_size=4, ttl=120.0, clock=clock)
    prompt = list(range(1, 17))  # 4 blocks
    idx.record(A, prompt)
    idx.record(B, prompt[:8] + [99] * 8)  # shares 2 blocks
    assert idx.find_matches(prompt) == {A: 4, B: 2}
    assert idx.find_matches(prompt[:10]) == {A: 2, B: 2}  # partial last block ignored
    assert idx.find_matches([7] * 16) == {}
    assert idx.num_blocks(A) == 4 and idx.num_blocks() == 8 and set(idx.keys()) == {A, B}
    clock.now += 100
    idx.record(A, prompt[:4])  # refreshes block 0 of A only
    clock.now += 30  # 130 s after the first records
    assert idx.find_matches(prompt) == {A: 1}
    assert idx.num_blocks() == 1
    clock.now += 100
    assert idx.find_matches(prompt) == {} and idx.keys() == []


def test_approx_index_forgets_a_removed_worker():
    idx = ApproxIndexer(block_size=2)
    idx.record((5, 0), [1, 2, 3, 4])
    idx.record((5, 1), [1, 2])
    idx.record(C, [1, 2])
    idx.remove_worker(5)
    assert idx.find_matches([1, 2, 3, 4]) == {C: 1}
    with pytest.raises(ValueError):
        ApproxIndexer(block_size=0)


# -- against a real worker: load from routing time, released when the stream ends ---------------


def _request(tokens: list[int], max_tokens: int) -> PreprocessedRequest:
    return PreprocessedRequest(tokens, stop=StopConditions(max_tokens=max_tokens, ignore_eos=True))


@pytest.fixture
async def slow_worker(namespace, spawn, make_runtime, tiny_model):
    """A mocker worker with two data-parallel ranks at real speed, and a KvRouter for it. The
    worker publishes no load, so the router's load is its own prediction alone (published load
    is tested in test_router_load.py)."""
    proc = spawn("-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(tiny_model),
                 "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
                 "--discovery", "static", "--block-size", "16", "--data-parallel-size", "2",
                 "--speedup-ratio", "1", "--load-interval", "0")
    rt = make_runtime(static=(proc.address,))
    client = await rt.endpoint(f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    router = KvRouter(
        client, 16, KvRouterConfig(max_expected_output_tokens=32), runtime=rt, model="tiny"
    )
    await router.start()
    try:
        yield proc, router
    finally:
        await router.close()


async def test_load_is_counted_at_routing_and_released_when_the_stream_ends(slow_worker):
    proc, router = slow_worker
    keys = [(proc.instance_id, 0), (proc.instance_id, 1)]
    total = lambda: sum(router.loads.load(k) for k in keys)  # noqa: E731
    prompt = list(range(1, 41))  # 2 full blocks + 8 tokens
    # Ends with its terminal item: counted at once (no token yet), released at the terminal.
    request = _request(prompt, 20)
    stream = await router.generate(request)
    assert total() == 2 + math.ceil((8 + 20) / 16)
    # The choice travels with the request (the frontend's x-dynamo-worker: <instance>/<rank>).
    assert stream.instance_id == proc.instance_id and request.routing.dp_rank in (0, 1)
    items = [item async for item in stream]
    assert items[-1].finish_reason == "length" and total() == 0
    # Closed early.
    stream = await router.generate(_request(prompt, 500))
    assert total() > 0
    await stream.__anext__()
    await stream.aclose()
    assert total() == 0
    # Dropped without being read.
    stream = await router.generate(_request(prompt, 500))
    assert total() > 0
    del stream
    gc.collect()
    assert total() == 0


async def test_a_dropped_stream_releases_its_load_at_once_without_the_garbage_collector(
    slow_worker,
):
    """Nothing the stream's hooks hold refers back to it: dropping it releases it then."""
    proc, router = slow_worker
    keys = [(proc.instance_id, 0), (proc.instance_id, 1)]
    total = lambda: sum(router.loads.load(k) for k in keys)  # noqa: E731
    gc.disable()
    try:
        stream = await router.generate(_request(list(range(1, 41)), 500))
        await stream.__anext__()
        assert total() > 0
        del stream
        assert total() == 0
    finally:
        gc.enable()


async def test_requests_in_flight_push_the_next_one_to_the_idle_rank(slow_worker):
    _proc, router = slow_worker
    first_req, second_req = _request([3] * 64, 500), _request([4] * 64, 500)
    first = await router.generate(first_req)
    second = await router.generate(second_req)  # unrelated: only load differs
    assert {first_req.routing.dp_rank, second_req.routing.dp_rank} == {0, 1}
    # The worker honoured the ranks: each rank has one running sequence.
    assert first_req.routing.overlap_blocks == second_req.routing.overlap_blocks == 0
    await first.aclose()
    await second.aclose()
    # Once the first request's blocks are reported by KV events, a request sharing its prefix
    # goes to the same rank even though both ranks are idle.
    shared = [5] * 64
    done_req = _request(shared + [6] * 3, 1)
    done = await router.generate(done_req)
    [_ async for _ in done]
    assert await until(
        router.client, lambda: router.best_worker([*shared, 7]).overlap_blocks == 4, 10
    )
    again_req = _request(shared + [7] * 5, 1)
    again = await router.generate(again_req)
    assert again_req.routing.dp_rank == done_req.routing.dp_rank
    assert again_req.routing.overlap_blocks == 4
    await again.aclose()


async def test_approximate_mode_routes_by_its_own_decisions(
    namespace, spawn, make_runtime, tiny_model
):
    proc = spawn("-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(tiny_model),
                 "--model-name", "tiny", "--namespace", namespace, "--host", "127.0.0.1",
                 "--discovery", "static", "--block-size", "16", "--data-parallel-size", "2",
                 "--speedup-ratio", "100", "--no-kv-events")
    rt = make_runtime(static=(proc.address,))
    client = await rt.endpoint(f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    router = await KvRouter(client, 16, KvRouterConfig(use_kv_events=False), runtime=rt).start()
    try:
        assert router.subscriber(proc.instance_id) is None
        prefix = list(range(100, 164))  # 4 blocks
        first = _request([*prefix, 1], 2)
        [_ async for _ in await router.generate(first)]
        for tail in ([2, 3], [4] * 20, [9]):
            req = _request(prefix + tail, 2)
            s = await router.generate(req)
            assert req.routing.dp_rank == first.routing.dp_rank
            assert req.routing.overlap_blocks == 4
            [_ async for _ in s]
        rank = first.routing.dp_rank
        assert router.indexer.find_matches(prefix) == {(proc.instance_id, rank): 4}
        hashes = block_hashes(prefix, 16)  # keyed by the router's own hashes
        assert router.indexer.find_matches_for_hashes(hashes[:2]) == {(proc.instance_id, rank): 2}
    finally:
        await router.close()


async def test_excluded_workers_are_not_routed_to_whatever_they_hold(
    namespace, spawn, make_runtime, tiny_model
):
    """``exclude`` (a migrated request's lost workers) beats the overlap: the request goes to
    the best worker outside it; with every worker excluded it fails with CannotConnect."""
    procs = [spawn("-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path",
                   str(tiny_model), "--model-name", "tiny", "--namespace", namespace, "--host",
                   "127.0.0.1", "--discovery", "static", "--block-size", "16",
                   "--speedup-ratio", "100", "--no-kv-events") for _ in range(2)]
    rt = make_runtime(static=tuple(p.address for p in procs))
    client = await rt.endpoint(f"{namespace}.backend.generate").client()
    await until_instances(client, 2)
    router = await KvRouter(client, 16, KvRouterConfig(use_kv_events=False), runtime=rt).start()
    try:
        prefix = list(range(100, 164))  # 4 blocks
        s = await router.generate(_request([*prefix, 1], 2))
        holder = s.instance_id
        [_ async for _ in s]
        s = await router.generate(_request([*prefix, 2], 2))
        assert s.instance_id == holder  # the overlap decides
        [_ async for _ in s]
        s = await router.generate(_request([*prefix, 3], 2),
                                  options=RouteOptions(exclude=frozenset({holder})))
        assert s.instance_id != holder
        assert [o.finish_reason async for o in s][-1] == "length"
        with pytest.raises(errors.CannotConnect):
            everyone = RouteOptions(exclude=frozenset(p.instance_id for p in procs))
            await router.generate(_request(prefix, 2), options=everyone)
    finally:
        await router.close()


async def test_a_decode_request_with_a_remote_prefill_earns_no_overlap_credit(
    namespace, spawn, make_runtime, tiny_model
):
    """A request whose KV comes from a prefill worker (``PrefillRemotely``, disaggregation)
    is routed by load alone: what the workers hold of its prompt is not counted."""
    proc = spawn("-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path",
                 str(tiny_model), "--model-name", "tiny", "--namespace", namespace, "--host",
                 "127.0.0.1", "--discovery", "static", "--block-size", "16",
                 "--speedup-ratio", "100", "--no-kv-events")
    rt = make_runtime(static=(proc.address,))
    client = await rt.endpoint(f"{namespace}.backend.generate").client()
    await until_instances(client, 1)
    router = await KvRouter(client, 16, KvRouterConfig(use_kv_events=False), runtime=rt).start()
    try:
        prefix = list(range(100, 164))  # 4 blocks
        [_ async for _ in await router.generate(_request([*prefix, 1], 2))]
        local = _request([*prefix, 2], 2)
        await (await router.generate(local)).aclose()
        assert local.routing.overlap_blocks == 4
        remote = _request([*prefix, 3], 2)
        remote.disaggregation = PrefillRemotely()
        await (await router.generate(remote)).aclose()
        assert remote.routing.overlap_blocks == 0
    finally:
        await router.close()


async def until_instances(client, count: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while len(client.instance_ids()) < count:
        assert loop.time() < deadline, "workers not live"
        await asyncio.sleep(0.05)


# -- kv-router flags ------------------------------------------------------------------------------


@pytest.mark.parametrize("main", ["router", "dynamo_zmq.frontend"])
@pytest.mark.parametrize(("flags", "message"), [
    (["--load-report-ttl", "2"], "--load-report-ttl must be > 2"),
    (["--load-report-ttl", "nan"], "--load-report-ttl must be > 2"),
    (["--load-report-grace", "-0.1"], "--load-report-grace must be >= 0"),
    (["--load-report-ttl", "3", "--load-report-grace", "3"], "--load-report-grace must be >= 0"),
    (["--kv-overlap-score-weight", "nan"], "--kv-overlap-score-weight must be a finite number"),
    (["--kv-overlap-score-weight", "-1"], "--kv-overlap-score-weight must be a finite number"),
    (["--router-temperature", "inf"], "--router-temperature must be a finite number"),
    (["--router-ttl", "0"], "--router-ttl must be a finite number > 0"),
])
def test_kv_router_flags_that_cannot_work_are_refused(main, flags, message):
    """A NaN weight would make every cost NaN; a TTL within the slowest worker publish interval
    would let reports expire between sends."""
    mode = ["--router-mode", "kv"] if main == "dynamo_zmq.frontend" else []
    res = subprocess.run([sys.executable, "-m", main, *mode, *flags],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and message in res.stderr


async def test_kv_router_flags_reach_the_router(namespace, make_runtime):
    args = router_main.build_parser().parse_args(
        ["--load-report-ttl", "7.5", "--load-report-grace", "0.05", "--no-kv-events",
         "--router-ttl", "9"])
    check_kv_router_args(args)
    rt = make_runtime()
    client = await rt.endpoint(f"{namespace}.backend.generate").client()
    router = KvRouter(client, 16, KvRouterConfig(**kv_router_options(args)), runtime=rt)
    try:
        assert (router.loads.report_ttl, router.loads.report_grace) == (7.5, 0.05)
        assert isinstance(router.indexer, ApproxIndexer) and router.indexer.ttl == 9
    finally:
        await router.close()
    default = KvRouter(client, 16, runtime=rt)
    try:
        assert default.loads.report_ttl == router_main.build_parser().parse_args([]).load_report_ttl
    finally:
        await default.close()


# -- a worker advertising endpoints the router cannot connect -----------------------------------


async def _echo_worker_and_router(namespace, spawn, make_runtime, tiny_model, *flags: str):
    """An echo worker process started with ``flags``, and a started KvRouter following it."""
    proc = spawn("-m", "dynamo_zmq.worker", "--engine", "tests.support.engines:EchoEngine", *flags,
                 "--model-path", str(tiny_model), "--namespace", namespace, "--host", "127.0.0.1",
                 "--discovery", "static")
    rt = make_runtime(static=(proc.address,))
    client = await rt.endpoint(f"{namespace}.backend.generate").client()
    await client.wait_for_instances(timeout=15)
    router = await KvRouter(client, 16, runtime=rt, model="echo").start()
    if not await until(client, lambda: router.followed() == [proc.instance_id], timeout=10):
        await router.close()
        raise AssertionError("the router never followed the worker")
    return proc, router


@pytest.mark.parametrize(("events", "replay", "bad"), [
    ("tcp://*:5557", None, "tcp://*:5557"),
    ("not an endpoint", "not an endpoint", "not an endpoint"),
    ("tcp://127.0.0.1:9", "tcp://*:5558", "tcp://*:5558"),
])
async def test_an_unconnectable_kv_event_endpoint_is_a_warning_not_a_failure(
        namespace, spawn, make_runtime, tiny_model, caplog, events, replay, bad):
    """``tcp://*:N`` is vLLM's bind form, easy to advertise by mistake: the router warns, follows
    the worker without what it cannot reach (events, or only their replay), and keeps routing."""
    flags = ["--echo-kv-events-endpoint", events]
    if replay is not None:
        flags += ["--echo-kv-replay-endpoint", replay]
    proc, router = await _echo_worker_and_router(namespace, spawn, make_runtime, tiny_model, *flags)
    try:
        sub = router.subscriber(proc.instance_id)
        if bad == events:
            assert sub is None
        else:  # events followed; the failed replay is warned about, the subscriber keeps running
            assert await until(
                router.client,
                lambda: any(repr(bad) in r.getMessage() for r in caplog.records),
                10,
            )
            assert sub is not None and sub.running
        stream = await router.generate(_request(list(range(1, 40)), 3))
        chunks = [c async for c in stream]
        assert chunks[-1].finish_reason == "length"
    finally:
        await router.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(repr(bad) in w and "cannot connect" in w for w in warnings), warnings
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_an_absurd_data_parallel_size_is_bounded(
    namespace, spawn, make_runtime, tiny_model, caplog
):
    """Every rank is a candidate in every decision: a peer claiming 10**12 ranks must not make
    the router build a list that size."""
    _, router = await _echo_worker_and_router(namespace, spawn, make_runtime, tiny_model,
                                              "--echo-data-parallel-size", str(10**12))
    try:
        assert len(router.candidates()) == MAX_DP_SIZE
        stream = await router.generate(_request(list(range(1, 40)), 3))
        assert [c async for c in stream][-1].finish_reason == "length"
    finally:
        await router.close()
    assert any(
        "advertises 1000000000000 data-parallel ranks" in r.getMessage() for r in caplog.records
    )
