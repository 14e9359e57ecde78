#!/usr/bin/env python3
"""A soak: does anything grow that should not? (issue 33 item 6)

    python scripts/soak.py [--minutes 30] [--workers 4] [--concurrency 8] [--warmup-minutes 10]
        [--max-rss-mb-per-hour 20] [--max-fds-per-hour 10] [--kv-index-max-blocks N]
        [--restart-interval 60] [--disconnect-fraction 0.1] [--sample-interval 10]
        [--plot FILE.png] [--json FILE]

A frontend (kv mode), ``python -m router`` and mocker workers on loopback run steady streaming
load with prompt diversity, client disconnects and a worker restarted every interval
(``dynamo_zmq.tools.soak``). Each process's RSS and open fds are sampled; after the warm-up a
Theil-Sen slope is fitted per process (the restarted worker is reported, not judged). Exit
status 1 when a slope passes its bound, a KV index passes ``--kv-index-max-blocks`` (default:
1.25 x workers x the mocker's KV blocks), or a request failed. See docs/benchmarks.md, "Soak".
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from dynamo_zmq.tools.soak import SoakConfig, run_soak
from dynamo_zmq.tools.soak_report import Bounds, format_table, judge, plot


def main() -> int:
    d = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--warmup-minutes", type=float, default=None,
                   help="not judged before this (default: a third of --minutes, at most 10)")
    p.add_argument("--max-rss-mb-per-hour", type=float, default=20.0)
    p.add_argument("--max-fds-per-hour", type=float, default=10.0)
    p.add_argument("--kv-index-max-blocks", type=int, default=None)
    p.add_argument("--restart-interval", type=float, default=d.restart_interval)
    p.add_argument("--disconnect-fraction", type=float, default=d.disconnect_fraction)
    p.add_argument("--sample-interval", type=float, default=d.sample_interval)
    p.add_argument("--pool", type=int, default=d.pool, help="distinct system prompts")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--speedup", type=float, default=d.speedup,
                   help="the mocker's --speedup-ratio")
    p.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks,
                   help="each mocker worker's KV blocks")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--model-path", help="model directory (default: a tiny model built here)")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--json", metavar="FILE", help="write the samples and the verdict")
    a = p.parse_args()
    if a.minutes <= 0 or a.workers < 2 or a.concurrency < 1 or a.sample_interval <= 0:
        p.error("--minutes and --sample-interval must be > 0, --workers >= 2, "
                "--concurrency >= 1")
    cfg = SoakConfig(
        minutes=a.minutes, workers=a.workers, concurrency=a.concurrency,
        sample_interval=a.sample_interval, restart_interval=a.restart_interval,
        disconnect_fraction=a.disconnect_fraction, pool=a.pool, max_tokens=a.max_tokens,
        speedup=a.speedup, num_gpu_blocks=a.num_gpu_blocks, seed=a.seed,
        model_path=a.model_path,
    )
    warmup = a.warmup_minutes if a.warmup_minutes is not None else min(a.minutes / 3, 10.0)
    cap = a.kv_index_max_blocks or int(1.25 * a.workers * a.num_gpu_blocks)
    bounds = Bounds(warmup * 60, a.max_rss_mb_per_hour, a.max_fds_per_hour, cap)
    result = run_soak(cfg)
    verdict = judge(result, bounds)
    print(format_table(result, verdict, bounds))
    if a.plot:
        plot(result, bounds, a.plot)
    if a.json:
        with open(a.json, "wb") as f:
            f.write(msgspec.json.encode({"config": cfg, "bounds": bounds, "result": result,
                                         "verdict": verdict}))
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
