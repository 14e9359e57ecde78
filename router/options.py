"""The KV router's command-line flags (frontend ``--router-mode kv`` and ``python -m router``)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from dynamo_zmq.errors import InvalidArgument
from dynamo_zmq.llm import MAX_LOAD_INTERVAL  # a load report must outlive the slowest interval
from dynamo_zmq.runtime import check_number

from .config import DEFAULT_LORA_MISS_BLOCKS

__all__ = ["add_kv_router_args", "check_kv_router_args", "kv_router_options"]


def add_kv_router_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--kv-overlap-score-weight``, ``--kv-prefill-load-weight``, ``--kv-lora-miss-blocks``,
    ``--router-temperature``,
    ``--no-kv-events``, ``--no-kv-inflight-overlap``, ``--router-ttl``, ``--load-report-ttl``,
    ``--load-report-grace``, ``--kv-index-max-blocks`` and the busy-worker bounds
    ``--busy-kv-threshold``, ``--busy-prefill-tokens``, ``--busy-queue-size`` and
    ``--busy-queue-timeout`` (each with its DYN_* variable)."""
    env = os.environ.get
    parser.add_argument(
        "--kv-overlap-score-weight", type=float, default=env("DYN_KV_OVERLAP_SCORE_WEIGHT", "1.0"),
        help="kv routing: weight of blocks to prefill against decode load "
             "[DYN_KV_OVERLAP_SCORE_WEIGHT]",
    )
    parser.add_argument(
        "--kv-prefill-load-weight", type=float,
        default=env("DYN_KV_PREFILL_LOAD_WEIGHT", "0.0"),
        help="kv routing: weight of a worker's queued prefill (uncached prompt blocks not yet "
             "prefilled) added to its load; 0 = Dynamo's cost [DYN_KV_PREFILL_LOAD_WEIGHT]",
    )
    parser.add_argument(
        "--kv-lora-miss-blocks", type=float,
        default=env("DYN_KV_LORA_MISS_BLOCKS", str(DEFAULT_LORA_MISS_BLOCKS)), metavar="N",
        help="kv routing: cost, in blocks, of a worker where a request's LoRA adapter is not "
             "predicted resident (the last --max-loras adapters routed there): it would load "
             "it and evict another; 0 = off [DYN_KV_LORA_MISS_BLOCKS]",
    )
    parser.add_argument(
        "--router-temperature", type=float, default=env("DYN_ROUTER_TEMPERATURE", "0.0"),
        help="kv routing: 0 picks the cheapest worker, > 0 samples by softmax "
             "[DYN_ROUTER_TEMPERATURE]",
    )
    parser.add_argument(
        "--no-kv-events", action="store_true", default=env("DYN_KV_EVENTS", "1") == "0",
        help="kv routing: predict caches from routing decisions instead of KV events "
             "[DYN_KV_EVENTS=0]",
    )
    parser.add_argument(
        "--no-kv-inflight-overlap", dest="kv_inflight_overlap", action="store_false",
        default=env("DYN_KV_INFLIGHT_OVERLAP", "1") != "0",
        help="kv routing with events: match prompts only against the KV events, not also against "
             "the requests in flight the router sent (whose blocks the events may not carry yet) "
             "[DYN_KV_INFLIGHT_OVERLAP=0]",
    )
    parser.add_argument(
        "--router-ttl", type=float, default=env("DYN_ROUTER_TTL", "120"), metavar="SECONDS",
        help="kv routing without events: how long a routed prompt's blocks count as cached on the "
             "worker it went to [DYN_ROUTER_TTL]",
    )
    parser.add_argument(
        "--load-report-ttl", type=float, default=env("DYN_LOAD_REPORT_TTL", "5.0"),
        metavar="SECONDS",
        help="kv routing: how long a worker's published load stays authoritative; after it the "
             f"router's own prediction is used (> {MAX_LOAD_INTERVAL:g}, the slowest publish "
             "interval) [DYN_LOAD_REPORT_TTL]",
    )
    parser.add_argument(
        "--load-report-grace", type=float, default=env("DYN_LOAD_REPORT_GRACE", "0.3"),
        metavar="SECONDS",
        help="kv routing: requests routed this long before a load report stay counted on top of "
             "it, since the engine may not hold them yet (>= 0, < the TTL) [DYN_LOAD_REPORT_GRACE]",
    )
    parser.add_argument(
        "--kv-index-max-blocks", type=int, default=env("DYN_KV_INDEX_MAX_BLOCKS", "0"),
        metavar="N",
        help="kv routing: at most N (worker, block) entries in the KV index; when full, the "
             "oldest blocks are evicted (no longer credited). 0: no cap but the built-in "
             "safety bound, which refuses new blocks [DYN_KV_INDEX_MAX_BLOCKS]",
    )
    parser.add_argument(
        "--kv-index-layout", choices=("dicts", "packed"),
        default=env("DYN_KV_INDEX_LAYOUT", "packed"),
        help="kv routing: the KV index's storage. packed (default): uint64 tables, ~25-40 B a "
             "block from our workers' own-hash deltas; dicts: 2-4x faster stores (token events "
             "of engines we do not wrap: ~4x), ~65-95 B a block (~200 B from token events) "
             "[DYN_KV_INDEX_LAYOUT]",
    )
    parser.add_argument(
        "--busy-kv-threshold", type=float, default=env("DYN_BUSY_KV_THRESHOLD", "0.95"),
        metavar="FRACTION",
        help="kv routing: a worker rank whose active KV blocks exceed this fraction of its total "
             "takes no new request while another can (0 = off) [DYN_BUSY_KV_THRESHOLD]",
    )
    parser.add_argument(
        "--busy-prefill-tokens", type=int, default=env("DYN_BUSY_PREFILL_TOKENS", "0"),
        metavar="N",
        help="kv routing: ... or whose prompt tokens routed and not yet prefilled exceed N "
             "(0 = no bound) [DYN_BUSY_PREFILL_TOKENS]",
    )
    parser.add_argument(
        "--busy-queue-size", type=int, default=env("DYN_BUSY_QUEUE_SIZE", "1024"), metavar="N",
        help="kv routing: requests that may wait while every worker is busy; beyond, 503 with "
             "Retry-After (0 = none wait) [DYN_BUSY_QUEUE_SIZE]",
    )
    parser.add_argument(
        "--busy-queue-timeout", type=float, default=env("DYN_BUSY_QUEUE_TIMEOUT", "30"),
        metavar="SECONDS",
        help="kv routing: how long a request waits for a non-busy worker before its 503 "
             "[DYN_BUSY_QUEUE_TIMEOUT]",
    )
    add_replica_args(parser)


