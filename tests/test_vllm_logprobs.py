"""Logprobs from the vLLM engine through our frontend and worker equal vLLM's own OpenAI server's
for the same greedy request (token texts and bytes exactly, values to 1e-4): chat and
completions, streaming and not, with and without alternatives, and cut by a stop string.

Runs only where vLLM is installed (skipped otherwise, failed in CI: see tests/test_vllm.py).
"""

from __future__ import annotations

import socket
import time
import uuid

import pytest

import tests.support.needs_vllm  # noqa: F401  (skips this module without vLLM; fails it in CI)

# isort: split

import openai

from tests.support.procs import Proc
from tests.support.vllm_stack import MAX_MODEL_LEN, VLLM_ENV, WORKER_FLAGS, WORKER_START

pytestmark = [pytest.mark.timeout(600)]

MESSAGES = [{"role": "user", "content": "Once upon a time there was a worker"}]
PROMPT = "The worker engine said that"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _wait_models(client: openai.OpenAI, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if "tiny" in {m.id for m in client.models.list().data}:
                return
        except openai.APIConnectionError:
            pass
        assert proc.running, f"exited before serving:\n{proc.logs()[-3000:]}"
        assert time.monotonic() < deadline, f"never served 'tiny':\n{proc.logs()[-3000:]}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def clients(tiny_model):
    """(ours, vLLM's): our frontend in front of one vLLM worker, and vLLM's own OpenAI server,
    both serving the tiny model as 'tiny'."""
    namespace = f"t{uuid.uuid4().hex[:12]}"
    procs: list[Proc] = []
    try:
        worker = Proc(["-m", "dynamo_zmq.worker", "--engine", "vllm",
                       "--model-path", str(tiny_model), "--model-name", "tiny",
                       "--namespace", namespace, "--host", "127.0.0.1", *WORKER_FLAGS],
                      env=VLLM_ENV)
        procs.append(worker)
        port = _free_port()
        server = Proc(["-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
                       "--served-model-name", "tiny", "--max-model-len", str(MAX_MODEL_LEN),
                       "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)],
                      env=VLLM_ENV)
        procs.append(server)
        front = Proc(["-m", "dynamo_zmq.frontend", "--http-port", "0",
                      "--namespace", namespace])
        procs.append(front)
        worker.wait_ready(WORKER_START)
        front.wait_ready(60)
        with _client(front.address) as ours, _client(f"http://127.0.0.1:{port}") as theirs:
            _wait_models(ours, front, 60)
            _wait_models(theirs, server, WORKER_START)
            yield ours, theirs
    finally:
        for proc in procs:
            proc.stop()


def same(ours, theirs, path: str = "") -> None:
    """Equal JSON values, floats to 1e-4."""
    if isinstance(theirs, float) or isinstance(ours, float):
        assert ours == pytest.approx(theirs, abs=1e-4), path
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), (path, ours, theirs)
        for key in theirs:
            same(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), (path, ours, theirs)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            same(a, b, f"{path}[{i}]")
    else:
        assert ours == theirs, (path, ours, theirs)


def _chat_logprobs(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, list]:
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, **kwargs)
    if not stream:
        resp = client.chat.completions.create(**kwargs)
        return resp.choices[0].message.content, resp.choices[0].logprobs.model_dump()["content"]
    text, content = "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.model_dump()["content"]
    return text, content


def _completion_logprobs(client: openai.OpenAI, stream: bool, **kwargs) -> tuple[str, dict]:
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, **kwargs)
    if not stream:
        resp = client.completions.create(**kwargs)
        return resp.choices[0].text, resp.choices[0].logprobs.model_dump()
    text = ""
    merged: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                               "top_logprobs": []}
    for chunk in client.completions.create(**kwargs, stream=True):
        if chunk.choices:
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs is not None:
                for key, values in chunk.choices[0].logprobs.model_dump().items():
                    merged[key] += values or []
    return text, merged


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("top", [None, 0, 5])
def test_chat_logprobs_equal_vllm(clients, stream, top):
    ours, theirs = clients
    kwargs = {"logprobs": True} if top is None else {"logprobs": True, "top_logprobs": top}
    text, content = _chat_logprobs(ours, stream, **kwargs)
    want_text, want = _chat_logprobs(theirs, stream, **kwargs)
    assert text == want_text and content
    same(content, want)
    assert all(len(e["top_logprobs"]) == (top or 0) for e in content)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("k", [0, 3])
