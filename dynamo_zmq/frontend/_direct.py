"""``direct`` routing mode's instance choice: the request names the instance to send to in the
``x-worker-instance-id`` header (hex id, as ``python -m dynamo_zmq status`` lists it)."""

from __future__ import annotations

from . import errors as http_errors
from ._asgi import Scope, header

__all__ = ["WORKER_HEADER", "direct_target"]

#: Request header naming the instance (hex id) to send to in ``direct`` routing mode.
WORKER_HEADER = b"x-worker-instance-id"


def direct_target(scope: Scope, mode: str) -> int | None:
    """The instance a ``direct``-mode request names (``x-worker-instance-id``, hex); None in
    any other routing ``mode``.

    Raises:
        HttpError: 400, the header is missing or not a hex instance id.
    """
    if mode != "direct":
        return None
    value = header(scope, WORKER_HEADER)
    if value is None:
        raise http_errors.bad_request(
            f"direct routing: the {WORKER_HEADER.decode()} header must name the instance "
            "(hex id, as python -m dynamo_zmq status lists it)"
        )
    try:
        return int(value.decode("ascii"), 16)
    except (UnicodeDecodeError, ValueError):
        raise http_errors.bad_request(
            f"{WORKER_HEADER.decode()}: {value[:40]!r} is not a hex instance id"
        ) from None
