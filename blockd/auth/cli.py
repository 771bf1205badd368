"""``blockd tokens ...`` and ``blockd certs ...`` (also ``python -m blockd.auth``).

    blockd tokens add FILE --name router-0 --tenant acme --role scheduler   # prints the token once
    blockd tokens list FILE                                                 # names, tenants, roles
    blockd tokens remove FILE --name router-0                               # revoke
    blockd tokens metrics-user USERS --user prometheus                      # basic auth for /metrics
    blockd certs dev DIR | ca DIR | server DIR ... | client DIR ...           # development certificates

FILE is the identities file of ``blockd serve --tokens-file``
(:mod:`blockd.auth.tokens`); after changing it, run ``blockd reload
--pid-file FILE`` (SIGHUP, waiting for the daemon's answer) or send the
daemon SIGHUP yourself (``kill -HUP``; in Kubernetes, a mounted Secret changes on its own and the
sidecar or the operator sends the signal) and the change takes effect for
new calls without a restart. The token is printed on stdout, alone on its
line, and stored nowhere but in the caller's hands; the file keeps its
SHA-256. :func:`add_commands` registers both groups on a parser so
``blockd`` and ``python -m blockd.auth`` share them. Standard library only
(plus :mod:`blockd.auth.certs`, which needs ``cryptography``, when used).
"""

from __future__ import annotations

import argparse
import json
import sys

from blockd import config_env
from blockd.auth.config import CERT_DAYS
from blockd.auth.identity import DEFAULT_TRUST_DOMAIN, ROLES, BadIdentity, Identity
from blockd.auth.tokens import IdentitiesFileError, add_token, read_for_edit, remove_token


def _tokens(args: argparse.Namespace) -> int:
    try:
        if args.tokens_command == "add":
            Identity(args.name, args.tenant, frozenset(args.role), "token")  # validate before writing
            print(add_token(args.file, args.name, args.tenant, args.role))
            print(f"token for {args.name}@{args.tenant} stored (hashed) in {args.file}; it is shown only "
                  "now. Run blockd reload --pid-file FILE (or send blockd SIGHUP) to load it.", file=sys.stderr)
        elif args.tokens_command == "remove":
            if not remove_token(args.file, args.name):
                print(f"blockd tokens: no token named {args.name!r} in {args.file}", file=sys.stderr)
                return 3
            print(f"removed {args.name!r}; run blockd reload --pid-file FILE (or send blockd SIGHUP) to "
                  "revoke it now", file=sys.stderr)
        elif args.tokens_command == "metrics-user":
            from blockd.auth.metrics_endpoint import add_user

            print(add_user(args.file, args.user))
            print(f"password for {args.user!r} stored (hashed) in {args.file}; it is shown only now",
                  file=sys.stderr)
        else:
            data = read_for_edit(args.file)
            for entry in data.get("tokens", []):
                print(json.dumps({k: entry.get(k) for k in ("name", "tenant", "roles", "created")}))
    except (BadIdentity, IdentitiesFileError, OSError, ValueError) as err:
        print(f"blockd tokens: {err}", file=sys.stderr)
        return 2
    return 0


def _certs(args: argparse.Namespace) -> int:
    from blockd.auth import certs  # cryptography only when asked for

    try:
        return certs.run(args)
    except (OSError, ValueError) as err:
        print(f"blockd certs: {err}", file=sys.stderr)
        return 2


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``tokens`` and ``certs`` (each sets ``args.run``)."""
    tokens = sub.add_parser("tokens", help="bearer tokens in an identities file (stored hashed)")
    tokens.set_defaults(run=_tokens)
    actions = tokens.add_subparsers(dest="tokens_command", required=True)
    add = actions.add_parser("add", help="make a token, store its hash, print it once")
    add.add_argument("file")
    add.add_argument("--name", required=True, help="who holds it (unique in the file)")
    add.add_argument("--tenant", required=True)
    add.add_argument("--role", action="append", choices=ROLES, required=True, help="repeat for several")
    listing = actions.add_parser("list", help="the tokens' names, tenants and roles (never the tokens)")
    listing.add_argument("file")
    remove = actions.add_parser("remove", help="revoke a token by name")
    remove.add_argument("file")
    remove.add_argument("--name", required=True)
    metrics = actions.add_parser("metrics-user", help="a basic-auth user for the /metrics endpoint: prints "
                                                      "its password once, stores its hash in FILE")
    metrics.add_argument("file")
    metrics.add_argument("--user", required=True)

    certs = sub.add_parser("certs", help="development certificates: a CA, server and client certificates")
    certs.set_defaults(run=_certs)
    add_cert_commands(certs.add_subparsers(dest="certs_command", required=True))


def add_cert_commands(sub: argparse._SubParsersAction) -> None:
    """The ``ca``, ``server``, ``client`` and ``dev`` subcommands of :mod:`blockd.auth.certs`."""
    for name, text in (("ca", "a new CA (ca.pem, ca-key.pem)"),
                       ("dev", "a CA, a server certificate for localhost and an admin client certificate"),
                       ("server", "a server certificate signed by DIR's CA"),
                       ("client", "a client certificate carrying a blockd identity, signed by DIR's CA")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("dir", help="where the files go (and where ca.pem/ca-key.pem are)")
        cmd.add_argument("--days", type=config_env.positive_float, default=3650 if name == "ca" else CERT_DAYS,
                         help="validity in days")
        cmd.set_defaults(certs_command=name)
        if name in ("server", "dev"):
            cmd.add_argument("--host", action="append", default=None,
                             help="a DNS name or IP address clients dial (repeat; default localhost, "
                                  "127.0.0.1, ::1)")
        if name == "client":
            cmd.add_argument("--host", action="append", default=None,
                             help="for a worker, which serves with the same certificate: a DNS name or IP "
                                  "address schedulers dial it at (repeat)")
        if name in ("server", "client"):
            cmd.add_argument("--name", default="blockd" if name == "server" else None, required=name == "client",
                             help="the certificate's CN and file name")
        if name == "client":
            cmd.add_argument("--tenant", required=True)
            cmd.add_argument("--role", action="append", choices=ROLES, required=True, help="repeat for several")
            cmd.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blockd.auth", description="blockd's tokens and certificates")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
