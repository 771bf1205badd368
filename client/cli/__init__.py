"""``blockctl``: the operator's CLI over the SDK.

    blockctl [--target HOST:PORT] [--json] [--timeout-s S] COMMAND ...
    blockctl pools create NAME --num-blocks N --block-size B
    blockctl pools list | show NAME | misses NAME | delete NAME | apply FILE
    blockctl pools pin POOL --tokens 1,2,... [--ttl-s S] | unpin POOL PIN_ID | pins POOL
    blockctl prefix-cache reset POOL
    blockctl workers list [--pool POOL]
    blockctl health [--service NAME]
    blockctl seq list POOL | show POOL SEQ
    blockctl events tail POOL [--from N] [--limit N] [--follow]
    blockctl top [--interval S] [--once]
    blockctl cluster status [--etcd URLS] [--group G]
    blockctl hash-spec [--pool POOL]
    blockctl report POOL (--since DURATION --prometheus URL | --for DURATION) [--every S] [--out DIR]

Human-readable tables by default; ``--json`` prints JSON (events and ``seq
list`` as one object per line, so they can be piped). The three global flags may also follow
the command (``blockctl pools list --json``). Every flag has an environment
variable, ``BLOCKCTL_<FLAG>`` (:mod:`blockd.config_env`), except ``--target``,
which reads ``BLOCKD_TARGET`` like ``blockd-worker``; the target defaults to
``127.0.0.1:50051``. Security flags go before the command: ``--tls-ca``
(verify blockd), ``--tls-cert``/``--tls-key`` (mutual TLS),
``--tls-server-name``, ``--token`` or ``--token-file`` (a bearer token;
``BLOCKCTL_TOKEN`` keeps it out of ``ps``). The exit status tells the failure class (0 ok, 2 usage,
3 not found, 4 conflict, 5 wrong state, 6 no room, 7 not allowed, 69
unavailable, 1 other: :mod:`client.cli.common`); the status and blockd's
message go to stderr as one line.

Each command group registers itself in :data:`COMMANDS` through one
``add_*(subparsers)`` function (pools in :mod:`client.cli.pools`, workers and
health in :mod:`client.cli.workers`, ``top`` in :mod:`client.cli.top`, ``cluster
status`` in :mod:`client.cli.group`, ``hash-spec`` in :mod:`client.cli.hash_spec`, ``report``
in :mod:`client.cli.report`).
"""

from __future__ import annotations

import os

# gRPC's C core reads GRPC_VERBOSITY once, when grpc is first imported: by the
# imports below (the `client` package itself loads nothing, client/__init__.py).
# Its log lines (one per failed TLS handshake, ...) only repeat what blockctl's
# own one-line message says, so they are off unless the user sets the variable.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from blockd import build_info, config_env
from blockd.auth.config import add_tls_flags, client_security
from client.channel import DEFAULT_TARGET
from client.cli.common import EPILOG, EXIT_CODES, CommandFailed, Exit, emit, jsonable, render_table
from client.cli.group import add_cluster
from client.cli.hash_spec import add_hash_spec
from client.cli.pools import add_pools, add_prefix_cache
from client.cli.report import add_report
from client.cli.top import add_top
from client.cli.workers import add_health, add_workers
from client.errors import BlockdClientError, NotFoundError
from client.groups import connect
from client.sdk import BlockdClient

#: events `events tail` shows when no --from is given, like tail(1)
TAIL_DEFAULT = 10
ENV_PREFIX = "BLOCKCTL_"
ENV_OVERRIDES = {"--target": "BLOCKD_TARGET"}


# --- sequences -----------------------------------------------------------------------
def _seq_show(client: BlockdClient, args: argparse.Namespace) -> None:
    info = client.get_sequence(args.pool, args.seq_id)

    def human() -> str:
        head = render_table(("field", "value"), [("seq_id", info.seq_id), ("num_tokens", info.num_tokens),
                                                 ("num_committed", info.num_committed),
                                                 ("num_blocks", len(info.block_table)),
                                                 ("kv_lost", info.kv_lost)])
        return f"{head}\nblock_table: {' '.join(map(str, info.block_table)) or '(empty)'}"

    emit(args, info, human)


_SEQ_COLUMNS = ("seq_id", "num_tokens", "num_committed", "num_blocks", "kv_lost")


def _seq_list(client: BlockdClient, args: argparse.Namespace) -> None:
    """One ``GetTables`` for the ids, then one ``GetSequence`` each (a table
    holds no token counts), so each line is one sequence read at one time; a
    sequence freed in between is left out. Sorted by id (the daemon answers in
    its own order); ``--json`` prints each as it is read."""
    _, tables = client.get_tables(args.pool)
    rows = []
    for seq_id in sorted(tables):
        try:
            info = client.get_sequence(args.pool, seq_id)
        except NotFoundError:
            continue
        row = {"seq_id": info.seq_id, "num_tokens": info.num_tokens, "num_committed": info.num_committed,
               "num_blocks": len(info.block_table), "block_table": info.block_table, "kv_lost": info.kv_lost}
        if args.json:
            print(json.dumps(row), flush=True)
        rows.append(row)
    if not args.json:
        print(render_table(_SEQ_COLUMNS, [[r[c] for c in _SEQ_COLUMNS] for r in rows]))


def add_seq(sub: argparse._SubParsersAction) -> None:
    seq = sub.add_parser("seq", help="inspect sequences").add_subparsers(dest="action", required=True)
    listing = seq.add_parser("list", help="a pool's sequences, one line each (--json: one object per line, "
                                          "with the block table)")
    listing.add_argument("pool")
    listing.set_defaults(run=_seq_list)
    show = seq.add_parser("show", help="a sequence's token counts and block table")
    show.add_argument("pool")
    show.add_argument("seq_id")
    show.set_defaults(run=_seq_show)


