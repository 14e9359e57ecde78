"""Why a KV transfer could not happen. Each is a ``dynamo_zmq.errors`` kind, so callers that
only know those still handle them; the engine's answer to all of them is a local prefill."""

from __future__ import annotations

from .. import errors

__all__ = ["TransferFailed", "TransferFull", "TransferNotFound"]


class TransferFull(errors.Unsupported):
    """The server already holds ``max_bytes`` for transfers not yet pulled: nothing is handed
    off (the decode worker prefills locally)."""


class TransferNotFound(errors.InvalidArgument):
    """The server does not know the transfer: never offered, already pulled, or expired."""


class TransferFailed(errors.Disconnected):
    """The pull broke: the server vanished or stopped answering within the timeout, refused the
    connection (CURVE), or sent a malformed frame."""
