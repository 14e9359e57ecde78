"""Small tools, each run as ``python -m dynamo_zmq TOOL``: ``status`` (list live instances),
``demo`` (a worker and a client, no HTTP), ``quickstart`` (frontend + mocker on a tiny model) and
``tiny-model`` (build that model). They sit on top of everything else and nothing imports them
but tests and scripts."""

from .tiny_model import build_tiny_model as build_tiny_model

__all__ = ["build_tiny_model"]
