"""What the Batch API reads from a client: a ``multipart/form-data`` upload (``POST /v1/files``)
and a batch input file's JSONL lines, each checked as OpenAI checks them (a bad line is a 400
naming its line number)."""

from __future__ import annotations

import email.parser
import email.policy
from dataclasses import dataclass
from typing import Any

import msgspec

from .errors import bad_request

__all__ = ["ENDPOINTS", "BatchLine", "Upload", "parse_lines", "parse_upload"]

#: The endpoints a batch's lines may call (each line's ``url``; the batch's ``endpoint``).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


@dataclass(frozen=True)
class Upload:
    """A file upload's parts."""

    filename: str
    purpose: str
    content: bytes


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch input file (``number``: its 1-based line number)."""

    number: int
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_upload(content_type: bytes | None, body: bytes) -> Upload:
    """The ``file`` and ``purpose`` parts of a ``multipart/form-data`` body.

    Raises:
        HttpError: 400 for another content type, a body that is not multipart, or a missing
            part.
    """
    kind = (content_type or b"").decode("latin-1")
    if not kind.lower().startswith("multipart/form-data"):
        raise bad_request("POST /v1/files takes multipart/form-data with the parts 'file' and "
                          f"'purpose' (got content type {kind or 'none'!r})")
    head = f"Content-Type: {kind}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise bad_request("the multipart/form-data body could not be read")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            fields[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    if "file" not in fields:
        raise bad_request("missing the multipart part 'file'", param="file")
    if "purpose" not in fields:
        raise bad_request("missing the multipart part 'purpose'", param="purpose")
    purpose = fields["purpose"][1].decode("utf-8", "replace").strip()
    if purpose != "batch":
        raise bad_request(f"this server stores files for purpose 'batch' only, not {purpose!r}",
                          param="purpose", code="invalid_value")
    filename, content = fields["file"]
    return Upload(filename or "upload.jsonl", purpose, content)


def _line_error(number: int, message: str, param: str | None = None) -> Exception:
    return bad_request(f"line {number}: {message}", param=param, code="invalid_batch_line")


def _check(number: int, item: Any, seen: set[str]) -> BatchLine:
    if not isinstance(item, dict):
        raise _line_error(number, "a line must be a JSON object")
    unknown = set(item) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise _line_error(number, f"unknown fields {sorted(unknown)}")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _line_error(number, "'custom_id' must be a non-empty string", "custom_id")
    if custom_id in seen:
        raise _line_error(number, f"'custom_id' {custom_id!r} is not unique", "custom_id")
    if item.get("method") != "POST":
        raise _line_error(number, "'method' must be 'POST'", "method")
    url = item.get("url")
    if url not in ENDPOINTS:
        raise _line_error(number, f"'url' must be one of {', '.join(ENDPOINTS)}, not {url!r}",
                          "url")
    body = item.get("body")
    if not isinstance(body, dict):
        raise _line_error(number, "'body' must be a JSON object", "body")
    if body.get("stream"):
        raise _line_error(number, "a batch request cannot stream ('body.stream' must not be "
                          "true)", "body.stream")
    seen.add(custom_id)
    return BatchLine(number, custom_id, url, body)


def parse_lines(content: bytes) -> list[BatchLine]:
    """The requests of a batch input file (blank lines skipped).

    Raises:
        HttpError: 400 naming the first bad line: not UTF-8 JSON, not an object, fields
            missing or wrong (``custom_id`` unique, ``method`` POST, ``url`` one of
            ``ENDPOINTS``, ``body`` an object, not streaming), or a file with no request.
    """
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            item = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise _line_error(number, f"not valid JSON ({exc})") from None
        lines.append(_check(number, item, seen))
    if not lines:
        raise bad_request("the file holds no request (one JSON object a line)", param="file",
                          code="invalid_batch_line")
    return lines
