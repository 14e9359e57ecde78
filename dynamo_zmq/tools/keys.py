"""CURVE keys for authenticated sockets: ``python -m dynamo_zmq.keys``.

A key directory holds this process's keypair and the public keys it trusts::

    DIR/NAME.key          the public key (ZeroMQ certificate format, shareable)
    DIR/NAME.key_secret   the secret key (mode 0600; refused when others can read it)
    DIR/authorized/*.key  public keys of the peers this process accepts, one file each

The files are ZeroMQ's certificate format (``zmq.auth.load_certificate`` reads them), so
pyzmq's ZAP authenticator can serve the ``authorized`` directory as it is. Commands::

    python -m dynamo_zmq.keys create DIR [--name NAME]      make a keypair, print the public key
    python -m dynamo_zmq.keys public DIR [--name NAME]      print the public key
    python -m dynamo_zmq.keys authorize DIR KEY [--as NAME] [--role ROLE]
                                                            trust a public key (Z85 text or file)
    python -m dynamo_zmq.keys revoke DIR NAME_OR_KEY        stop trusting it
    python -m dynamo_zmq.keys list DIR                      the trusted keys and their roles

``--role`` (``worker``, ``frontend``, ``router``, ``tool``, or ``all``; repeat it or join
with commas) says what the key's holder may do (docs/security.md has the table). Without it
a new key holds every role, as every key authorized before roles existed does, and a key
already authorized keeps its roles. The file functions live in
``dynamo_zmq.transport._keyfiles`` (the sockets use them).
"""

from __future__ import annotations

import argparse
import sys

from .. import errors
from ..transport._key_roles import KEY_ROLES, format_roles, parse_roles
from ..transport._keyfiles import (
    AUTHORIZED,
    DEFAULT_NAME,
    KeyFileError,
    TrustedKey,
    authorize,
    authorized_keys,
    create_keypair,
    load_keypair,
    parse_public_key,
    revoke,
    trusted_keys,
)

__all__ = [
    "AUTHORIZED",
    "DEFAULT_NAME",
    "KeyFileError",
    "TrustedKey",
    "authorize",
    "authorized_keys",
    "create_keypair",
    "load_keypair",
    "main",
    "parse_public_key",
    "revoke",
    "trusted_keys",
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dynamo_zmq.keys", description="Create and authorize CURVE keys."
    )
    sub = p.add_subparsers(dest="command", required=True)
    for cmd, text in (("create", "make a keypair and print its public key"),
                      ("public", "print the public key")):
        c = sub.add_parser(cmd, help=text)
        c.add_argument("dir")
        c.add_argument("--name", default=DEFAULT_NAME)
    c = sub.add_parser("authorize", help="trust a public key (Z85 text or a .key file)")
    c.add_argument("dir")
    c.add_argument("key")
    c.add_argument("--as", dest="name", default=None)
    c.add_argument("--role", action="append", default=None, metavar="ROLE",
                   help=f"what the key may do: {', '.join(KEY_ROLES)} or all (repeat, or join "
                        "with commas); default: every role for a new key, the roles it has "
                        "for a known one")
    c = sub.add_parser("revoke", help="stop trusting a key (by name or key)")
    c.add_argument("dir")
    c.add_argument("key")
    c = sub.add_parser("list", help="the trusted keys")
    c.add_argument("dir")
    return p


def _keys_as_positionals(argv: list[str]) -> list[str]:
    """Shield a Z85 key that starts with ``-`` (1 key in 85) from argparse's option parsing.

    argparse takes any word that starts with ``-`` for an option; a leading space makes it a
    positional again, and the key is stripped after parsing.
    """
    def shielded(word: str) -> str:
        if not word.startswith("-") or len(word) != 40:
            return word
        try:
            parse_public_key(word)
        except KeyFileError:
            return word
        return " " + word

    return [shielded(word) for word in argv]


def _roles_text(held: TrustedKey) -> str:
    """``worker,frontend``, or ``all`` for a key authorized without a role."""
    return format_roles(held.roles) if held.explicit else "all"


def main(argv: list[str] | None = None) -> int:
    """Run the command; 0 on success, 1 with one line on stderr for a key error."""
    args = _parser().parse_args(_keys_as_positionals(sys.argv[1:] if argv is None else argv))
    if hasattr(args, "key"):
        args.key = args.key.strip()
    try:
        if args.command == "create":
            print(create_keypair(args.dir, args.name).decode())
        elif args.command == "public":
            print(load_keypair(args.dir, args.name)[0].decode())
        elif args.command == "authorize":
            roles = None if args.role is None else parse_roles(args.role)
            name = authorize(args.dir, args.key, args.name, roles)
            held = trusted_keys(args.dir)[name]
            print(f"authorized {name} ({_roles_text(held)})")
            if not held.explicit:
                print(f"note: {name} holds every role (worker, frontend, router, tool); give "
                      "--role to restrict it", file=sys.stderr)
        elif args.command == "revoke":
            removed = revoke(args.dir, args.key)
            if not removed:
                raise KeyFileError(f"no authorized key matches {args.key!r}")
            print("revoked " + ", ".join(removed))
        else:
            for name, held in trusted_keys(args.dir).items():
                print(f"{name} {held.public.decode()} {_roles_text(held)}")
    except errors.InvalidArgument as exc:  # KeyFileError, or an unknown --role
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