# --- events -----------------------------------------------------------------------------
# fixed widths, since a followed stream cannot be measured before printing
_EVENT_LINE = "{:>8}  {:<16}  {:<6}  {:>8}  {:<16}  {:<16}  {:>6}"


def _event_row(event) -> list[object]:
    block = event.block_id if event.block_id >= 0 else "-"
    return [event.seq_no, event.kind, event.medium if event.kind != "AllBlocksCleared" else "-", block,
            event.block_hash.hex()[:16] or "-",
            event.parent_hash.hex()[:16] or "-", len(event.token_ids)]


def _events_tail(client: BlockdClient, args: argparse.Namespace) -> None:
    """Without ``-f`` only the events that exist now are printed (at most
    ``--limit``), so the command always ends; with ``-f`` it waits for more,
    and a pool deleted meanwhile ends it with NOT_FOUND's exit status."""
    last = client.get_pool(args.pool).last_event_seq_no
    start = args.from_seq_no if args.from_seq_no is not None else max(0, last - TAIL_DEFAULT)
    wanted = None if args.follow else max(0, last - start)
    if args.limit is not None:
        wanted = args.limit if wanted is None else min(wanted, args.limit)
    if wanted == 0:
        return
    if not args.json:
        print(_EVENT_LINE.format("SEQ_NO", "KIND", "MEDIUM", "BLOCK", "HASH", "PARENT", "TOKENS"), flush=True)
    count = 0
    stream = client.events(args.pool, start)
    try:
        for event in stream:
            if args.json:
                print(json.dumps(jsonable(event)), flush=True)
            else:
                print(_EVENT_LINE.format(*_event_row(event)), flush=True)
            count += 1
            if wanted is not None and count >= wanted:
                return
    finally:
        stream.close()
    if args.follow:  # a followed stream ends only when its pool goes away (or blockd stops)
        try:
            client.get_pool(args.pool)
        except NotFoundError:
            raise CommandFailed(f"pool {args.pool!r} was deleted; its events ended", Exit.NOT_FOUND) from None
        raise CommandFailed(f"the events stream of pool {args.pool!r} ended (blockd shutting down?)",
                            Exit.UNAVAILABLE)


def add_events(sub: argparse._SubParsersAction) -> None:
    events = sub.add_parser("events", help="KV events of a pool").add_subparsers(dest="action", required=True)
    tail = events.add_parser("tail", help="print events in order (the last 10 unless --from)")
    tail.add_argument("pool")
    tail.add_argument("--from", dest="from_seq_no", type=config_env.non_negative_int, default=None,
                      help="print events after this sequence number")
    tail.add_argument("--limit", type=config_env.non_negative_int, default=None,
                      help="stop after this many events (without -f: at most those that exist now)")
    tail.add_argument("-f", "--follow", action="store_true", help="keep waiting for new events")
    tail.set_defaults(run=_events_tail)


#: command groups, each registering its subcommands
COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_pools, add_prefix_cache, add_workers, add_health, add_seq, add_events, add_top, add_cluster, add_hash_spec,
    add_report]


def _add_global_flags(parser: argparse.ArgumentParser, after_command: bool) -> None:
    """``--target``, ``--json``, ``--timeout-s``: before the command, and again
    after it (with no default there, so a flag given before is not undone)."""
    kwargs: dict[str, Any] = {"default": argparse.SUPPRESS} if after_command else {}
    parser.add_argument("--target", help="blockd (or, for health, a worker) address HOST:PORT, or a cluster of "
                        "groups: cluster://ETCD_HOST:PORT/NAME (each command goes to its pool's group)",
                        **(kwargs or {"default": DEFAULT_TARGET}))
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables",
                        **kwargs)
    parser.add_argument("--timeout-s", type=config_env.positive_float, help="deadline of each call, seconds",
                        **(kwargs or {"default": 10.0}))


def _leaves(parser: argparse.ArgumentParser):
    """The parsers of runnable commands (those without subcommands)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for action in subs:
        for child in dict.fromkeys(action.choices.values()):
            yield from _leaves(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockctl", description="inspect and manage a blockd daemon",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_global_flags(parser, after_command=False)
    parser.add_argument("--version", action="version", version=build_info.describe("blockctl"))
    add_tls_flags(parser, client=True)  # before the command only: BLOCKCTL_TLS_CA, BLOCKCTL_TOKEN, ...
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    for leaf in _leaves(parser):
        if leaf is not parser:
            _add_global_flags(leaf, after_command=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = config_env.parse_args(build_parser(), argv, ENV_PREFIX, ENV_OVERRIDES)
    try:
        tls, token = client_security(args)
        with connect(args.target, timeout_s=args.timeout_s, tls=tls, token=token) as client:
            args.run(client, args)
    except ValueError as err:  # TlsError: flags or files that cannot work
        print(f"blockctl: {err}", file=sys.stderr)
        return Exit.USAGE
    except BlockdClientError as err:
        code = EXIT_CODES.get(err.code, Exit.FAILED)
        hint = ""
        if code == Exit.UNAVAILABLE:
            hint = f" (is blockd serving at {args.target}?"
            if tls is None:  # a plain-text client against a TLS server sees only "Socket closed"
                hint += " If it serves TLS, pass --tls-ca CA.pem (and --tls-cert/--tls-key for mutual TLS)"
            hint += ")"
        print(f"blockctl: {err}{hint}", file=sys.stderr)
        return code
    except CommandFailed as err:
        print(f"blockctl: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
    except BrokenPipeError:  # e.g. piped into head(1)
        return Exit.OK
    return Exit.OK


__all__ = ["COMMANDS", "build_parser", "jsonable", "main", "render_table"]

