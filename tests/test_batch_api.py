"""OpenAI's Batch API (``/v1/files``, ``/v1/batches``) through real frontends and mocker
workers, with the ``openai`` client's ``files`` and ``batches`` calls.

Shown: batches of chat, embedding and responses requests end ``completed`` with one output line
per input (by ``custom_id``) and a failed line in the error file; bad JSONL and bad batches are
400s naming what is wrong; a cancelled batch ends ``cancelled`` with the lines answered before
kept; the frontend never has more than ``--batch-concurrency`` lines in flight; an interactive
request is served before a batch line that was waiting first (the lines' lowest priority); a
frontend SIGKILLed mid-batch and started again on the same ``--batch-dir`` finishes the batch
without sending a line answered before again; uploads over ``--batch-max-bytes`` are 413s, and
files go after ``--batch-retention``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from pathlib import Path

import openai
import pytest

from tests.support.metrics import metrics_page, sample
from tests.support.mocker_fleet import start_frontend, start_mocker
from tests.support.procs import Proc
from tests.support.waiting import eventually, serving, wait_models

CHAT = "/v1/chat/completions"
CONCURRENCY = 2


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(custom_id: str, model: str = "tiny", max_tokens: int = 4) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                     "messages": [{"role": "user", "content": f"say {custom_id}"}]}}


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    """A fast mocker ('tiny', with embeddings), a slow one ('slow': real time, one sequence
    at a time, its queue in priority order) and a frontend with ``--batch-concurrency 2``:
    (its URL, the namespace, a scratch directory)."""
    tmp = tmp_path_factory.mktemp("batch")
    namespace = f"t{uuid.uuid4().hex[:12]}"
    procs: list[Proc] = []

    def spawn(*args: str, env=None, ready=True) -> Proc:
        proc = Proc(list(args), env=env)
        procs.append(proc)
        return proc.wait_ready() if ready else proc

    try:
        fast = start_mocker(spawn, namespace, tiny_model, "--mock-embedding-dim", "8")
        slow = start_mocker(spawn, namespace, tiny_model, "--scheduling-policy", "priority",
                            "--max-num-seqs", "1", model="slow", speedup="1")
        front = start_frontend(spawn, namespace, "--batch-dir", str(tmp / "a"),
                               "--batch-concurrency", str(CONCURRENCY))
        asyncio.run(serving(front, [fast], "tiny"))
        asyncio.run(serving(front, [slow], "slow"))
        yield front.address, namespace, tmp
    finally:
        for proc in procs:
            proc.stop()


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


async def upload(client: openai.AsyncOpenAI, lines: list[dict]) -> str:
    return (await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")).id


async def finished(client: openai.AsyncOpenAI, batch_id: str, timeout: float = 60.0):
    async def over():
        batch = await client.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "cancelled", "expired") else None
    return await eventually(over, timeout, f"batch {batch_id} over")


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


async def test_chat_and_embedding_batches_answer_every_line(stack):
    url, _, _ = stack
    async with client_for(url) as client:
        chat = [chat_line(f"c{i}") for i in range(4)] + [chat_line("lost", model="nope")]
        input_id = await upload(client, chat)
        meta = await client.files.retrieve(input_id)
        assert (meta.purpose, meta.filename, meta.bytes) == ("batch", "in.jsonl",
                                                            len(jsonl(chat)))
        assert (await client.files.content(input_id)).content == jsonl(chat)
        batch = await client.batches.create(input_file_id=input_id, endpoint=CHAT,
                                            completion_window="24h", metadata={"job": "t"})
        assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "t"}
        done = await finished(client, batch.id)
        assert done.status == "completed" and done.completed_at and done.in_progress_at
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (5, 4, 1)
        out = await lines_of(client, done.output_file_id)
        assert [o["custom_id"] for o in out] == ["c0", "c1", "c2", "c3"]
        for o in out:
            assert o["error"] is None and o["response"]["status_code"] == 200
            body = o["response"]["body"]
            assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
        errs = await lines_of(client, done.error_file_id)
        assert [(e["custom_id"], e["response"]["status_code"]) for e in errs] == [("lost", 404)]
        assert errs[0]["response"]["body"]["error"]["code"] == "model_not_found"

        embed = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "tiny", "input": f"text {i}"}} for i in range(3)]
        ebatch = await client.batches.create(input_file_id=await upload(client, embed),
                                             endpoint="/v1/embeddings", completion_window="24h")
        edone = await finished(client, ebatch.id)
        assert edone.status == "completed" and edone.error_file_id is None
        eout = await lines_of(client, edone.output_file_id)
        assert [o["custom_id"] for o in eout] == ["e0", "e1", "e2"]
        assert all(o["response"]["body"]["data"][0]["embedding"] for o in eout)

        responses = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                      "body": {"model": "tiny", "input": f"hi {i}", "max_output_tokens": 3}}
                     for i in range(2)]
        rbatch = await client.batches.create(input_file_id=await upload(client, responses),
                                             endpoint="/v1/responses", completion_window="24h")
        rdone = await finished(client, rbatch.id)
        rout = await lines_of(client, rdone.output_file_id)
        assert [(o["custom_id"], o["response"]["body"]["object"]) for o in rout] == [
            ("r0", "response"), ("r1", "response")]
        assert rout[0]["response"]["request_id"] == rout[0]["response"]["body"]["id"]

        listed = [b.id async for b in client.batches.list(limit=1)]
        assert listed[:3] == [rbatch.id, ebatch.id, batch.id]
        assert done.output_file_id in {f.id async for f in client.files.list()}
        deleted = await client.files.delete(done.output_file_id)
        assert deleted.deleted
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(done.output_file_id)


@pytest.mark.parametrize(("lines", "words"), [
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
     b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n',
     ["line 2", "custom_id", "unique"]),
    (b'\n{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}\n',
     ["line 2", "method"]),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
     b"{not json\n", ["line 2", "JSON"]),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/images", "body": {}}\n',
     ["line 1", "url"]),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": []}\n',
     ["line 1", "body"]),
])
async def test_bad_jsonl_is_a_400_naming_the_line(stack, lines, words):
    async with client_for(stack[0]) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.files.create(file=("bad.jsonl", lines), purpose="batch")
        message = info.value.body["message"]
        assert all(w in message for w in words), message


async def test_bad_batches_and_files_are_refused(stack):
    async with client_for(stack[0]) as client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.files.create(file=("x.jsonl", jsonl([chat_line("a")])),
                                      purpose="fine-tune")
        assert info.value.body["param"] == "purpose"
        input_id = await upload(client, [chat_line("a"), chat_line("b")])
        with pytest.raises(openai.BadRequestError) as info:
            await client.batches.create(input_file_id=input_id, endpoint="/v1/embeddings",
                                        completion_window="24h")
        assert "line 1" in info.value.body["message"]
        with pytest.raises(openai.BadRequestError) as info:
            await client.batches.create(input_file_id=input_id, endpoint=CHAT,
                                        completion_window="1h")  # type: ignore[arg-type]
        assert info.value.body["param"] == "completion_window"
        with pytest.raises(openai.NotFoundError):
            await client.batches.create(input_file_id="file-nope", endpoint=CHAT,
                                        completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_nope")
        batch = await client.batches.create(input_file_id=input_id, endpoint=CHAT,
                                            completion_window="24h")
        await finished(client, batch.id)
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(batch.id)


async def test_cancel_keeps_the_answered_lines_and_concurrency_is_bounded(stack):
    url = stack[0]
    async with client_for(url) as client:
        lines = [chat_line(f"s{i}", model="slow", max_tokens=150) for i in range(12)]
        batch = await client.batches.create(input_file_id=await upload(client, lines),
                                            endpoint=CHAT, completion_window="24h")

        async def some_answered():
            b = await client.batches.retrieve(batch.id)
            return b.request_counts and b.request_counts.completed >= 2
        await eventually(some_answered, 60, "two lines answered")
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
        done = await finished(client, batch.id)
        assert done.status == "cancelled" and done.cancelled_at
        out = await lines_of(client, done.output_file_id)
        assert 2 <= len(out) == done.request_counts.completed < 12
        assert len({o["custom_id"] for o in out}) == len(out)
        assert all(o["response"]["body"]["usage"]["completion_tokens"] == 150 for o in out)
    peak = sample(await metrics_page(url), "dynamo_frontend_batch_requests_in_flight_peak")
    assert peak == CONCURRENCY


async def test_interactive_requests_go_before_batch_lines(stack):
    """Two batch lines reach the one-at-a-time slow mocker (one runs, one waits); a chat
    request sent while the first runs is served before the second (the batch's lowest
    priority), so it is answered while the batch has one line answered."""
    url = stack[0]
    async with client_for(url) as client:
        lines = [chat_line(f"p{i}", model="slow", max_tokens=300) for i in range(2)]
        batch = await client.batches.create(input_file_id=await upload(client, lines),
                                            endpoint=CHAT, completion_window="24h")

        async def both_sent():
            page = await metrics_page(url)
            return sample(page, "dynamo_frontend_batch_requests_in_flight") == 2
        await eventually(both_sent, 30, "both lines in flight")
        chat = await client.chat.completions.create(
            model="slow", max_tokens=5, messages=[{"role": "user", "content": "now"}])
        assert chat.usage.completion_tokens == 5
        counts = (await client.batches.retrieve(batch.id)).request_counts
        assert counts.completed == 1
        assert (await finished(client, batch.id)).request_counts.completed == 2


def progress_ids(batch_dir: Path, batch_id: str) -> dict[str, str]:
    """custom_id: output line id, of the lines the progress file holds (complete lines)."""
    raw = (batch_dir / "batches" / f"{batch_id}.progress.jsonl").read_bytes()
    found = {}
    for chunk in raw.split(b"\n")[:-1]:
        out = json.loads(chunk)["out"]
        found[out["custom_id"]] = out["id"]
    return found


async def test_a_batch_survives_its_frontend_killed_mid_way(stack, spawn):
    _, namespace, tmp = stack
    batch_dir = tmp / "killed"
    flags = ("--batch-dir", str(batch_dir), "--batch-concurrency", str(CONCURRENCY))
    front = start_frontend(spawn, namespace, *flags, ready=True)
    await wait_models(front.address, {"slow"})
    lines = [chat_line(f"k{i}", model="slow", max_tokens=60) for i in range(10)]
    async with client_for(front.address) as client:
        batch = await client.batches.create(input_file_id=await upload(client, lines),
                                            endpoint=CHAT, completion_window="24h")

        async def some_answered():
            b = await client.batches.retrieve(batch.id)
            return b.request_counts and b.request_counts.completed >= 3
        await eventually(some_answered, 60, "three lines answered")
    front.signal(signal.SIGKILL)
    front.wait()
    before = progress_ids(batch_dir, batch.id)
    assert 3 <= len(before) < 10
    again = start_frontend(spawn, namespace, *flags, ready=True)
    await wait_models(again.address, {"slow"})
    async with client_for(again.address) as client:
        done = await finished(client, batch.id)
        assert done.status == "completed"
        assert (done.request_counts.completed, done.request_counts.failed) == (10, 0)
        out = await lines_of(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"k{i}" for i in range(10)]
    kept = {o["custom_id"]: o["id"] for o in out}
    assert {k: kept[k] for k in before} == before  # answered before the kill: not sent again


async def test_size_bound_retention_and_tenant(stack, spawn):
    """Uploads over ``--batch-max-bytes`` are 413s; a batch's lines count for the tenant that
    created it; files and finished batches are deleted after ``--batch-retention``."""
    _, namespace, tmp = stack
    limits = tmp / "tenants.toml"
    limits.write_text("[tenants.batchy]\nrequests_per_second = 1000\n")
    front = start_frontend(spawn, namespace, "--batch-dir", str(tmp / "small"),
                           "--batch-max-bytes", "6000", "--batch-retention", "2s",
                           "--tenant-limits", str(limits), ready=True)
    await wait_models(front.address, {"tiny"})
    async with client_for(front.address) as client:
        big = [chat_line(f"b{i}") for i in range(60)]
        with pytest.raises(openai.APIStatusError) as info:
            await upload(client, big)
        assert info.value.status_code == 413
        assert info.value.body["code"] == "storage_limit_exceeded"
        file_id = await upload(client, [chat_line("r1"), chat_line("r2")])
        assert (await client.files.retrieve(file_id)).expires_at is not None
        batch = await client.batches.create(input_file_id=file_id, endpoint=CHAT,
                                            completion_window="24h",
                                            extra_headers={"x-dynamo-tenant": "batchy"})
        done = await finished(client, batch.id)
        assert done.request_counts.completed == 2
        page = await metrics_page(front.address)
        assert sample(page, "dynamo_frontend_tenant_requests_total", tenant="batchy",
                      outcome="success") == 2

        async def gone():
            for look, what in ((client.files.retrieve, file_id),
                               (client.batches.retrieve, batch.id)):
                try:
                    await look(what)
                except openai.NotFoundError:
                    continue
                return False
            return True
        await eventually(gone, 15, "the file and the batch deleted after their retention")
