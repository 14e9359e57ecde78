"""A long frame-fuzzing run: garbage on every ZMQ port a worker or a router reads.

    python scripts/fuzz_frames.py [--frames 100000] [--max-seconds 900] [--seed 0]
                                  [--model-path DIR] [--ports request,replay,kv_events,load]

Starts a mocker worker (its own process, static discovery, on loopback) and, in this process, a
router's KV-event and load subscribers following a fake publisher. Then it sends ``--frames``
generated frames (``dynamo_zmq.tools.frame_fuzz``: random multipart, truncated MessagePack,
wrong types, huge ints, invalid UTF-8), round-robin over the ports, until done or
``--max-seconds`` pass, and prints one row per port:

- frames sent, how many the protocol promises to answer, how many were answered within 5 s,
- errors: InvalidArgument answers (request port), replay answers (replay port), messages
  counted as undecodable (subscribers),
- crashes: the worker exited, or a subscriber stopped,
- RSS before and after (the worker's for its ports, this process's for the subscribers),
- still serving: a normal request streams to its end, a valid replay is answered, a valid KV
  batch and load report apply, and what the router knows is what it was before the garbage.

Exits 1 if anything crashed, went unanswered or stopped serving. The pytest twin with the same
generators is tests/test_frame_fuzz.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynamo_zmq.llm import (  # noqa: E402
    LOAD_TOPIC,
    LOAD_VERSION,
    EngineLoad,
    LoadReport,
    encode_report,
)
from dynamo_zmq.resources import Resources  # noqa: E402
from dynamo_zmq.tools.child_process import ChildProcess  # noqa: E402
from dynamo_zmq.tools.frame_fuzz import (  # noqa: E402
    PORTS,
    answerable,
    kv_event_frames,
    load_frames,
    replay_answerable,
    replay_frames,
    request_frames,
)
from dynamo_zmq.wire import Batch, End, Error, Kind, Request, encode  # noqa: E402
from router.events import BlockStored, encode_batch  # noqa: E402
from router.indexer import KvIndexer  # noqa: E402
from router.load import LoadSubscriber  # noqa: E402
from router.scheduler import LoadTracker  # noqa: E402
from router.subscriber import KvEventSubscriber  # noqa: E402

ANSWER_MS = 5000
END_SEQ = b"\xff" * 8
WID = 0xF00D
BS = 4
NAMESPACE = f"fuzz{os.getpid():x}"
_error, _batch, _end = (msgspec.msgpack.Decoder(t) for t in (Error, Batch, End))


@dataclass
class Row:
    frames: int = 0
    answerable: int = 0
    answered: int = 0
    errors: int = 0
    crashes: int = 0
    rss_before: int = 0
    rss_after: int = 0
    serving: bool = False


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def invalid_arguments(frames: list[bytes]) -> int:
    if frames[0] == Kind.ERROR:
        return int(_error.decode(frames[1]).kind == "InvalidArgument")
    if frames[0] == Kind.BATCH:
        return sum(e.kind == "InvalidArgument" for e in _batch.decode(frames[1]).errors)
    return 0


def request_answered(sock: zmq.Socket[bytes], row: Row) -> bool:
    if not sock.poll(ANSWER_MS):
        return False
    while True:
        row.errors += invalid_arguments(sock.recv_multipart())
        if not sock.poll(0):
            return True


def streams_to_end(address: str, namespace: str) -> bool:
    """A normal request on a fresh connection streams to its END."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    payload = msgspec.msgpack.encode(
        {"token_ids": [1, 2, 3, 4], "stop": {"max_tokens": 4, "ignore_eos": True}})
    sock.send_multipart([Kind.REQUEST, encode(
        Request(1, f"{namespace}.backend.generate", "ctx", msgspec.Raw(payload)))])
    try:
        while sock.poll(ANSWER_MS):
            kind, body = sock.recv_multipart()
            if kind == Kind.END or (kind == Kind.BATCH and _batch.decode(body).ends):
                return True
            if kind == Kind.ERROR or (kind == Kind.BATCH and _batch.decode(body).errors):
                return False
        return False
    finally:
        sock.close(linger=0)


def replay_answered(sock: zmq.Socket[bytes]) -> bool:
    """Read a replay's answer to its END marker."""
    while sock.poll(ANSWER_MS):
        if sock.recv_multipart()[-2] == END_SEQ:
            return True
    return False


