"""The worker process: ``python -m dynamo_zmq.worker`` serves one engine on the request plane
(registration, admission, post-processing, health canary, metrics, load reports, shutdown order).
"""

from ._load_publisher import LoadPublisher as LoadPublisher
from ._metrics import WorkerMetrics as WorkerMetrics
from ._worker import ENGINE_GROUP as ENGINE_GROUP
from ._worker import Worker as Worker
from ._worker import build_parser as build_parser
from ._worker import load_engine_class as load_engine_class
from ._worker import main as main
from ._worker import parse_args as parse_args

__all__ = [
    "ENGINE_GROUP",
    "LoadPublisher",
    "Worker",
    "WorkerMetrics",
    "build_parser",
    "load_engine_class",
    "main",
    "parse_args",
]
