"""``blockctl cluster status``: a replica group's leader, term and members.

    blockctl cluster status --etcd http://HOST:2379[,...] [--group main]
    blockctl --target A,B,C cluster status   # no --etcd: asks each replica
    blockctl --target etcd://HOST:2379/main cluster status   # as --etcd --group

With ``--etcd`` it reads ``/blockd/<group>/`` (one consistent etcd read,
:func:`blockd.ha.group.read_status`): the leader and its term, the last
term, and every live member (address, role, applied LSN, how far behind the
leader's report, whether it is in the in-sync set). Without ``--etcd`` it
asks every address of ``--target`` for ``GetReplicaStatus`` (an operator
needs no access to etcd): each replica's role, term and log position, and
from the leader each follower's lag, in-sync flag and last acknowledgement;
an address that does not answer is listed as unreachable. A daemon without
``--etcd`` answers UNIMPLEMENTED: then its health is reported as a single
daemon's. Exit 0 when the group has a leader, 69 when it has none or
nothing answers. ``blockd.ha`` (the ``ha`` extra) is imported only with
``--etcd``.
"""

from __future__ import annotations

import argparse

import grpc

from blockd.core.types import ReplicaStatus
from client.cli.common import CommandFailed, Exit, emit, render_table
from client.cli.workers import check_health
from client.errors import BlockdClientError
from client.leader import parse_etcd_target
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
        from blockd.ha.etcd import EtcdUnavailable
        from blockd.ha.group import read_status
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


_REPLICA_COLUMNS = ("replica_id", "role", "address", "term", "last_lsn", "commit_lsn", "behind_leader", "in_sync",
                    "last_ack_age_s")


def _replica_rows(answers: dict[str, ReplicaStatus]) -> tuple[ReplicaStatus | None, list[dict]]:
    """The leader's status (the newest term's, should two claim it) and one row per replica:
    those that answered, and followers only the leader reported."""
    leaders = [s for s in answers.values() if s.role == "leader"]
    leader = max(leaders, key=lambda s: s.term) if leaders else None
    seen = {f.replica_id: f for f in leader.followers} if leader else {}
    rows = []
    for address, s in answers.items():
        known = seen.pop(s.replica_id, None)
        rows.append({"replica_id": s.replica_id, "role": s.role, "address": address, "term": s.term,
                     "last_lsn": s.last_lsn, "commit_lsn": s.commit_lsn,
                     "behind_leader": max(0, leader.last_lsn - s.last_lsn) if leader else None,
                     "in_sync": True if s is leader else (known.in_sync if known else None),
                     "last_ack_age_s": round(known.last_ack_age_s, 3) if known else None,
                     "streaming": s.streaming, "leader_id": s.leader_id})
    rows.extend({"replica_id": f.replica_id, "role": "follower (leader's view)", "address": f.address,  # the leader's
                 "term": None, "last_lsn": f.persisted_lsn, "commit_lsn": None, "behind_leader": f.lag_records,
                 "in_sync": f.in_sync, "last_ack_age_s": round(f.last_ack_age_s, 3), "streaming": None,
                 "leader_id": None} for f in seen.values())
    return leader, rows


def _from_replicas(client: BlockdClient, args: argparse.Namespace) -> bool:
    """Ask each address of ``--target``; False when none of them is a replica (UNIMPLEMENTED)."""
    answers: dict[str, ReplicaStatus] = {}
    unreachable: list[dict] = []
    for address in [a.strip() for a in client.target.split(",") if a.strip()]:
        with BlockdClient(address, timeout_s=client.timeout_s, max_attempts=1, follow_leader=False,
                          tls=client.tls, token=client.token) as one:
            try:
                answers[address] = one.replica_status()
            except BlockdClientError as err:
                if err.code == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                unreachable.append({"address": address, "error": f"{err.code.name}: {err.message}"})
    if not answers:
        if not unreachable:
            return False
        raise CommandFailed("no replica answered: " + "; ".join(f"{u['address']}: {u['error']}" for u in unreachable),
                            Exit.UNAVAILABLE)
    leader, rows = _replica_rows(answers)
    group = next(iter(answers.values())).group
    status = {"mode": "replicas", "group": group, "term": leader.term if leader else None,
              "leader": {"replica_id": leader.replica_id, "address": leader.leader_address} if leader else None,
              "replication": leader.mode if leader else None,
              "in_sync_replicas": leader.in_sync_replicas if leader else None,
              "replicas": rows, "unreachable": unreachable}

    def human() -> str:
        head = (f"group {group}: leader {leader.replica_id} at {leader.leader_address}, term {leader.term}, "
                f"{leader.mode}, {leader.in_sync_replicas} in sync" if leader
                else f"group {group}: NO LEADER among the replicas that answered")
        table = render_table(_REPLICA_COLUMNS, [[r[c] if r[c] is not None else "-" for c in _REPLICA_COLUMNS]
                                                for r in rows])
        return "\n".join([head, table, *(f"unreachable: {u['address']}: {u['error']}" for u in unreachable)])

    emit(args, status, human)
    if leader is None:
        raise CommandFailed(f"group {group}: no replica that answered leads it", Exit.UNAVAILABLE)
    return True


def _status(client: BlockdClient, args: argparse.Namespace) -> None:
    named = parse_etcd_target(client.target)
    if named is not None and not args.etcd:  # --target etcd://HOST:PORT/GROUP: the same as --etcd --group
        args.etcd, args.group = ",".join(named[0]), named[1]
    if args.etcd:
        _from_etcd(args)
        return
    if _from_replicas(client, args):
        return
    health = check_health(client.target, "", client.timeout_s, client.tls, client.token)
    status = {"mode": "single", "target": client.target, "status": health}
    emit(args, status, lambda: f"single daemon at {client.target} (no --etcd): {health}")
    if health != "SERVING":
        raise CommandFailed(f"{client.target} is {health}", Exit.UNAVAILABLE)


def add_cluster(sub: argparse._SubParsersAction) -> None:
    cluster = sub.add_parser("cluster", help="replica groups").add_subparsers(dest="action", required=True)
    status = cluster.add_parser("status", help="leader, term and members of a replica group (exit 69: no leader)")
    status.add_argument("--etcd", default="", help="etcd endpoints http://HOST:PORT[,...]; without it, ask each "
                                                   "replica of --target (GetReplicaStatus)")
    status.add_argument("--group", default="main", help="the replica group (blockd serve --group)")
    status.set_defaults(run=_status)


__all__ = ["add_cluster"]