def start_worker(model: Path, replay_port: int) -> ChildProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = ChildProcess(
        [sys.executable, "-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path",
         str(model), "--model-name", "tiny", "--namespace", NAMESPACE, "--host", "127.0.0.1",
         "--discovery", "static", "--speedup-ratio", "1000",
         "--kv-replay-port", str(replay_port)],
        env=env, cwd=ROOT, die_with_parent=True,
    )
    return proc.wait_ready(120)


async def wait_until(done: Callable[[], bool], timeout: float) -> None:
    for _ in range(int(timeout / 0.05)):
        if done():
            return
        await asyncio.sleep(0.05)


def log_text(proc: ChildProcess) -> str:
    return Path(proc.log.name).read_text(errors="replace")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def fuzz(args: argparse.Namespace) -> dict[str, Row]:
    ports = [p for p in args.ports.split(",") if p]
    rows = {p: Row() for p in ports}
    rng = random.Random(args.seed)
    zctx = zmq.Context.instance()
    replay_port = free_port()
    worker = start_worker(args.model_path, replay_port)
    kv_pub, load_pub = zctx.socket(zmq.PUB), zctx.socket(zmq.PUB)
    kv_pub.linger = load_pub.linger = 0
    kv_addr = f"tcp://127.0.0.1:{kv_pub.bind_to_random_port('tcp://127.0.0.1')}"
    load_addr = f"tcp://127.0.0.1:{load_pub.bind_to_random_port('tcp://127.0.0.1')}"
    index, tracker = KvIndexer(BS), LoadTracker()
    kv = KvEventSubscriber(Resources("fuzz"), WID, kv_addr, index)
    load = LoadSubscriber(
        Resources("fuzz"), WID, load_addr,
        lambda w, ranks, _at: [tracker.report((w, r.dp_rank), r.active_blocks) for r in ranks],
    )
    kv.start()
    load.start()
    seq, load_seq, prompt = 0, 0, [3] * (2 * BS)

    def publish_valid() -> None:
        nonlocal seq, load_seq
        kv_pub.send_multipart([b"kv", seq.to_bytes(8, "big"),
                               encode_batch([BlockStored([11, 12], None, prompt, BS)], 0)])
        load_pub.send_multipart([LOAD_TOPIC, encode_report(
            LoadReport(LOAD_VERSION, WID, load_seq, 1.0, [EngineLoad(0, 7)]))])
        seq, load_seq = seq + 1, load_seq + 1

    req_sock = zctx.socket(zmq.DEALER)
    replay_sock = zctx.socket(zmq.DEALER)
    try:
        while kv.last_seq is None or load.stats.applied == 0:  # slow joiners
            publish_valid()
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        # The load itself expires (--load-report-ttl) during a long run: the view is the last
        # report applied.
        view = (index.find_matches(prompt), load.last_seq)
        for sock, addr in ((req_sock, worker.address), (replay_sock, f"tcp://127.0.0.1:"
                                                                     f"{replay_port}")):
            sock.linger = 0
            sock.connect(addr)
        for port, row in rows.items():
            row.rss_before = rss_kib(worker.pid if port in ("request", "replay") else os.getpid())
        kv_sent = load_sent = 0
        kv_base, load_base = kv.stats.received, load.stats.received

        def caught_up() -> bool:
            return (kv.stats.received - kv_base >= kv_sent
                    and load.stats.received - load_base >= load_sent)
        endpoint = f"{NAMESPACE}.backend.generate"
        deadline = time.monotonic() + args.max_seconds
        for n in range(args.frames):
            if time.monotonic() > deadline:
                print(f"--max-seconds reached after {n} frames", file=sys.stderr)
                break
            port = ports[n % len(ports)]
            row = rows[port]
            row.frames += 1
            if port == "request":
                frames = request_frames(rng, endpoint)
                req_sock.send_multipart(frames)
                if answerable(frames):
                    row.answerable += 1
                    row.answered += request_answered(req_sock, row)
            elif port == "replay":
                frames = replay_frames(rng)
                replay_sock.send_multipart(frames)
                if replay_answerable(frames):
                    row.answerable += 1
                    ok = replay_answered(replay_sock)
                    row.answered += ok
                    row.errors += ok
            elif port == "kv_events":
                frames = kv_event_frames(rng, seq)
                kv_pub.send_multipart(frames)
                kv_sent += 1
                seq += len(frames) == 3 and len(frames[1]) == 8
            else:
                frames = load_frames(rng, WID)
                load_pub.send_multipart(frames)
                load_sent += frames[0].startswith(LOAD_TOPIC)
            if n % 256 == 255:
                # Let the subscribers catch up: a PUB drops what a full queue cannot take, and a
                # dropped batch is a gap, which rightly drops the router's state.
                await wait_until(caught_up, 10)
        await wait_until(caught_up, 30)
        unchanged = (index.find_matches(prompt), load.last_seq) == view
        applied = kv.stats.applied, load.stats.applied
        publish_valid()
        followed = await kv.wait_for_seq(seq - 1)
        await wait_until(lambda: load.stats.applied > applied[1], 10)
        for port, row in rows.items():
            if port in ("request", "replay"):
                alive = worker.running()
                row.crashes = int(not alive)
                row.rss_after = rss_kib(worker.pid) if alive else 0
                row.serving = alive and (
                    streams_to_end(worker.address, NAMESPACE) if port == "request"
                    else (replay_sock.send_multipart([b"", (0).to_bytes(8, "big")]) is None
                          and replay_answered(replay_sock)))
            elif port == "kv_events":
                row.crashes = int(not kv.running)
                row.errors = kv.stats.decode_errors
                row.serving = kv.running and followed and unchanged
                row.rss_after = rss_kib(os.getpid())
            else:
                row.crashes = int(not load.running)
                row.errors = load.stats.decode_errors
                row.serving = load.running and load.stats.applied > applied[1] and unchanged
                row.rss_after = rss_kib(os.getpid())
        if not (unchanged and followed):
            print(f"router: view unchanged {unchanged}, still following {followed}: "
                  f"{kv.stats}, {load.stats}", file=sys.stderr)
        log = log_text(worker)
        print(f"worker log: {len(log.splitlines())} lines", file=sys.stderr)
        if "Traceback" in log:
            print("the worker logged a traceback:\n" + worker.logs(), file=sys.stderr)
            for port in ("request", "replay"):
                if port in rows:
                    rows[port].crashes += 1
        return rows
    finally:
        req_sock.close(linger=0)
        replay_sock.close(linger=0)
        await kv.close()
        await load.close()
        kv_pub.close(linger=0)
        load_pub.close(linger=0)
        worker.stop()


