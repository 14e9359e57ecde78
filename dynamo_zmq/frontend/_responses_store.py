"""The Responses API's store: responses created with ``store`` (OpenAI's default), kept in this
frontend process's memory for ``previous_response_id`` and ``GET /v1/responses/{id}``.

Bounded by count (``--responses-store-size``; the oldest go first) and age
(``--responses-store-ttl``). Per process: another frontend, or another of ``--http-workers N``'s
processes, does not know its responses, and a restart forgets them all.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections import OrderedDict
from typing import Any

from ..errors import InvalidArgument
from .errors import HttpError, bad_request

__all__ = ["ResponsesStore", "add_responses_args", "not_found", "store_from_args"]

DEFAULT_SIZE = 1000
DEFAULT_TTL = 3600.0


def not_found(response_id: str, param: str | None = None) -> HttpError:
    """404 for a response id the store does not hold (OpenAI's message)."""
    return HttpError(404, "invalid_request_error",
                     f"Response with id '{response_id}' not found.", param=param,
                     code="response_not_found")


class ResponsesStore:
    """Stored responses (their body) and the conversation each ended (chat messages, without
    its ``instructions``), newest last.

    Args:
        size: most responses kept (0: none; ``previous_response_id`` is then refused).
        ttl: seconds a response is kept.
    """

    def __init__(self, size: int = DEFAULT_SIZE, ttl: float = DEFAULT_TTL) -> None:
        if size < 0 or ttl <= 0:
            raise ValueError("the responses store needs size >= 0 and ttl > 0")
        self.size, self.ttl = size, ttl
        self._items: OrderedDict[str, tuple[float, dict[str, Any], list[dict[str, Any]]]] = (
            OrderedDict())

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items:
            key, (expiry, _, _) = next(iter(self._items.items()))
            if expiry > now:
                return
            del self._items[key]

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep a completed response and its conversation (dropping the oldest beyond size)."""
        if not self.enabled:
            return
        self._expire()
        self._items[body["id"]] = (time.monotonic() + self.ttl, body, conversation)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any]:
        """A stored response's body.

        Raises:
            HttpError: 404 when it is unknown or expired.
        """
        self._expire()
        item = self._items.get(response_id)
        if item is None:
            raise not_found(response_id)
        return item[1]

    def delete(self, response_id: str) -> None:
        """Forget a stored response.

        Raises:
            HttpError: 404 when it is unknown or expired.
        """
        self.get(response_id)
        del self._items[response_id]

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation a ``previous_response_id`` continues (a copy).

        Raises:
            HttpError: 400 when the store is off; 404 when it is unknown or expired.
        """
        if not self.enabled:
            raise bad_request("'previous_response_id' needs the response store, which is off "
                              "on this frontend (--responses-store-size 0)",
                              param="previous_response_id", code="unsupported_parameter")
        self._expire()
        item = self._items.get(response_id)
        if item is None:
            raise not_found(response_id, "previous_response_id")
        return list(item[2])


def add_responses_args(parser: argparse.ArgumentParser) -> None:
    """``--responses-store-size`` and ``--responses-store-ttl`` (with their DYN_* variables)."""
    env = os.environ.get
    parser.add_argument(
        "--responses-store-size", type=int, metavar="N",
        default=env("DYN_RESPONSES_STORE_SIZE", str(DEFAULT_SIZE)),
        help="Responses API: most stored responses this frontend process keeps in memory for "
             "previous_response_id and GET /v1/responses/{id}; 0 = off "
             "[DYN_RESPONSES_STORE_SIZE]",
    )
    parser.add_argument(
        "--responses-store-ttl", type=float, metavar="SECONDS",
        default=env("DYN_RESPONSES_STORE_TTL", str(DEFAULT_TTL)),
        help="Responses API: seconds a stored response is kept [DYN_RESPONSES_STORE_TTL]",
    )


def store_from_args(args: argparse.Namespace) -> ResponsesStore:
    """The store the flags ask for.

    Raises:
        InvalidArgument: a negative size, or a TTL that is not a finite number above 0.
    """
    size, ttl = args.responses_store_size, float(args.responses_store_ttl)
    if size < 0:
        raise InvalidArgument(f"--responses-store-size must be >= 0, got {size}")
    if not (math.isfinite(ttl) and ttl > 0):
        raise InvalidArgument(f"--responses-store-ttl must be a finite number > 0, got {ttl}")
    return ResponsesStore(size, ttl)
