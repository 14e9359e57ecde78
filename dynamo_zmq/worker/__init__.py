"""The worker process: ``python -m dynamo_zmq.worker`` serves one engine on the request plane
(registration, admission, post-processing, health canary, metrics, load reports, shutdown order).

From code, as Dynamo's backend-common does it::

    engine, config = MockerEngine.from_args(["--model-path", "/models/llama"])
    sys.exit(run(engine, config))          # or: await run_async(engine, config)

``config`` is a ``WorkerConfig``; build one directly to skip flags altogether.
"""

from ._cli import NATIVE_PROCESSING_FLAGS as NATIVE_PROCESSING_FLAGS
from ._cli import build_parser as build_parser
from ._cli import from_args as from_args
from ._cli import load_engine_class as load_engine_class
from ._cli import main as main
from ._cli import parse_args as parse_args
from ._config import WorkerConfig as WorkerConfig
from ._health import Health as Health
from ._load_publisher import LoadPublisher as LoadPublisher
from ._metrics import WorkerMetrics as WorkerMetrics
from ._model_path import resolve_model_path as resolve_model_path
from ._run import run as run
from ._run import run_async as run_async
from ._worker import Worker as Worker

__all__ = [
    "NATIVE_PROCESSING_FLAGS",
    "Health",
    "LoadPublisher",
    "Worker",
    "WorkerConfig",
    "WorkerMetrics",
    "build_parser",
    "from_args",
    "load_engine_class",
    "main",
    "parse_args",
    "resolve_model_path",
    "run",
    "run_async",
]
