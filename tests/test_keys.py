"""``python -m dynamo_zmq.keys`` through the real CLI: keypairs, the trusted set and each
key's roles, and clear errors for missing, malformed or too widely readable key files and
unknown roles; the files work as ZeroMQ CURVE certificates with pyzmq's own ZAP authenticator
(an authorized client is served, an unknown one is not), roles and all."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq
import zmq.auth
from hypothesis import given
from hypothesis import strategies as st
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from dynamo_zmq.errors import InvalidArgument
from dynamo_zmq.tools.keys import KeyFileError, authorized_keys, load_keypair, trusted_keys
from dynamo_zmq.transport import EVERY_ROLE, KEY_ROLES, format_roles, parse_roles
from tests.support.procs import pythonpath


def keys(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamo_zmq.keys", *args], capture_output=True, text=True,
        timeout=60, env={**os.environ, "PYTHONPATH": pythonpath()}, check=False,
    )


def test_create_print_authorize_list_and_revoke(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    made = keys("create", str(a))
    assert made.returncode == 0, made.stderr
    public = made.stdout.strip()
    assert len(public) == 40
    assert keys("public", str(a)).stdout.strip() == public
    assert (a / "node.key_secret").stat().st_mode & 0o777 == 0o600
    again = keys("create", str(a))  # never overwrites a key
    assert again.returncode == 1 and "already exists" in again.stderr
    assert keys("public", str(a)).stdout.strip() == public

    other = keys("create", str(b), "--name", "worker1").stdout.strip()
    made = keys("authorize", str(a), str(b / "worker1.key"))
    assert made.stdout.strip() == "authorized worker1 (all)"
    assert "holds every role" in made.stderr  # no --role: said, not silent
    assert keys("authorize", str(a), public, "--as", "self").returncode == 0
    listed = keys("list", str(a)).stdout.split("\n")
    assert sorted(line for line in listed if line) == sorted(
        [f"self {public} all", f"worker1 {other} all"]
    )
    assert authorized_keys(a) == {"self": public.encode(), "worker1": other.encode()}
    clash = keys("authorize", str(a), public, "--as", "worker1")
    assert clash.returncode == 1 and "already authorized as 'worker1'" in clash.stderr
    assert keys("revoke", str(a), other).stdout.strip() == "revoked worker1"
    assert set(authorized_keys(a)) == {"self"}
    missing = keys("revoke", str(a), "nobody")
    assert missing.returncode == 1 and "no authorized key matches" in missing.stderr


def test_roles_are_written_read_changed_and_kept(tmp_path: Path) -> None:
    home, peer = tmp_path / "home", tmp_path / "peer"
    assert keys("create", str(home)).returncode == 0
    public = keys("create", str(peer), "--name", "front1").stdout.strip()
    made = keys("authorize", str(home), str(peer / "front1.key"), "--role", "frontend")
    assert made.returncode == 0 and made.stdout.strip() == "authorized front1 (frontend)"
    assert made.stderr == ""
    held = trusted_keys(home)["front1"]
    assert (held.public, held.roles, held.explicit) == (public.encode(), {"frontend"}, True)
    cert = home / "authorized" / "front1.key"
    assert 'role = "frontend"' in cert.read_text()
    assert zmq.auth.load_certificate(str(cert))[0] == public.encode()  # still pyzmq's format

    # Another role replaces the file's; authorizing again without --role keeps the roles.
    assert keys("authorize", str(home), public, "--as", "front1", "--role", "tool",
                "--role", "router").stdout.strip() == "authorized front1 (router,tool)"
    assert keys("authorize", str(home), public, "--as", "front1").stdout.strip() == (
        "authorized front1 (router,tool)")
    assert trusted_keys(home)["front1"].roles == {"router", "tool"}
    assert keys("authorize", str(home), public, "--as", "front1", "--role", "all").stdout.strip(
    ) == "authorized front1 (worker,frontend,router,tool)"
    assert sorted(p.name for p in (home / "authorized").iterdir()) == ["front1.key"]  # no debris
    listed = keys("list", str(home)).stdout.split()
    assert listed == ["front1", public, "worker,frontend,router,tool"]

    bad = keys("authorize", str(home), public, "--as", "front1", "--role", "admin")
    assert bad.returncode == 1 and "unknown key role 'admin'" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert trusted_keys(home)["front1"].roles == EVERY_ROLE  # unchanged

    # A key authorized before roles existed (a file without a role line) holds every role.
    old = home / "authorized" / "old.key"
    old.write_text(f'metadata\ncurve\n    public-key = "{public}"\n')
    legacy = trusted_keys(home)["old"]
    assert legacy.roles == EVERY_ROLE and not legacy.explicit
    assert f"old {public} all" in keys("list", str(home)).stdout
    # ...and a typo in a role is an error, never a silent lock-out or lock-in.
    old.write_text(f'metadata\n    role = "wroker"\ncurve\n    public-key = "{public}"\n')
    with pytest.raises(KeyFileError, match=r"old\.key: unknown key role 'wroker'"):
        trusted_keys(home)


def test_a_key_that_starts_with_a_dash_is_a_key_not_an_option(tmp_path: Path) -> None:
    # Z85 has "-" in its alphabet, so one public key in 85 starts with it.
    public = z85.encode(bytes([0xC5]) + os.urandom(31)).decode()
    assert public.startswith("-")
    made = keys("authorize", str(tmp_path), public, "--as", "dash")
    assert made.returncode == 0, made.stderr
    assert authorized_keys(tmp_path) == {"dash": public.encode()}
    assert keys("revoke", str(tmp_path), public).stdout.strip() == "revoked dash"
    assert authorized_keys(tmp_path) == {}


def test_bad_key_files_get_one_clear_line(tmp_path: Path) -> None:
    home = tmp_path / "k"
    absent = keys("public", str(home))
    assert absent.returncode == 1 and "no key file at" in absent.stderr
    assert "Traceback" not in absent.stderr
    assert keys("create", str(home)).returncode == 0
    secret = home / "node.key_secret"
    secret.chmod(0o644)
    loose = keys("public", str(home))
    assert loose.returncode == 1 and "readable by others (mode 0644)" in loose.stderr
    assert "chmod 600" in loose.stderr
    secret.chmod(0o600)
    secret.write_text('curve\n    public-key = "short"\n')
    bad = keys("public", str(home))
    assert bad.returncode == 1 and "malformed public key" in bad.stderr
    secret.write_text("hello\n")
    assert "not a CURVE key file" in keys("public", str(home)).stderr
    for junk in ("not-a-key", "~" * 40, "x" * 39, ""):
        out = keys("authorize", str(home), junk)
        assert out.returncode == 1 and "is not a CURVE public key" in out.stderr, out.stderr
    (home / "authorized" / "typo.key").write_text("garbage\n")
    with pytest.raises(KeyFileError, match=r"typo\.key is not a CURVE key file"):
        authorized_keys(home)  # one bad file is an error, never skipped
    secret.unlink()
    os.mkdir(secret)  # unreadable as a file
    assert "cannot read key file" in keys("public", str(home)).stderr


def test_the_files_are_zeromq_curve_certificates(tmp_path: Path) -> None:
    """pyzmq's ZAP authenticator serves the ``authorized`` directory as it is: a client whose
    key is there gets an answer, an unknown one does not, and the server goes on serving."""
    server_dir, client_dir, stranger_dir = (tmp_path / n for n in ("srv", "cli", "bad"))
    for d in (server_dir, client_dir, stranger_dir):
        assert keys("create", str(d)).returncode == 0
    assert keys("authorize", str(server_dir), str(client_dir / "node.key")).returncode == 0
    assert zmq.auth.load_certificates(str(server_dir / "authorized"))  # pyzmq reads them

    ctx = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    stop = threading.Event()
    thread: threading.Thread | None = None
    try:
        auth.configure_curve(domain="*", location=str(server_dir / "authorized"))
        server = ctx.socket(zmq.REP)
        server.curve_publickey, server.curve_secretkey = load_keypair(server_dir)
        server.curve_server = True
        server.linger = 0
        port = server.bind_to_random_port("tcp://127.0.0.1")

        def serve() -> None:
            while not stop.is_set():
                if server.poll(50):
                    server.recv()
                    server.send(b"pong")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()

        def ask(client_home: Path, wait_ms: int) -> bytes | None:
            sock = ctx.socket(zmq.REQ)
            sock.linger = 0
            sock.curve_publickey, sock.curve_secretkey = load_keypair(client_home)
            sock.curve_serverkey = load_keypair(server_dir)[0]
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(b"ping")
            try:
                return sock.recv() if sock.poll(wait_ms) else None
            finally:
                sock.close()

        assert ask(client_dir, 10_000) == b"pong"
        assert ask(stranger_dir, 2_000) is None  # the handshake is refused: no answer
        assert ask(client_dir, 10_000) == b"pong"  # and the server still serves
    finally:
        stop.set()
        if thread is not None:
            thread.join(10)
        auth.stop()
        ctx.destroy(linger=0)


@given(st.sets(st.sampled_from(KEY_ROLES), min_size=1),
       st.lists(st.sampled_from([",", " ,", ", "])))
def test_roles_round_trip_through_their_text(roles: set[str], seps: list[str]) -> None:
    text = format_roles(roles)
    assert parse_roles(text) == roles
    assert parse_roles(text.split(",")) == roles  # several words (repeated --role)
    joined = "".join(r + (seps[i] if i < len(seps) else ",") for i, r in enumerate(roles))
    assert parse_roles(joined.upper()) == roles  # spaces, case and a trailing comma


@given(st.text(min_size=1).filter(lambda w: w.strip().lower() not in (*KEY_ROLES, "all")
                                   and "," not in w and w.strip()))
def test_an_unknown_role_is_a_clear_error(word: str) -> None:
    with pytest.raises(InvalidArgument, match="unknown key role"):
        parse_roles(f"worker,{word}")
