"""Pieces every command line shares: logging set-up and the KV-router flags."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .errors import InvalidArgument

__all__ = ["add_kv_router_args", "check_kv_router_args", "setup_logging"]


def setup_logging() -> None:
    """Log to stderr at ``DYN_LOG`` (default INFO); stdout stays free for ``READY`` lines."""
    logging.basicConfig(
        level=os.environ.get("DYN_LOG", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def add_kv_router_args(parser: argparse.ArgumentParser) -> None:
    """``--kv-overlap-score-weight``, ``--router-temperature``, ``--no-kv-events`` (with DYN_*)."""
    env = os.environ.get
    parser.add_argument(
        "--kv-overlap-score-weight", type=float, default=float(env("DYN_KV_OVERLAP_SCORE_WEIGHT", "1.0")),
        help="kv routing: weight of blocks to prefill against decode load [DYN_KV_OVERLAP_SCORE_WEIGHT]",
    )
    parser.add_argument(
        "--router-temperature", type=float, default=float(env("DYN_ROUTER_TEMPERATURE", "0.0")),
        help="kv routing: 0 picks the cheapest worker, > 0 samples by softmax [DYN_ROUTER_TEMPERATURE]",
    )
    parser.add_argument(
        "--no-kv-events", action="store_true", default=env("DYN_KV_EVENTS", "1") == "0",
        help="kv routing: predict caches from routing decisions instead of KV events [DYN_KV_EVENTS=0]",
    )


def check_kv_router_args(args: argparse.Namespace) -> None:
    """Raises InvalidArgument for a negative weight or temperature."""
    if args.kv_overlap_score_weight < 0 or args.router_temperature < 0:
        raise InvalidArgument("--kv-overlap-score-weight and --router-temperature must be >= 0")
