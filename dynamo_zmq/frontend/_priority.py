"""A request's priority: vLLM's ``priority`` body field and the ``x-dynamo-priority`` header.

Both are an integer, lower runs first (vLLM's convention), 0 by default. When both are given,
the header wins: a gateway in front of the frontend sets it to enforce a class of service that
the client's own body cannot raise. The priority travels as ``PreprocessedRequest.priority`` on
every sub-request, migrated continuation and disaggregated prefill, orders the kv router's wait
queue (``router.busy.AdmissionQueue``), and is scheduled by engines with
``Capability.PRIORITY`` (vLLM under ``--scheduling-policy priority``, the mocker likewise).
"""

from __future__ import annotations

import re

from ._asgi import Scope, header
from .errors import bad_request

__all__ = ["MAX_PRIORITY", "MIN_PRIORITY", "PRIORITY_HEADER", "header_priority"]

#: Request header: this request's priority (an integer; it overrides the body's ``priority``).
PRIORITY_HEADER = b"x-dynamo-priority"
#: The priorities a request may have (a signed 64-bit integer, as it travels on the wire).
MIN_PRIORITY, MAX_PRIORITY = -(2**63), 2**63 - 1
_INTEGER = re.compile(rb"[+-]?[0-9]{1,19}")


def header_priority(scope: Scope) -> int | None:
    """The priority the ``x-dynamo-priority`` header of the request in ``scope`` gives (None:
    no header).

    Raises:
        HttpError: 400 when the header is not a decimal integer in the signed 64-bit range.
    """
    raw = header(scope, PRIORITY_HEADER)
    if raw is None:
        return None
    value = raw.strip()
    if _INTEGER.fullmatch(value) is not None:
        number = int(value)
        if MIN_PRIORITY <= number <= MAX_PRIORITY:
            return number
    raise bad_request(
        f"{PRIORITY_HEADER.decode()}: {raw[:40]!r} is not an integer priority "
        f"(from {MIN_PRIORITY} to {MAX_PRIORITY}; lower runs first)",
        code="invalid_value",
    )
