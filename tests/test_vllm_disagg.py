"""Disaggregated prefill/decode with real vLLM workers (issue 17): a prefill-role worker computes
a prompt's KV and hands it off; a decode-role worker pulls the blocks through our KV connector
(engines/vllm/_kv_connector.py, ZeroMQ worker to worker) and generates. Greedy output equals the
aggregated output; the decode worker really pulled the blocks (its connector's log line names the
blocks and bytes, and vLLM counts the pulled prompt as computed); a handoff already used, one for
another prompt, one whose blocks expired on the prefill worker, or one whose prefill worker is
gone, makes the decode worker prefill locally, with the same output.

The workers are driven through the runtime API client (no frontend). Runs only where vLLM is
installed (skipped otherwise, failed in CI: see tests/test_vllm.py).
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

from engines.vllm._endpoints import free_port
from tests.support.churn import read_stream
from tests.support.procs import Proc
from tests.support.vllm_stack import VLLM_ENV, WORKER_FLAGS, WORKER_START
from tests.support.waiting import until

pytestmark = [pytest.mark.timeout(900)]

BLOCK = 32
#: A prompt over several KV blocks (the last one partial).
PROMPT = [(i * 37) % 250 + 5 for i in range(3 * BLOCK + 11)]
MAX_TOKENS = 24
#: Seconds a prefill's blocks wait for their pull on the prefill worker.
TTL = 6.0


def pulling(handoff: dict) -> dict:
    """A decode request's ``disaggregation``: pull the KV ``handoff`` names."""
    return {"type": "prefill_remotely", "handoff": handoff}


def request(prompt: list[int], max_tokens: int, disagg: dict[str, Any] | None = None) -> dict:
    return {"token_ids": prompt, "sampling": {"temperature": 0.0},
            "stop": {"max_tokens": max_tokens, "ignore_eos": True},
            "disaggregation": disagg}


@pytest.fixture(scope="module")
def workers(tiny_model: Any) -> Iterator[dict[str, tuple[str, Proc]]]:
    """A prefill-role and a decode-role vLLM worker, each on a namespace of its own."""
    procs: dict[str, tuple[str, Proc]] = {}
    try:
        for role in ("prefill", "decode"):
            ns = f"t{uuid.uuid4().hex[:12]}"
            procs[role] = (ns, Proc(
                ["-m", "dynamo_zmq.worker", "--engine", "vllm", "--model-path", str(tiny_model),
                 "--model-name", "tiny", "--namespace", ns, "--host", "127.0.0.1",
                 "--disaggregation-mode", role, "--kv-transfer-ttl", str(TTL), *WORKER_FLAGS],
                env=VLLM_ENV))
        for _, proc in procs.values():
            proc.wait_ready(WORKER_START)
        yield procs
    finally:
        for _, proc in procs.values():
            proc.stop()


async def client_for(make_runtime: Any, ns: str, proc: Proc) -> Any:
    client = await make_runtime().endpoint(f"{ns}.backend.generate").client()
    assert await until(client, lambda: client.instance_ids() == [proc.instance_id], timeout=60)
    return client


async def run(client: Any, req: dict) -> tuple[list[int], dict]:
    """The stream's token ids and its terminal."""
    got, exc = await asyncio.wait_for(read_stream(await client.generate(req)), 300)
    assert exc is None, repr(exc)
    assert got and got[-1].get("finish_reason"), got
    return [t for out in got for t in out.get("token_ids") or []], got[-1]


