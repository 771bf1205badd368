"""The key layout of one replica group in etcd, and the values stored there.

Everything of group ``G`` lives under ``/blockd/G/``:

=========================  ==========  =====================================================
key                        lease       value (JSON)
=========================  ==========  =====================================================
``leader``                 leader's    :class:`LeaderInfo` of the current leader. Its
                                       ``create_revision`` is the leader's **term**.
``last_leader``            none        the last leader's :class:`LeaderInfo`, written in the
                                       same transaction that creates ``leader``: its
                                       ``mod_revision`` is that leader's term. A new leader
                                       reads it to learn the previous term and lease.
``members/<replica-id>``   replica's   :class:`MemberInfo`: address, role, progress.
``insync/<replica-id>``    none        :class:`InSyncEntry`: replicas that hold every
                                       acknowledged record (see :mod:`blockd.ha.insync`).
=========================  ==========  =====================================================

Group names and replica ids are restricted to ``[A-Za-z0-9._-]{1,64}`` so
that no id can reach into another key (a ``/`` in an id would). Values are
JSON objects; readers ignore fields they do not know (forward compatible)
and refuse values that lack the fields they need (:class:`BadValue`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

ROOT = "/blockd/"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class BadValue(ValueError):
    """A value in etcd is not what this layout stores there (someone else wrote it)."""


def check_name(what: str, name: str) -> str:
    """``name`` if it is a valid group name or replica id; ValueError saying why not."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{what} must be 1-64 characters of A-Z a-z 0-9 . _ -, got {name!r}")
    return name


@dataclass(frozen=True)
class GroupKeys:
    """The keys of one group (:func:`group_keys` validates the name)."""

    group: str

    @property
    def prefix(self) -> str:
        return f"{ROOT}{self.group}/"

    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    @property
    def last_leader(self) -> str:
        return self.prefix + "last_leader"

    @property
    def members_prefix(self) -> str:
        return self.prefix + "members/"

    def member(self, replica_id: str) -> str:
        return self.members_prefix + check_name("replica id", replica_id)

    @property
    def insync_prefix(self) -> str:
        return self.prefix + "insync/"

    def insync(self, replica_id: str) -> str:
        return self.insync_prefix + check_name("replica id", replica_id)


def group_keys(group: str) -> GroupKeys:
    return GroupKeys(check_name("group name", group))


def _load(raw: bytes, what: str) -> dict:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadValue(f"{what} is not JSON ({err}): {raw[:80]!r}") from None
    if not isinstance(doc, dict):
        raise BadValue(f"{what} is not a JSON object: {raw[:80]!r}")
    return doc


def _field(doc: dict, name: str, kind: type, what: str):
    value = doc.get(name)
    # bool is an int in Python; a JSON true is never a valid number here
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadValue(f"{what} lacks {kind.__name__} field {name!r}: {doc}")
    return value


@dataclass(frozen=True)
class LeaderInfo:
    """Who leads: the value of ``leader`` plus its term (the key's create_revision).

    ``address`` is what callers dial (the replica's advertised gRPC
    address); ``lease_id`` lets a successor wait for that lease to end.
    """

    replica_id: str
    address: str
    lease_id: int
    term: int = 0

    def encode(self) -> bytes:
        return json.dumps({"replica_id": self.replica_id, "address": self.address,
                           "lease_id": self.lease_id}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, term: int) -> LeaderInfo:
        doc = _load(raw, "leader value")
        return cls(_field(doc, "replica_id", str, "leader value"), _field(doc, "address", str, "leader value"),
                   _field(doc, "lease_id", int, "leader value"), term)


ROLES = ("candidate", "leader", "follower")


@dataclass(frozen=True)
class MemberInfo:
    """A replica's own report, refreshed while it lives (the key is bound to its lease).

    ``role`` is one of :data:`ROLES`; ``term`` the newest term it knows;
    ``applied_lsn`` the last log record it applied (0 before any);
    ``lag_records`` how far it knows itself behind the leader (-1: unknown);
    ``updated_unix_s`` wall time of the report, for display only.
    """

    replica_id: str
    address: str
    role: str
    term: int = 0
    applied_lsn: int = 0
    lag_records: int = -1
    updated_unix_s: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> MemberInfo:
        doc = _load(raw, "member value")
        try:
            return cls(_field(doc, "replica_id", str, "member value"), _field(doc, "address", str, "member value"),
                       _field(doc, "role", str, "member value"), int(doc.get("term", 0)),
                       int(doc.get("applied_lsn", 0)), int(doc.get("lag_records", -1)),
                       float(doc.get("updated_unix_s", 0.0)))
        except (TypeError, ValueError) as err:
            raise BadValue(f"member value {doc}: {err}") from None


@dataclass(frozen=True)
class InSyncEntry:
    """A member of the in-sync set: added by the leader of ``term`` once the
    replica had persisted every record up to ``lsn``, in the copy of its log
    named ``log_id`` (made with its data dir; "" in entries written before
    log ids existed). A replica whose data dir was lost or replaced has
    another log id, so this entry no longer vouches for it."""

    replica_id: str
    term: int
    lsn: int
    log_id: str = ""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> InSyncEntry:
        doc = _load(raw, "in-sync value")
        log_id = doc.get("log_id", "")
        if not isinstance(log_id, str):
            raise BadValue(f"in-sync value has a non-string log_id: {doc}")
        return cls(_field(doc, "replica_id", str, "in-sync value"), _field(doc, "term", int, "in-sync value"),
                   _field(doc, "lsn", int, "in-sync value"), log_id)
