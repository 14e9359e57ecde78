"""The Batch API's HTTP routes (OpenAI's Files and Batches):

    POST   /v1/files                    upload a batch input file (multipart, purpose 'batch')
    GET    /v1/files                    list (``purpose``, ``limit``, ``after``, ``order``)
    GET    /v1/files/{id}               the File object
    GET    /v1/files/{id}/content       its bytes
    DELETE /v1/files/{id}               delete it (not the input of an unfinished batch)
    POST   /v1/batches                  create a batch (``input_file_id``, ``endpoint``,
                                        ``completion_window`` '24h', ``metadata``)
    GET    /v1/batches                  list, newest first (``limit``, ``after``)
    GET    /v1/batches/{id}             the Batch object
    POST   /v1/batches/{id}/cancel      cancel it

Errors are OpenAI's error object. The files and batches live on this frontend's disk
(``_batch_files.py``, ``_batch_runner.py``).
"""

from __future__ import annotations

import urllib.parse
from typing import Any, Protocol

import msgspec

from . import errors as http_errors
from ._asgi import Receive, Scope, Send, error, header, read_body, reply
from ._batch_files import check_new_file, storage_full
from ._batch_input import ENDPOINTS, parse_lines, parse_upload
from ._batch_runner import BatchRunner
from ._limits import HttpLimits
from ._tenants import Tenants
from .errors import HttpError, bad_request

__all__ = ["PREFIXES", "BatchHost", "serve_batch_api"]

#: The paths (and their subpaths) this module answers.
PREFIXES = ("/v1/files", "/v1/batches")
_OCTETS = [(b"content-type", b"application/octet-stream")]


class BatchHost(Protocol):
    """What the routes need of the app serving them (``FrontendApp`` is one)."""

    @property
    def batches(self) -> BatchRunner | None: ...

    @property
    def limits(self) -> HttpLimits: ...

    @property
    def tenants(self) -> Tenants | None: ...