def print_table(rows: dict[str, Row], seconds: float) -> None:
    head = (f"{'port':<10} {'frames':>8} {'answerable':>10} {'answered':>9} {'errors':>8} "
            f"{'crashes':>7} {'RSS before':>11} {'RSS after':>10} {'serving':>8}")
    print(head)
    print("-" * len(head))
    for port, r in rows.items():
        print(f"{port:<10} {r.frames:>8} {r.answerable:>10} {r.answered:>9} {r.errors:>8} "
              f"{r.crashes:>7} {r.rss_before / 1024:>9.1f}MB {r.rss_after / 1024:>8.1f}MB "
              f"{'yes' if r.serving else 'NO':>8}")
    print(f"{sum(r.frames for r in rows.values())} frames in {seconds:.1f} s. Errors: "
          "InvalidArgument answers (request), answered replays (replay), messages counted as "
          "undecodable (kv_events, load).")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-path", type=Path, default=None,
                        help="a model directory (default: build the tiny test model)")
    parser.add_argument("--ports", default=",".join(PORTS))
    args = parser.parse_args()
    unknown = set(args.ports.split(",")) - set(PORTS)
    if unknown:
        parser.error(f"unknown ports {sorted(unknown)}; choose from {', '.join(PORTS)}")
    if args.model_path is None:
        from dynamo_zmq.tools.tiny_model import build_tiny_model

        args.model_path = build_tiny_model(Path(tempfile.gettempdir()) / "dynamo-zmq-tiny-model")
    started = time.monotonic()
    rows = asyncio.run(fuzz(args))
    print_table(rows, time.monotonic() - started)
    bad = any(r.crashes or r.answered < r.answerable or not r.serving for r in rows.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
