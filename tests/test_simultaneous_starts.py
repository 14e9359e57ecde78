"""No start-up port races (issue 31 item 6): 32 workers started at the same moment on one host
(a namespace host, zero configuration: no ``--port``, system port 0, KV events on), and
every socket of every one binds a port the kernel picks (port 0) and advertises the port it got.
None fails with EADDRINUSE, all are READY, a frontend on the same host lists all 32, and each
serves a request.
"""

from __future__ import annotations

from pathlib import Path

from dynamo_zmq.tools.child_process import ChildProcess
from tests.support.cluster import cluster, frontend, served_by, wait_until

WORKERS = 32


def test_32_workers_started_at_once_on_one_host_all_serve(tiny_model: Path) -> None:
    with cluster("a") as built:
        host = built["a"]
        argv = ["-m", "dynamo_zmq.worker", "--engine", "mocker", "--model-path", str(tiny_model),
                "--model-name", "tiny", "--speedup-ratio", "1000", "--system-port", "0"]
        procs: list[ChildProcess] = [host.python(*argv, ready=False) for _ in range(WORKERS)]
        for proc in procs:
            proc.wait_ready(240)
        logs = "".join(proc.logs() for proc in procs)
        assert "Address already in use" not in logs and "EADDRINUSE" not in logs
        ids = {proc.instance_id for proc in procs}
        assert len(ids) == WORKERS
        assert len({proc.address for proc in procs}) == WORKERS  # a port of its own each

        frontend(host)
        http = host.http(8000)

        def listed() -> set[int]:
            body = http.get("/health").json()
            return {int(i, 16) for i in body.get("models", {}).get("tiny", [])}

        assert wait_until(lambda: listed() == ids, 120), sorted(ids - listed())
        client = host.openai_client(8000)
        served: set[int] = set()
        for _ in range(4 * WORKERS):  # round-robin: each worker within WORKERS requests
            raw = client.completions.with_raw_response.create(model="tiny", prompt="hi",
                                                              max_tokens=1)
            raw.parse()
            served.add(served_by(raw))
            if served == ids:
                break
        assert served == ids
