"""The vLLM KV connector's transfer (engines/vllm/_kv_worker.py) between two of its worker
halves over real ZeroMQ sockets, without vLLM engines (tests/test_vllm_disagg.py runs it inside
vLLM): blocks arrive byte for byte in the right places, in batches; a pull waits for the prefill
side to register the request; pulled, expired, unknown requests and blocks not held are refused
and the pull reported failed; with CURVE keys the transfer works between authorized keys only.

Runs only where vLLM is installed (skipped otherwise, failed in CI: see tests/test_vllm.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

import torch

from dynamo_zmq.tools.keys import authorize, create_keypair
from dynamo_zmq.transport import CurveAuth
from engines.vllm._endpoints import free_port
from engines.vllm._kv_scheduler import PullJob, ZmqConnectorMetadata
from engines.vllm._kv_worker import WorkerSide

pytestmark = [pytest.mark.timeout(120)]

BLOCKS = 12
SHAPE = (BLOCKS, 2, 32, 16)  # the CPU backend's layout: blocks first


class Side:
    """One worker half with two layers of KV cache."""

    def __init__(self, seed: int, curve: CurveAuth | None = None, timeout: float = 3.0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.caches = {f"layer.{i}": torch.randn(SHAPE, generator=gen) for i in range(2)}
        self.port = free_port()
        self.worker = WorkerSide(f"127.0.0.1:{self.port}", BLOCKS, batch_blocks=2,
                                 timeout=timeout, curve=curve)
        self.worker.register(self.caches)
        self.sent: set[str] = set()
        self.done: set[str] = set()
        self.failed: set[str] = set()

    def hold(self, rid: str, blocks: list[int], ttl: float = 30.0) -> None:
        self.worker.bind(ZmqConnectorMetadata(sends={rid: (blocks, time.monotonic() + ttl)}))

    def pull(self, rid: str, remote: Side, remote_rid: str, pairs: list[tuple[int, int]],
             curve_key: str | None = None) -> None:
        job = PullJob(rid, "127.0.0.1", remote.port, remote_rid, pairs, curve_key)
        self.worker.bind(ZmqConnectorMetadata(pulls=[job]))

    def step(self) -> None:
        sent, done, failed = self.worker.finished()
        self.sent |= sent
        self.done |= done
        self.failed |= failed


def wait(sides: list[Side], cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, [(s.sent, s.done, s.failed) for s in sides]
        for s in sides:
            s.step()
        time.sleep(0.02)


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    prefill, decode = Side(1), Side(2)
    yield prefill, decode
    prefill.worker.shutdown()
    decode.worker.shutdown()


def same(dst: Side, src: Side, pairs: list[tuple[int, int]]) -> bool:
    return all(torch.equal(dst.caches[name][loc], src.caches[name][rem])
               for name in src.caches for loc, rem in pairs)


def test_blocks_arrive_in_batches_and_the_prefill_side_frees_them(pair):
    prefill, decode = pair
    pairs = [(0, 7), (1, 3), (5, 4), (2, 9), (6, 11)]  # 5 blocks: 3 batches of at most 2
    untouched = decode.caches["layer.0"][[3, 4]].clone()
    assert not same(decode, prefill, pairs)
    prefill.hold("p1", [7, 3, 4, 9, 11])
    decode.pull("d1", prefill, "p1", pairs)
    wait([prefill, decode], lambda: "d1" in decode.done and "p1" in prefill.sent)
    assert same(decode, prefill, pairs)
    assert not decode.failed
    assert torch.equal(decode.caches["layer.0"][[3, 4]], untouched)
    assert decode.worker.pulled_blocks == 5
    assert decode.worker.pulled_bytes == 5 * 2 * prefill.caches["layer.0"][0].nbytes


def test_a_pull_waits_for_the_prefill_side_to_register_the_request(pair):
    prefill, decode = pair
    decode.pull("d1", prefill, "late", [(0, 1)])
    time.sleep(0.3)  # the pull asks, is told to retry, asks again
    assert "d1" not in decode.done
    prefill.hold("late", [1])
    wait([prefill, decode], lambda: "d1" in decode.done)
    assert not decode.failed and same(decode, prefill, [(0, 1)])


def test_pulled_expired_unknown_and_unheld_are_refused(pair):
    prefill, decode = pair
    prefill.hold("p1", [1, 2])
    decode.pull("d1", prefill, "p1", [(0, 1), (3, 2)])
    wait([prefill, decode], lambda: "d1" in decode.done)
    before = decode.caches["layer.1"].clone()
    decode.pull("d2", prefill, "p1", [(4, 1)])  # already pulled: its blocks were freed
    prefill.hold("p2", [5], ttl=-1.0)  # expired at once
    wait([prefill], lambda: "p2" in prefill.sent)
    decode.pull("d3", prefill, "p2", [(4, 5)])
    prefill.hold("p3", [6])
    decode.pull("d4", prefill, "p3", [(4, 6), (5, 8)])  # block 8 is not held for p3
    wait([prefill, decode], lambda: {"d2", "d3", "d4"} <= decode.done, timeout=10)
    assert decode.failed == {"d2", "d3", "d4"}
    assert torch.equal(decode.caches["layer.1"], before)  # nothing written for them


def test_a_prefill_side_that_does_not_answer_fails_the_pull():
    decode = Side(2, timeout=1.0)
    try:
        job = PullJob("d1", "127.0.0.1", free_port(), "p", [(0, 0)])  # nothing listens there
        decode.worker.bind(ZmqConnectorMetadata(pulls=[job]))
        wait([decode], lambda: "d1" in decode.done, timeout=10)
        assert decode.failed == {"d1"}
    finally:
        decode.worker.shutdown()


def keys(tmp: Path, *names: str) -> Path:
    for name in names:
        authorize(tmp, create_keypair(tmp, name).decode(), name)
    return tmp


def test_with_curve_only_authorized_keys_transfer(tmp_path: Path):
    folder = keys(tmp_path, "prefill", "decode")
    prefill = Side(1, CurveAuth(folder, "prefill"))
    decode = Side(2, CurveAuth(folder, "decode"))
    plain = Side(4, timeout=1.0)
    try:
        key = CurveAuth(folder, "prefill").public.decode()
        prefill.hold("p1", [1, 2])
        decode.pull("nokey", prefill, "p1", [(0, 1)])  # no key in the handoff: refused
        plain.pull("plain", prefill, "p1", [(0, 1)])  # no CURVE: never admitted
        decode.pull("d1", prefill, "p1", [(0, 1), (1, 2)], curve_key=key)
        wait([prefill, decode, plain],
             lambda: "d1" in decode.done and "nokey" in decode.done and "plain" in plain.done)
        assert decode.failed == {"nokey"} and plain.failed == {"plain"}
        assert same(decode, prefill, [(0, 1), (1, 2)])
    finally:
        for side in (prefill, decode, plain):
            side.worker.shutdown()
