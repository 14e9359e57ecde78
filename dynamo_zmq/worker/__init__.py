"""The worker process: ``python -m dynamo_zmq.worker`` serves one engine on the request plane
(registration, admission, post-processing, health canary, metrics, load reports, shutdown order).
"""

from ._cli import build_parser as build_parser
from ._cli import load_engine_class as load_engine_class
from ._cli import main as main
from ._cli import parse_args as parse_args
from ._health import Health as Health
from ._load_publisher import LoadPublisher as LoadPublisher
from ._metrics import WorkerMetrics as WorkerMetrics
from ._worker import Worker as Worker

__all__ = [
    "Health",
    "LoadPublisher",
    "Worker",
    "WorkerMetrics",
    "build_parser",
    "load_engine_class",
    "main",
    "parse_args",
]
