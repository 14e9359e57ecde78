"""Plain HTTP calls for tests that talk to a frontend's or a worker's HTTP port."""

from __future__ import annotations

import urllib.error
import urllib.request


def get(url: str) -> tuple[int, bytes]:
    """``GET url``: the status and the body, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get_text(url: str, timeout: float = 5.0) -> str:
    """``GET url``: the body as text; an error status raises ``urllib.error.HTTPError``."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def post(url: str, body: bytes) -> tuple[int, bytes]:
    """``POST url`` with a JSON body: the status and the body, error statuses included."""
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
