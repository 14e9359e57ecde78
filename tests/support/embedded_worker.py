"""A worker built from code, as a program embedding dynamo-zmq would (the backend-common
document's ``from_args`` + ``run``)::

    python -m tests.support.embedded_worker args [worker and mocker flags...]
        MockerEngine.from_args(flags), then run(engine, config)
    python -m tests.support.embedded_worker code NAMESPACE MODEL_DIR
        MockerEngine(MockerConfig(...)) and WorkerConfig(...) built field by field (no flags
        at all), served with ``await run_async(engine, config)``
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from dynamo_zmq.discovery import DiscoveryConfig
from dynamo_zmq.runtime import RuntimeConfig
from dynamo_zmq.worker import WorkerConfig, run, run_async
from engines.mocker import MockerConfig, MockerEngine


def from_flags(argv: list[str]) -> int:
    engine, config = MockerEngine.from_args(argv)
    assert isinstance(engine, MockerEngine) and isinstance(config, WorkerConfig)
    return run(engine, config)


def from_code(namespace: str, model_dir: str) -> int:
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    engine = MockerEngine(MockerConfig(
        model_name="embedded", model_path=model_dir, vocab_size=vocab, speedup_ratio=1000.0,
        host="127.0.0.1",
    ))
    config = WorkerConfig(
        model_path=model_dir, namespace=namespace, component="embedded",
        runtime=RuntimeConfig(
            discovery=DiscoveryConfig(backend="mdns", mdns_interfaces=("127.0.0.1",)),
            host="127.0.0.1",
        ),
    )
    return asyncio.run(run_async(engine, config))


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    sys.exit(from_flags(rest) if mode == "args" else from_code(*rest))
