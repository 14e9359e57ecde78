"""How soon a worker is routed to again after a network partition heals.

    sudo .venv/bin/python scripts/bench_rejoin.py [--cuts 30,45] [--trials 3]
        [--modes silent,link] [--model-path DIR]

Two namespace hosts on one bridge (``dynamo_zmq.tools.netns``): a frontend on A, a mocker worker
on B, no discovery flag. Each trial cuts B off for the given seconds, ``silent`` (its bridge
port drops every frame, link up: connects hang, as behind a dead switch or a dropping firewall)
or ``link`` (its port down: the link loses carrier), heals it, and times (a) B leaving A's
routing after the cut and (b) B back in it after the heal, by polling A's ``/health`` every
20 ms. Needs root. Everything it starts is stopped by pid, its namespaces deleted by name.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dynamo_zmq.tools.netns import Cluster, cluster_supported
from dynamo_zmq.tools.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
POLL = 0.02


def routed(http: Any) -> set[str]:
    """The instances A's frontend routes to now."""
    try:
        resp = http.get("/health")
    except Exception:
        return set()
    if resp.status_code != 200:
        return set()
    return {i for ids in resp.json()["models"].values() for i in ids}


def wait(predicate: Any, timeout: float) -> float:
    """Seconds until ``predicate()`` holds; raises TimeoutError after ``timeout``."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"not within {timeout}s")
        time.sleep(POLL)
    return time.monotonic() - t0


def run(model: str, cuts: list[float], modes: list[str], trials: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with Cluster(["a", "b"], env={"PYTHONPATH": str(ROOT)}, cwd=ROOT) as cl:
        worker = cl["b"].python("-m", "dynamo_zmq.worker", "--engine", "mocker",
                                "--model-path", model, "--speedup-ratio", "1000")
        cl["a"].python("-m", "dynamo_zmq.frontend")
        http = cl["a"].http(8000)
        b = f"{worker.instance_id:x}"
        wait(lambda: b in routed(http), 30)
        for mode in modes:
            for cut in cuts:
                for k in range(trials):
                    cl.cut(cl["b"], silent=mode == "silent")
                    t0 = time.monotonic()
                    try:
                        out = wait(lambda: b not in routed(http), 30)
                        time.sleep(max(0.0, t0 + cut - time.monotonic()))
                    finally:
                        cl.heal(cl["b"])
                    back = wait(lambda: b in routed(http), 120)
                    rows.append({"mode": mode, "cut": cut, "trial": k, "out": out, "back": back})
                    print(f"{mode:6} cut {cut:4.0f}s  trial {k}: out of routing {out:.2f}s "
                          f"after the cut, back {back:.2f}s after the heal", flush=True)
                    time.sleep(1.0)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuts", default="30,45", help="partition lengths, seconds")
    parser.add_argument("--modes", default="silent,link", help="silent, link or both")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--model-path", help="model directory (default: a tiny random model)")
    args = parser.parse_args()
    why = cluster_supported()
    if why is not None:
        print(f"cannot build namespace hosts: {why}", file=sys.stderr)
        return 1
    cuts = [float(c) for c in args.cuts.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"silent", "link"} or args.trials < 1:
        parser.error("--modes takes silent and/or link; --trials at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path or str(build_tiny_model(Path(tmp) / "model"))
        rows = run(model, cuts, modes, args.trials)
    print("\n| cut | partition | out of routing after the cut (median) | back after the heal: "
          "median | max |\n|---|---|---|---|---|")
    for mode in modes:
        for cut in cuts:
            sel = [r for r in rows if r["mode"] == mode and r["cut"] == cut]
            backs = [r["back"] for r in sel]
            print(f"| {mode} | {cut:.0f} s | {statistics.median(r['out'] for r in sel):.2f} s | "
                  f"{statistics.median(backs):.2f} s | {max(backs):.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
