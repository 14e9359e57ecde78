"""The Batch API's flags: ``--batch-dir``, ``--batch-max-bytes``, ``--batch-retention`` and
``--batch-concurrency`` (with their ``DYN_*`` variables)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidArgument
from ._batch_files import parse_duration

__all__ = ["BatchConfig", "add_batch_args", "batch_config", "default_batch_dir"]

DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_RETENTION = "30d"
DEFAULT_CONCURRENCY = 8


def default_batch_dir() -> Path:
    """``$XDG_STATE_HOME/dynamo-zmq/batches`` (``~/.local/state/dynamo-zmq/batches``)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state")
    return Path(state) / "dynamo-zmq" / "batches"


@dataclass(frozen=True)
class BatchConfig:
    """Where and how a frontend keeps and runs batches."""

    root: Path
    max_bytes: int = DEFAULT_MAX_BYTES
    retention: float = 30 * 86400.0
    concurrency: int = DEFAULT_CONCURRENCY


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    """Add the Batch API's flags to the frontend's parser."""
    env = os.environ.get
    parser.add_argument(
        "--batch-dir", default=env("DYN_BATCH_DIR"), metavar="DIR",
        help="Batch API: directory of this frontend's uploaded files, batches and their "
             "output (one frontend process per directory); default "
             "$XDG_STATE_HOME/dynamo-zmq/batches [DYN_BATCH_DIR]",
    )
    parser.add_argument(
        "--batch-max-bytes", type=int, metavar="BYTES",
        default=env("DYN_BATCH_MAX_BYTES", str(DEFAULT_MAX_BYTES)),
        help="Batch API: most bytes the batch directory holds (an upload over it is a 413) "
             "[DYN_BATCH_MAX_BYTES]",
    )
    parser.add_argument(
        "--batch-retention", metavar="DURATION",
        default=env("DYN_BATCH_RETENTION", DEFAULT_RETENTION),
        help="Batch API: files and finished batches are deleted this long after they were "
             "created or finished (seconds, or a number and s/m/h/d) [DYN_BATCH_RETENTION]",
    )
    parser.add_argument(
        "--batch-concurrency", type=int, metavar="N",
        default=env("DYN_BATCH_CONCURRENCY", str(DEFAULT_CONCURRENCY)),
        help="Batch API: most batch requests this frontend has in flight at once, all batches "
             "together [DYN_BATCH_CONCURRENCY]",
    )


def batch_config(args: argparse.Namespace) -> BatchConfig:
    """The configuration the flags ask for.

    Raises:
        InvalidArgument: a size or concurrency below 1, or a retention that is not a duration.
    """
    if args.batch_max_bytes < 1:
        raise InvalidArgument(f"--batch-max-bytes must be >= 1, got {args.batch_max_bytes}")
    if args.batch_concurrency < 1:
        raise InvalidArgument(f"--batch-concurrency must be >= 1, got {args.batch_concurrency}")
    try:
        retention = parse_duration(args.batch_retention)
    except ValueError as exc:
        raise InvalidArgument(f"--batch-retention: {exc}") from None
    root = Path(args.batch_dir) if args.batch_dir else default_batch_dir()
    return BatchConfig(root, args.batch_max_bytes, retention, args.batch_concurrency)