def add_replica_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--router-replica-sync`` and ``--router-replica-ttl`` (router/replica_sync.py)."""
    env = os.environ.get
    parser.add_argument(
        "--router-replica-sync", action="store_true",
        default=env("DYN_ROUTER_REPLICA_SYNC", "0").lower() in ("1", "true", "yes"),
        help="kv routing: share routing decisions with the other frontends / routers of the "
             "same model (peer to peer), so their load estimates agree "
             "[DYN_ROUTER_REPLICA_SYNC=1]",
    )
    parser.add_argument(
        "--router-replica-ttl", type=float, default=env("DYN_ROUTER_REPLICA_TTL", "600"),
        metavar="SECONDS",
        help="kv routing with replica sync: longest a replica's request counts without its end "
             "being heard [DYN_ROUTER_REPLICA_TTL]",
    )


def check_kv_router_args(args: argparse.Namespace) -> None:
    """Raises InvalidArgument for a weight or temperature that is negative or not finite, or
    load-report timings that cannot work (a TTL a report could expire within between two sends,
    a grace outside it), a negative index cap."""
    check_number("--kv-overlap-score-weight", args.kv_overlap_score_weight)
    check_number("--router-temperature", args.router_temperature)
    check_number("--kv-prefill-load-weight", args.kv_prefill_load_weight)
    check_number("--kv-lora-miss-blocks", args.kv_lora_miss_blocks)
    check_number("--router-ttl", args.router_ttl, positive=True)
    check_number("--busy-kv-threshold", args.busy_kv_threshold)
    check_number("--busy-queue-timeout", args.busy_queue_timeout, positive=True)
    check_number("--router-replica-ttl", args.router_replica_ttl, positive=True)
    for flag, value in (("--busy-prefill-tokens", args.busy_prefill_tokens),
                        ("--busy-queue-size", args.busy_queue_size)):
        if value < 0:
            raise InvalidArgument(f"{flag} must be >= 0, got {value}")
    if not args.load_report_ttl > MAX_LOAD_INTERVAL:  # (also refuses NaN)
        raise InvalidArgument(
            f"--load-report-ttl must be > {MAX_LOAD_INTERVAL:g} s (the slowest worker "
            f"--load-interval), got {args.load_report_ttl}"
        )
    if args.kv_index_max_blocks < 0:
        raise InvalidArgument(
            f"--kv-index-max-blocks must be >= 0 (0: no cap), got {args.kv_index_max_blocks}"
        )
    if not 0 <= args.load_report_grace < args.load_report_ttl:
        raise InvalidArgument(
            "--load-report-grace must be >= 0 and < --load-report-ttl, "
            f"got {args.load_report_grace}"
        )


def kv_router_options(args: argparse.Namespace) -> dict[str, Any]:
    """``router.kv_router.KvRouterConfig`` keyword arguments from the flags above."""
    return {
        "overlap_score_weight": args.kv_overlap_score_weight,
        "router_temperature": args.router_temperature,
        "prefill_load_weight": args.kv_prefill_load_weight,
        "lora_miss_blocks": args.kv_lora_miss_blocks,
        "use_kv_events": not args.no_kv_events,
        "inflight_overlap": args.kv_inflight_overlap,
        "approx_ttl": args.router_ttl,
        "load_report_ttl": args.load_report_ttl,
        "load_report_grace": args.load_report_grace,
        "index_max_blocks": args.kv_index_max_blocks or None,
        "index_layout": args.kv_index_layout,
        "busy_kv_threshold": args.busy_kv_threshold,
        "busy_prefill_tokens": args.busy_prefill_tokens,
        "busy_queue_size": args.busy_queue_size,
        "busy_queue_timeout": args.busy_queue_timeout,
        "replica_sync": args.router_replica_sync,
        "replica_ttl": args.router_replica_ttl,
    }