async def prefill(client: Any, prompt: list[int]) -> dict:
    """The handoff of a prefill of ``prompt`` (max_tokens 1, as the frontend sends it)."""
    _, terminal = await run(client, request(prompt, 1, {"type": "decode_remotely"}))
    handoff = terminal.get("kv_handoff")
    assert handoff and handoff["type"] == "connector", terminal
    assert len(handoff["block_ids"]) == -(-len(prompt) // BLOCK), handoff
    return dict(handoff)


def pulls(proc: Proc) -> list[tuple[int, int]]:
    """(blocks, bytes) of each pull the worker's connector logged."""
    return [(int(b), int(n)) for b, n in
            re.findall(r"pulled (\d+) blocks \((\d+) bytes\)", proc.logs())]


async def test_disaggregated_greedy_output_equals_aggregated(workers, make_runtime):
    (pns, pproc), (dns, dproc) = workers["prefill"], workers["decode"]
    pclient = await client_for(make_runtime, pns, pproc)
    dclient = await client_for(make_runtime, dns, dproc)
    # Aggregated: an ordinary request (the prefill worker serves it as any worker would).
    reference, ref_terminal = await run(pclient, request(PROMPT, MAX_TOKENS))
    assert len(reference) == MAX_TOKENS, ref_terminal

    handoff = await prefill(pclient, PROMPT)
    before = pulls(dproc)
    tokens, terminal = await run(
        dclient, request(PROMPT, MAX_TOKENS, pulling(handoff))
    )
    assert tokens == reference
    assert terminal["finish_reason"] == "length", terminal
    # The decode worker pulled every block of the prompt (bytes > 0), and vLLM took the
    # pulled prompt as computed (all but the token it recomputes to sample the next).
    new = pulls(dproc)[len(before):]
    assert len(new) == 1 and new[0][0] == len(handoff["block_ids"]) and new[0][1] > 0, \
        dproc.logs()[-3000:]
    assert terminal["usage"]["cached_tokens"] >= len(PROMPT) - BLOCK, terminal

    # A second prompt, pulled as well; then its handoff used again: its blocks were released
    # after the pull, the prefill worker refuses it, and the decode worker prefills locally.
    other = [t + 1 for t in PROMPT]
    ref2, _ = await run(pclient, request(other, MAX_TOKENS))
    handoff2 = await prefill(pclient, other)
    ok, _ = await run(dclient, request(other, MAX_TOKENS, pulling(handoff2)))
    assert ok == ref2
    assert len(pulls(dproc)) == len(before) + 2
    # ``other``'s handoff again: the decode worker has ``other``'s full blocks cached now, and
    # pulls the last (partial) one, which the prefill worker released after the first pull:
    # refused, and ``other`` is prefilled locally.
    again, _ = await run(dclient, request(other, MAX_TOKENS, pulling(handoff2)))
    assert again == ref2
    assert "prefilling it locally" in dproc.logs(), dproc.logs()[-3000:]

    # A live handoff of another prompt (same length): not pulled (the prompt digest differs),
    # the remote blocks are released, and the prompt is prefilled locally.
    fourth = [t + 3 for t in PROMPT]
    ref4, _ = await run(pclient, request(fourth, MAX_TOKENS))
    handoff5 = await prefill(pclient, [t + 4 for t in PROMPT])
    npulls = len(pulls(dproc))
    tokens4, _ = await run(dclient, request(fourth, MAX_TOKENS, pulling(handoff5)))
    assert tokens4 == ref4
    assert len(pulls(dproc)) == npulls
    assert "the handoff's KV is not for this prompt" in dproc.logs()


async def test_expired_handoff_falls_back_to_local_prefill(workers, make_runtime):
    (pns, pproc), (dns, dproc) = workers["prefill"], workers["decode"]
    pclient = await client_for(make_runtime, pns, pproc)
    dclient = await client_for(make_runtime, dns, dproc)
    prompt = [(i * 53) % 240 + 7 for i in range(2 * BLOCK + 5)]
    reference, _ = await run(pclient, request(prompt, MAX_TOKENS))
    handoff = await prefill(pclient, prompt)
    rid = handoff["request_id"]
    # The prefill worker frees the blocks nobody pulled once their TTL is over.
    deadline = asyncio.get_running_loop().time() + TTL + 60
    while f"KV of request {rid} was not pulled in time" not in pproc.logs():
        assert asyncio.get_running_loop().time() < deadline, pproc.logs()[-3000:]
        await asyncio.sleep(0.5)
    failed_before = dproc.logs().count("prefilling it locally")
    tokens, terminal = await run(
        dclient, request(prompt, MAX_TOKENS, pulling(handoff))
    )
    assert tokens == reference, terminal
    assert dproc.logs().count("prefilling it locally") == failed_before + 1

    # A prefill worker gone (nothing listens at the handoff's address): no reply within the
    # pull's timeout, and the decode worker prefills locally.
    gone = [(i * 29) % 230 + 11 for i in range(BLOCK + 9)]
    reference, _ = await run(pclient, request(gone, MAX_TOKENS))
    handoff = {**await prefill(pclient, gone), "port": free_port()}
    tokens, _ = await run(dclient, request(gone, MAX_TOKENS, pulling(handoff)))
    assert tokens == reference
    assert dproc.logs().count("prefilling it locally") == failed_before + 2


def test_a_disaggregated_worker_with_several_ranks_is_refused(tiny_model):
    proc = Proc(["-m", "dynamo_zmq.worker", "--engine", "vllm", "--model-path", str(tiny_model),
                 "--namespace", f"t{uuid.uuid4().hex[:12]}", "--host", "127.0.0.1",
                 "--disaggregation-mode", "decode", "--data-parallel-size", "2", *WORKER_FLAGS],
                env=VLLM_ENV)
    try:
        assert proc.wait(WORKER_START) != 0
        assert "--disaggregation-mode decode with the vllm engine needs one rank: " \
               "data_parallel_size=2" in proc.logs(), proc.logs()[-3000:]
    finally:
        proc.stop()
