"""Worker side of ``DynamoZmqConnector``: moves KV blocks between vLLM engines over ZeroMQ, with
no service in between.

A prefill engine serves its finished prefills' blocks on a ROUTER socket (its own thread): a
decode engine's DEALER asks for a batch of blocks of one request (``read``) and gets one frame
per layer back, then says ``done`` and the prefill engine frees the blocks. Blocks of a prefill
nobody pulls are freed after their deadline; a read of an unknown, finished or expired request
is refused (the blocks may be reused). A decode engine pulls in a thread of its own, batch by
batch, one batch in flight (the prefill engine's reply is the flow control), and writes each
batch into its KV cache; a pull that fails is reported to vLLM as failed, and vLLM
(``kv_load_failure_policy="recompute"``) prefills that request locally.

With auth on (the worker's ``--auth-keys``) both sockets are CURVE: the block server admits
only authorized keys, and a pull connects only to the key the handoff names, if authorized.

Wire (msgpack): ``["read", seq, request id, [block ids]]`` -> ``[{"seq", "ok": true}, layer
frames...]`` (each layer's blocks, raw bytes in the cache's dtype and layout);
``["done", seq, request id]`` -> ``[{"seq", "ok": true}]``; a refusal is ``{"seq", "ok": false,
"error": why, "retry": bool}`` (retry: the request is not registered yet; the pull asks again).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import warnings
from typing import Any

import msgspec
import torch
import zmq

from dynamo_zmq.transport import CurveAuth, Domain, set_connect_options

from ._kv_scheduler import PullJob, ZmqConnectorMetadata

__all__ = ["WorkerSide"]

#: Under "vllm": logs of vLLM's engine-core process reach stderr through vLLM's handler.
log = logging.getLogger("vllm.dynamo_zmq.kv")

_enc, _dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
#: Released request ids remembered to refuse their reads at once.
GONE_KEPT = 4096


class PullError(Exception):
    """A pull failed (the prefill engine refused, vanished or timed out)."""


class WorkerSide:
    """The connector's worker-role half (see the module docstring).

    Args:
        bind: host:port the block server binds (``tcp://``).
        batch_blocks: blocks per ``read``.
        timeout: seconds one reply may take, and an unregistered request is retried.
    """

    def __init__(self, bind: str, num_blocks: int, batch_blocks: int, timeout: float,
                 curve: CurveAuth | None = None) -> None:
        self._bind = bind
        #: With auth on: both sockets are CURVE (the server checks clients against the
        #: authorized folder; a pull checks the prefill engine's key named in the handoff).
        self._curve = curve
        self._num_blocks = num_blocks
        self._batch = max(1, batch_blocks)
        self._timeout = timeout
        self._layers: list[torch.Tensor] = []
        self._lock = threading.Lock()
        #: Blocks kept for a pull: request id -> (block ids, deadline).
        self._sends: dict[str, tuple[set[int], float]] = {}
        self._sent: set[str] = set()
        #: Requests whose blocks were pulled or expired lately (bounded): a read of one is
        #: refused at once rather than retried as not registered yet.
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._jobs: queue.Queue[PullJob | None] = queue.Queue()
        self._stop = threading.Event()
        self._zmq = zmq.Context()
        self._threads: list[threading.Thread] = []
        #: Counters (the pull side's), also logged per request.
        self.pulled_blocks = 0
        self.pulled_bytes = 0

    # -- setup and teardown -----------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the engine's per-layer caches (block index first) and start the threads."""
        layers = [kv_caches[name] for name in sorted(kv_caches)]
        for name, t in zip(sorted(kv_caches), layers, strict=True):
            if t.shape[0] != self._num_blocks or not t.is_contiguous():
                raise ValueError(f"KV cache of layer {name} is {tuple(t.shape)}: the dynamo-zmq"
                                 f" connector needs contiguous caches with {self._num_blocks}"
                                 " blocks first")
        self._layers = layers
        server = self._zmq.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.start(self._zmq)
            self._curve.make_server(server, Domain.KV_TRANSFER)
        server.bind(f"tcp://{self._bind}")
        if self._curve is not None:
            port = server.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[-1]
            self._curve.note_bound(int(port), Domain.KV_TRANSFER)
        for target, args, name in ((self._serve, (server,), "kv-serve"),
                                   (self._pull_loop, (), "kv-pull")):
            th = threading.Thread(target=target, args=args, name=name, daemon=True)
            th.start()
            self._threads.append(th)
        log.info("dynamo-zmq KV connector: serving %d layers of %s blocks on tcp://%s",
                 len(layers), tuple(layers[0].shape[1:]) if layers else (), self._bind)

    def shutdown(self) -> None:
        self._stop.set()
        self._jobs.put(None)
        for th in self._threads:
            th.join(timeout=2)
        if self._curve is not None:
            self._curve.stop()
        self._zmq.destroy(linger=0)

    # -- the engine's step -------------------------------------------------------------------

    def bind(self, meta: ZmqConnectorMetadata) -> None:
        """Take one step's orders: register finished prefills, queue pulls."""
        if meta.sends:
            with self._lock:
                for rid, (blocks, deadline) in meta.sends.items():
                    self._sends[rid] = (set(blocks), deadline)
        for job in meta.pulls:
            self._jobs.put(job)

    def finished(self) -> tuple[set[str], set[str], set[str]]:
        """Requests whose blocks were pulled or expired (free them), whose pulls ended, and
        those of the latter that failed."""
        now = time.monotonic()
        with self._lock:
            for rid, (_, deadline) in list(self._sends.items()):
                if deadline <= now:
                    log.warning("KV of request %s was not pulled in time: freed", rid)
                    del self._sends[rid]
                    self._release(rid)
            sent, self._sent = self._sent, set()
            done, self._recv_done = self._recv_done, set()
            failed, self._recv_failed = self._recv_failed, set()
        return sent, done, failed

    def _release(self, rid: str) -> None:
        """``rid``'s blocks may be freed (called with the lock held)."""
        self._sent.add(rid)
        self._gone[rid] = None
        while len(self._gone) > GONE_KEPT:
            self._gone.popitem(last=False)

    # -- serving (prefill side) --------------------------------------------------------------

    def _serve(self, sock: zmq.Socket[bytes]) -> None:
        with sock:
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                ident, body = sock.recv_multipart()[:2]
                try:
                    frames = self._answer(_dec.decode(body))
                except Exception as exc:  # a malformed request must not end the server
                    frames = [_enc.encode({"seq": None, "ok": False, "error": str(exc),
                                           "retry": False})]
                sock.send_multipart([ident, *frames], copy=False)

    def _answer(self, msg: list[Any]) -> list[Any]:
        op, seq, rid = msg[0], msg[1], str(msg[2])
        with self._lock:
            held = self._sends.get(rid)
            if held is None:
                # Not registered yet (the engine registers it a step after it finished), or
                # already pulled or expired.
                gone = rid in self._gone
                return [_enc.encode({"seq": seq, "ok": False, "retry": op == "read" and not gone,
                                     "error": f"no KV held for request {rid}"
                                              + (" (pulled or expired)" if gone else "")})]
            if op == "done":
                del self._sends[rid]
                self._release(rid)
                return [_enc.encode({"seq": seq, "ok": True})]
            blocks = [int(b) for b in msg[3]]
            if not set(blocks) <= held[0]:
                return [_enc.encode({"seq": seq, "ok": False, "retry": False,
                                     "error": f"blocks not held for request {rid}"})]
            # Copied under the lock: the blocks cannot be freed (and reused) meanwhile.
            idx = torch.tensor(blocks, dtype=torch.long)
            data = [t.index_select(0, idx) for t in self._layers]
        return [_enc.encode({"seq": seq, "ok": True}),
                *(d.view(torch.uint8).numpy().data for d in data)]

    # -- pulling (decode side) ---------------------------------------------------------------

    def _pull_loop(self) -> None:
        socks: dict[str, zmq.Socket[bytes]] = {}
        seq = 0
        while True:
            job = self._jobs.get()
            if job is None or self._stop.is_set():
                break
            addr = f"tcp://{job.host}:{job.port}"
            start = time.monotonic()
            ok, nbytes = False, 0
            try:
                sock = socks.get(addr)
                if sock is None:
                    sock = self._zmq.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    set_connect_options(sock)
                    if self._curve is not None:
                        key = job.curve_key.encode() if job.curve_key else None
                        try:
                            self._curve.make_client(sock, key, f"KV pull from {addr}")
                        except Exception:
                            sock.close(linger=0)
                            raise
                    sock.connect(addr)
                    socks[addr] = sock
                pairs = job.pairs
                for i in range(0, len(pairs), self._batch):
                    batch = pairs[i:i + self._batch]
                    seq += 1
                    frames = self._call(sock, ["read", seq, job.remote_req_id,
                                               [r for _, r in batch]], seq)
                    nbytes += self._write([loc for loc, _ in batch], frames[1:])
                seq += 1
                self._call(sock, ["done", seq, job.remote_req_id], seq)
                ok = True
            except Exception as exc:
                if job.pairs:
                    log.warning("KV pull of request %s from %s failed (%s): prefilling it"
                                " locally", job.req_id, addr, exc)
                else:
                    log.info("KV of request %s at %s not released (%s): it expires there",
                             job.req_id, addr, exc)
                stale = socks.pop(addr, None)  # a late reply must not meet the next call
                if stale is not None:
                    stale.close(linger=0)
            if ok and job.pairs:
                log.info("dynamo-zmq KV connector: pulled %d blocks (%d bytes) of request %s"
                         " from %s in %.3f s", len(job.pairs), nbytes, job.req_id, addr,
                         time.monotonic() - start)
            if not job.pairs:  # only released the remote blocks: vLLM waits for nothing
                continue
            with self._lock:
                if ok:
                    self.pulled_blocks += len(job.pairs)
                    self.pulled_bytes += nbytes
                else:
                    self._recv_failed.add(job.req_id)
                self._recv_done.add(job.req_id)
        for sock in socks.values():
            sock.close(linger=0)

    def _call(self, sock: zmq.Socket[bytes], msg: list[Any], seq: int) -> list[Any]:
        """Send ``msg``, return the reply's frames; ask again while the prefill engine has not
        registered the request yet, up to ``timeout``."""
        deadline = time.monotonic() + self._timeout
        while True:
            sock.send(_enc.encode(msg))
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    raise PullError(f"no reply to {msg[0]} in {self._timeout} s")
                frames = sock.recv_multipart(copy=False)
                head = _dec.decode(frames[0].bytes)
                if head.get("seq") == seq:
                    break
            if head.get("ok"):
                return frames
            if not head.get("retry") or time.monotonic() >= deadline or self._stop.is_set():
                raise PullError(str(head.get("error")))
            time.sleep(0.01)

    def _write(self, local: list[int], frames: list[Any]) -> int:
        """Write one batch's layer frames into this engine's blocks ``local``."""
        if len(frames) != len(self._layers):
            raise PullError(f"{len(frames)} layers received, this engine has {len(self._layers)}")
        idx = torch.tensor(local, dtype=torch.long)
        total = 0
        # As the model runner does: the caches may be inference tensors.
        with torch.inference_mode():
            for t, frame in zip(self._layers, frames, strict=True):
                total += self._write_layer(t, idx, frame)
        return total

    @staticmethod
    def _write_layer(t: torch.Tensor, idx: torch.Tensor, frame: Any) -> int:
        """Write one layer's frame into blocks ``idx`` of ``t``; its byte count."""
        buf = frame.buffer
        shape = (len(idx), *t.shape[1:])
        if len(buf) != t.element_size() * len(idx) * t[0].numel():
            raise PullError(f"a layer of {len(buf)} bytes does not fit blocks of {shape}")
        with warnings.catch_warnings():  # read only: the buffer is not written
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(buf, dtype=torch.uint8)
        t.index_copy_(0, idx, src.view(t.dtype).view(shape))
        return len(buf)