def test_completion_logprobs_equal_vllm(clients, stream, k):
    ours, theirs = clients
    text, lp = _completion_logprobs(ours, stream, logprobs=k)
    want_text, want = _completion_logprobs(theirs, stream, logprobs=k)
    assert text == want_text and lp["tokens"]
    same(lp, want)


def test_stop_string_logprobs_equal_vllm(clients):
    """A stop string cuts the text; the logprobs list the tokens up to the one completing it,
    as vLLM's do."""
    ours, theirs = clients
    full, _ = _completion_logprobs(theirs, False, logprobs=2)
    stop = full.split()[2] if len(full.split()) > 3 else full[len(full) // 2 :][:3]
    text, lp = _completion_logprobs(ours, False, logprobs=2, stop=[stop])
    want_text, want = _completion_logprobs(theirs, False, logprobs=2, stop=[stop])
    assert text == want_text and stop not in text
    same(lp, want)


def test_token_texts_equal_vllms_on_split_characters(tiny_model):
    """The worker's token texts equal vLLM's own (its ``LogprobsProcessor``) for text whose
    characters span several byte-level tokens, for the sampled tokens and alternatives."""
    import numpy as np
    from tokenizers import Tokenizer
    from vllm.logprobs import create_sample_logprobs
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    from dynamo_zmq.llm._logprobs import TokenTexts

    ours = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = ours.encode("héllo wörld, 日本語 naïve ☃ café <s>", add_special_tokens=False).ids
    assert any(ours.decode([t]).endswith("\ufffd") for t in ids)  # split characters
    vllm_proc = LogprobsProcessor(
        tokenizer=get_tokenizer(str(tiny_model)), logprobs=create_sample_logprobs(False),
        prompt_logprobs=None, cumulative_logprob=0.0, num_logprobs=2, num_prompt_logprobs=None,
    )
    texts = TokenTexts(ours)
    for i, token in enumerate(ids):
        alts = [ids[(i + 1) % len(ids)], ids[i - 1], 1]  # neighbours, a special token
        alts = [t for t in dict.fromkeys(alts) if t != token][:2]
        row = [token, *alts]
        vllm_proc._update_sample_logprobs(LogprobsLists(
            np.array([row]), np.array([[-0.5 - j for j in range(len(row))]]), np.array([5]),
        ))
        want = [lp.decoded_token for lp in vllm_proc.logprobs[-1].values()]
        assert texts.step(token, [(t, 0.0) for t in alts]) == want, (i, token)


# -- prompt logprobs (issue 36 item 5) -----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("k", [0, 2])
def test_echo_with_logprobs_equals_vllm(clients, stream, k):
    """``echo`` with ``logprobs``: the prompt's text, then its tokens' logprobs (the first
    token's None) before the completion's, as vLLM's server gives them, streamed and not; not
    streamed, each choice also carries ``prompt_logprobs`` as vLLM's does."""
    ours, theirs = clients
    text, lp = _completion_logprobs(ours, stream, logprobs=k, echo=True)
    want_text, want = _completion_logprobs(theirs, stream, logprobs=k, echo=True)
    assert text == want_text and text.startswith(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) > 16
    same(lp, want)
    if not stream:
        kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                      logprobs=k)
        got = ours.completions.create(**kwargs).choices[0].model_extra["prompt_logprobs"]
        same(got, theirs.completions.create(**kwargs).choices[0].model_extra["prompt_logprobs"])


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_vllm(clients, k):
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) its logprob, rank and
    text and its ``k`` best alternatives', on the completions choice and at the top of a chat
    response, as vLLM's server gives them; the completion itself is unchanged."""
    ours, theirs = clients
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                  extra_body={"prompt_logprobs": k})
    got, want = ours.completions.create(**kwargs), theirs.completions.create(**kwargs)
    assert got.choices[0].text == want.choices[0].text
    field = got.choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == got.usage.prompt_tokens
    assert all(k <= len(pos) <= k + 1 for pos in field[1:])
    same(field, want.choices[0].model_extra["prompt_logprobs"])
    chat = dict(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                extra_body={"prompt_logprobs": k})
    got_chat = ours.chat.completions.create(**chat)
    want_chat = theirs.chat.completions.create(**chat)
    assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
    same(got_chat.model_extra["prompt_logprobs"], want_chat.model_extra["prompt_logprobs"])
