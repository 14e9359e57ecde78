"""The frontend's API keys and TLS (issue 16 item 4), through a real frontend and mocker worker
with the real ``openai`` client (and raw HTTP where a client would add a key itself)."""

from __future__ import annotations

import asyncio
import datetime
import http.client
import ipaddress
import json
import ssl
import urllib.error
import urllib.request

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.metrics import sample
from tests.support.mocker_fleet import start_frontend, start_worker
from tests.support.waiting import wait_models

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def call(url, path, key=None, body=None, context=None):
    """(status, JSON body or text) of a GET (no body) or POST, with ``Bearer key`` if given."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


async def test_api_keys_from_flags_env_and_file(namespace, spawn, tiny_model, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nfile-key-1\n")
    start_worker(spawn, namespace, tiny_model, ready=True)
    url = start_frontend(spawn, namespace, "--api-key", "flag-key", "--api-key-file",
                         str(key_file), env={"DYN_API_KEYS": "env-key-a,env-key-b"}, mode=None,
                         ready=True).address
    await wait_models_with_key(url, "flag-key")

    # Every configured key serves, through the real openai client.
    for key in ("flag-key", "env-key-a", "env-key-b", "file-key-1"):
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as c:
            resp = await c.chat.completions.create(**CHAT)
            assert resp.choices[0].finish_reason == "length", key

    # A wrong key is OpenAI's AuthenticationError (401 in its error shape).
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as info:
            await c.chat.completions.create(**CHAT)
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    assert info.value.body["type"] == "invalid_request_error"

    # No key, or not a Bearer one: 401 with a message saying what to send; every API route.
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/models", None),
                       ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})):
        status, answer = await asyncio.to_thread(call, url, path, None, body)
        assert status == 401, (path, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        assert "Authorization" in answer["error"]["message"]

    # Health, liveness and metrics stay open to probes and scrapers by default.
    for path in ("/health", "/live", "/metrics"):
        status, _ = await asyncio.to_thread(call, url, path)
        assert status == 200, path
    _, page = await asyncio.to_thread(call, url, "/metrics")
    assert sample(page, "dynamo_frontend_unauthorized_requests_total") == 4

    # The key file is re-read when it changes: a new key works, a removed one is refused.
    key_file.write_text("file-key-2\n")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (await asyncio.to_thread(call, url, "/v1/models", "file-key-2"))[0] != 200:
        assert loop.time() < deadline, "the new key in the key file was never accepted"
        await asyncio.sleep(0.2)
    assert (await asyncio.to_thread(call, url, "/v1/models", "file-key-1"))[0] == 401
    assert (await asyncio.to_thread(call, url, "/v1/models", "flag-key"))[0] == 200


async def test_exempt_routes_are_configurable(namespace, spawn, tiny_model):
    start_worker(spawn, namespace, tiny_model, ready=True)
    url = start_frontend(spawn, namespace, "--api-key", "k", "--api-key-exempt", "/live",
                         mode=None, ready=True).address
    await wait_models_with_key(url, "k")
    assert (await asyncio.to_thread(call, url, "/live"))[0] == 200
    assert (await asyncio.to_thread(call, url, "/metrics"))[0] == 401
    assert (await asyncio.to_thread(call, url, "/health"))[0] == 401
    assert (await asyncio.to_thread(call, url, "/metrics", "k"))[0] == 200


async def test_without_keys_the_frontend_is_open(namespace, spawn, tiny_model):
    start_worker(spawn, namespace, tiny_model, ready=True)
    url = start_frontend(spawn, namespace, mode=None, ready=True).address
    await wait_models(url, {"tiny"})
    status, answer = await asyncio.to_thread(call, url, "/v1/chat/completions", None, CHAT)
    assert status == 200, answer
    status, answer = await asyncio.to_thread(call, url, "/v1/chat/completions", "any", CHAT)
    assert status == 200, answer


def self_signed(tmp_path):
    """A self-signed certificate for 127.0.0.1 and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dynamo-zmq test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_file.chmod(0o600)
    return cert_file, key_file


async def test_tls_with_api_key(namespace, spawn, tiny_model, tmp_path):
    cert, key = self_signed(tmp_path)
    start_worker(spawn, namespace, tiny_model, ready=True)
    url = start_frontend(spawn, namespace, "--tls-cert-file", str(cert), "--tls-key-file",
                         str(key), "--api-key", "secret", mode=None, ready=True).address
    assert url.startswith("https://")
    trusted = ssl.create_default_context(cafile=str(cert))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while "tiny" not in str((await asyncio.to_thread(call, url, "/v1/models", "secret", None,
                                                     trusted))[1]):
        assert loop.time() < deadline
        await asyncio.sleep(0.2)
    async with httpx.AsyncClient(verify=trusted) as https_client, openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="secret", max_retries=0, http_client=https_client
    ) as client:
        resp = await client.chat.completions.create(**CHAT, stream=True)
        chunks = [chunk async for chunk in resp]
        assert chunks[-1].choices[0].finish_reason == "length"
    # A client that does not trust the certificate is refused by its own TLS check.
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(call, url, "/live")
    # Plain HTTP to the TLS port gets no HTTP answer (URLError is an OSError).
    plain = url.replace("https://", "http://")
    with pytest.raises((OSError, http.client.HTTPException)):
        await asyncio.to_thread(call, plain, "/live")


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert-file", "/nonexistent/cert.pem"], "--tls-cert-file and --tls-key-file go"),
    (["--tls-cert-file", "/nonexistent/c.pem", "--tls-key-file", "/nonexistent/k.pem"],
     "cannot load the TLS certificate"),
    (["--api-key-file", "/nonexistent/keys"], "cannot read the API key file"),
    (["--api-key", ""], "API key must be non-empty"),
    (["--api-key-exempt", "health"], "must start with '/'"),
])
def test_bad_security_flags_are_one_clear_line(spawn, namespace, flags, message):
    proc = spawn("-m", "dynamo_zmq.frontend", "--http-port", "0", "--namespace", namespace,
                 *flags, ready=False)
    assert proc.wait(timeout=30) == 2
    logs = proc.logs()
    assert message in logs and "Traceback" not in logs, logs


async def wait_models_with_key(url, key, timeout=30.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while "tiny" not in str((await asyncio.to_thread(call, url, "/v1/models", key))[1]):
        assert loop.time() < deadline, "the model never appeared"
        await asyncio.sleep(0.2)