async def serve_batch_api(app: BatchHost, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer a request under ``/v1/files`` or ``/v1/batches``."""
    try:
        runner = app.batches
        if runner is None:
            raise bad_request("the Batch API is off on this frontend process (it needs one "
                              "process per --batch-dir: not with --http-workers > 1)")
        runner.open()
        runner.expire()
        parts = scope["path"].rstrip("/").split("/")[2:]  # ["files", id, "content"]
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(
            scope.get("query_string", b"").decode("latin-1")).items()}
        if parts[0] not in ("files", "batches"):
            raise http_errors.not_found(f"no route {scope['path']}")
        handler = _FILES if parts[0] == "files" else _BATCHES
        key = (scope["method"], len(parts), parts[-1] if len(parts) == 3 else "")
        route = handler.get(key)
        if route is None:
            if not any(k[1:] == key[1:] for k in handler):
                raise http_errors.not_found(f"no route {scope['path']}")
            raise HttpError(405, "invalid_request_error",
                            f"{scope['method']} is not allowed on {scope['path']}")
        status, body, headers = await route(app, runner, parts[1:2], query, scope, receive)
    except HttpError as exc:
        await error(send, exc)
        return
    await reply(send, status, body, headers)


Answer = tuple[int, bytes, list[tuple[bytes, bytes]] | None]


def _json(value: Any) -> Answer:
    return 200, msgspec.json.encode(value), None


def _page(items: list[dict[str, Any]], query: dict[str, str], default_limit: int) -> Answer:
    """OpenAI's list object over ``items`` (in their order) after ``query['after']``."""
    try:
        limit = int(query.get("limit", default_limit))
    except ValueError:
        raise bad_request("'limit' must be an integer", param="limit") from None
    if not 1 <= limit <= 10000:
        raise bad_request("'limit' must be from 1 to 10000", param="limit")
    after = query.get("after")
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return _json({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                  "last_id": page[-1]["id"] if page else None,
                  "has_more": len(items) > limit})


async def _upload(app: BatchHost, runner: BatchRunner, _: list[str], __: dict[str, str],
                  scope: Scope, receive: Receive) -> Answer:
    store = runner.store
    # read (and refuse with a clean 413 below) bodies up to the store's size plus the usual
    # body limit; a larger one is refused unread (the connection closes)
    limits = HttpLimits(max_body=store.max_bytes + app.limits.max_body,
                        body_timeout=app.limits.body_timeout)
    try:
        body = await read_body(receive, scope, limits)
    except HttpError as exc:
        if exc.status != 413:
            raise
        full = storage_full(store.max_bytes + 1, store.max_bytes)
        full.close = True  # the body was left unread
        raise full from None
    upload = parse_upload(header(scope, b"content-type"), body)
    check_new_file(store, len(upload.content))
    parse_lines(upload.content)
    return _json(store.add(upload.filename, upload.purpose, upload.content))


async def _list_files(app: BatchHost, runner: BatchRunner, _: list[str],
                      query: dict[str, str], scope: Scope, receive: Receive) -> Answer:
    files = runner.store.list(query.get("purpose"))
    if query.get("order", "desc") == "asc":
        files.reverse()
    return _page(files, query, 10000)


async def _file(app: BatchHost, runner: BatchRunner, ids: list[str], _: dict[str, str],
                scope: Scope, receive: Receive) -> Answer:
    return _json(runner.store.get(ids[0]))


async def _content(app: BatchHost, runner: BatchRunner, ids: list[str], _: dict[str, str],
                   scope: Scope, receive: Receive) -> Answer:
    return 200, runner.store.content(ids[0]), _OCTETS


async def _delete_file(app: BatchHost, runner: BatchRunner, ids: list[str],
                       _: dict[str, str], scope: Scope, receive: Receive) -> Answer:
    file_id = ids[0]
    runner.store.get(file_id)
    if file_id in runner.active_inputs():
        raise bad_request(f"file {file_id} is the input of a batch that is not over; cancel "
                          "it or wait for it", param="file_id")
    runner.store.delete(file_id)
    return _json({"id": file_id, "object": "file", "deleted": True})


async def _create(app: BatchHost, runner: BatchRunner, _: list[str], __: dict[str, str],
                  scope: Scope, receive: Receive) -> Answer:
    try:
        req = msgspec.json.decode(await read_body(receive, scope, app.limits))
    except msgspec.DecodeError as exc:
        raise bad_request(f"the body is not JSON: {exc}") from None
    if not isinstance(req, dict):
        raise bad_request("the body must be a JSON object")
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(req.get(name), str):
            raise bad_request(f"'{name}' is required (a string)", param=name)
    unknown = set(req) - {"input_file_id", "endpoint", "completion_window", "metadata",
                          "output_expires_after"}
    if unknown:
        raise bad_request(f"unknown parameters {sorted(unknown)}", param=sorted(unknown)[0],
                          code="unknown_parameter")
    endpoint = req["endpoint"]
    if endpoint not in ENDPOINTS:
        raise bad_request(f"'endpoint' must be one of {', '.join(ENDPOINTS)}, not {endpoint!r}",
                          param="endpoint", code="invalid_value")
    if req["completion_window"] != "24h":
        raise bad_request("'completion_window' must be '24h'", param="completion_window",
                          code="invalid_value")
    metadata = req.get("metadata")
    if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items())):
        raise bad_request("'metadata' is at most 16 string keys (64 characters) and string "
                          "values (512 characters)", param="metadata")
    meta = runner.store.get(req["input_file_id"])
    if meta["purpose"] != "batch":
        raise bad_request(f"file {meta['id']} has purpose {meta['purpose']!r}, not 'batch'",
                          param="input_file_id")
    lines = parse_lines(runner.store.content(meta["id"]))
    for line in lines:
        if line.url != endpoint:
            raise bad_request(f"line {line.number}: 'url' {line.url!r} is not the batch's "
                              f"endpoint {endpoint!r}", param="endpoint",
                              code="invalid_batch_line")
    tenant = None
    if app.tenants is not None:
        tenant = app.tenants.identify(scope, app.tenants.limits.current())
    return _json(runner.create(meta["id"], endpoint, metadata, tenant, lines).obj)


async def _list_batches(app: BatchHost, runner: BatchRunner, _: list[str],
                        query: dict[str, str], scope: Scope, receive: Receive) -> Answer:
    batches = sorted(runner.batches.values(), key=lambda b: b.created, reverse=True)
    return _page([b.obj for b in batches], query, 20)


async def _batch(app: BatchHost, runner: BatchRunner, ids: list[str], _: dict[str, str],
                 scope: Scope, receive: Receive) -> Answer:
    return _json(runner.get(ids[0]).obj)


async def _cancel(app: BatchHost, runner: BatchRunner, ids: list[str], _: dict[str, str],
                  scope: Scope, receive: Receive) -> Answer:
    return _json(runner.cancel(ids[0]).obj)


_FILES = {("POST", 1, ""): _upload, ("GET", 1, ""): _list_files, ("GET", 2, ""): _file,
          ("DELETE", 2, ""): _delete_file, ("GET", 3, "content"): _content}
_BATCHES = {("POST", 1, ""): _create, ("GET", 1, ""): _list_batches, ("GET", 2, ""): _batch,
            ("POST", 3, "cancel"): _cancel}
