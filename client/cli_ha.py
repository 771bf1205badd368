"""``blockctl cluster status``: a replica group's leader, term and members.

    blockctl cluster status --etcd http://HOST:2379[,...] [--group main]
    blockctl cluster status                  # no --etcd: asks blockd at --target

With ``--etcd`` it reads ``/blockd/<group>/`` (one consistent etcd read,
:func:`blockd.ha.cluster.read_status`): the leader and its term, the last
term, and every live member (address, role, applied LSN, how far behind the
leader's report, whether it is in the in-sync set). Exit 0 when the group
has a leader, 69 when it has none or etcd does not answer. Without
``--etcd`` it asks blockd at ``--target`` for its health and reports a
single daemon (a replicated daemon will answer ``GetReplicaStatus``; see
``docs/ha.md``). ``blockd.ha`` (the ``ha`` extra) is imported only here.
"""

from __future__ import annotations

import argparse

from client.cli_cluster import check_health
from client.cli_common import CommandFailed, Exit, emit, render_table
from client.sdk import BlockdClient

_MEMBER_COLUMNS = ("replica_id", "role", "address", "term", "applied_lsn", "behind_leader", "in_sync",
                   "updated_unix_s")


def _human(status: dict) -> str:
    leader = status["leader"]
    head = (f"group {status['group']}: leader {leader['replica_id']} at {leader['address']}, term {status['term']}"
            if leader else f"group {status['group']}: NO LEADER (last term {status['last_term']})")
    rows = [[m[c] if m[c] is not None else "-" for c in _MEMBER_COLUMNS] for m in status["members"]]
    lines = [head, render_table(_MEMBER_COLUMNS, rows) if rows else "(no live members)"]
    lines += [f"unreadable: {bad}" for bad in status["bad_values"]]
    return "\n".join(lines)


def _from_etcd(args: argparse.Namespace) -> None:
    try:
        from blockd.ha.cluster import read_status
        from blockd.ha.etcd import EtcdUnavailable
    except ImportError as err:
        raise CommandFailed(f"--etcd needs the ha extra (pip install 'blockd[ha]'): {err}", Exit.USAGE) from None
    try:
        status = read_status(args.etcd, args.group, args.timeout_s).to_dict()
    except ValueError as err:  # a malformed endpoint or group name
        raise CommandFailed(str(err), Exit.USAGE) from None
    except EtcdUnavailable as err:
        raise CommandFailed(f"{err} (is etcd serving at {args.etcd}?)", Exit.UNAVAILABLE) from None
    emit(args, status, lambda: _human(status))
    if status["leader"] is None:
        raise CommandFailed(f"group {args.group} has no leader", Exit.UNAVAILABLE)


def _status(client: BlockdClient, args: argparse.Namespace) -> None:
    if args.etcd:
        _from_etcd(args)
        return
    health = check_health(client.target, "", client.timeout_s)
    status = {"mode": "single", "target": client.target, "status": health}
    emit(args, status, lambda: f"single daemon at {client.target} (no --etcd): {health}")
    if health != "SERVING":
        raise CommandFailed(f"{client.target} is {health}", Exit.UNAVAILABLE)


def add_cluster(sub: argparse._SubParsersAction) -> None:
    cluster = sub.add_parser("cluster", help="replica groups").add_subparsers(dest="action", required=True)
    status = cluster.add_parser("status", help="leader, term and members of a replica group (exit 69: no leader)")
    status.add_argument("--etcd", default="", help="etcd endpoints http://HOST:PORT[,...]; without it, ask --target")
    status.add_argument("--group", default="main", help="the replica group (blockd serve --group)")
    status.set_defaults(run=_status)


__all__ = ["add_cluster"]
