"""One replica of a replicated group (``blockd serve --etcd``): role, gate and wiring.

:class:`Replica` is the engine's :class:`~blockd.engine.config.Replication`
gate and the election's callbacks (:class:`blockd.ha.election.Election`):

* it **leads** from the moment ``on_elected`` has been handled: the in-sync
  set loaded (the previous leader dropped from it until it catches up,
  :class:`blockd.replication.commits.Commits`), the follower loop stopped, and a
  ``term_start`` record logged in the new term. From then on the engine's
  records carry that term, ``writable()`` lets calls through while the
  election can prove its lease, and ``committed(lsn)`` waits (outside the
  engine lock) until the record is committed, with the deadline
  ``min(now + ack_timeout_s, lease validity)``, then checks the lease again;
* it **follows** otherwise: every call is refused with NOT_LEADER naming the
  leader the election last saw (NO_LEADER, UNAVAILABLE, while none is
  known), and a :class:`blockd.replication.follower.FollowerLoop` streams the
  leader's log into this replica's engine.

``on_stepped_down`` ends the leadership at once (calls in flight get
NOT_LEADER; nothing more is acknowledged), then the replica follows; its
uncommitted tail, if any, is cut by the new leader's divergence check.
Role changes run on a thread of their own: the election's callbacks must
return quickly.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from blockd.auth.config import TlsConfig
from blockd.core.errors import NoLeader, NotLeader
from blockd.core.types import FollowerStatus, ReplicaStatus
from blockd.engine.machine import Engine
from blockd.ha.election import Election, ElectionConfig, Leadership
from blockd.ha.etcd import EtcdClient
from blockd.ha.insync import InSyncSet
from blockd.replication.commits import Commits
from blockd.replication.follower import FollowerLoop
from blockd.replication.log_tail import LogTail
from blockd.replication.servicer import ReplicationServicer
from blockd.replication.transport import FramesListener, split_bind
from blockd.storage.wal import fsync_dir
from blockd.v1 import replication_pb2 as rpb

log = logging.getLogger("blockd.replication")

MODES = ("sync", "async")
TRANSPORTS = ("socket", "grpc")
#: in the data dir: the id of this copy of the log (:func:`log_identity`)
LOG_ID_FILE = "log-id"


@dataclass(frozen=True)
class ReplicaConfig:
    etcd: str
    replica_id: str
    group: str = "main"
    mode: str = "sync"
    min_in_sync: int = 2
    ack_timeout_s: float = 1.0
    ttl_s: int = 2
    margin_s: float = 0.5
    #: async mode: how far a live follower may trail the leader before steps wait (0: unbounded)
    max_lag_records: int = 100
    #: sync mode: followers in the in-sync set at most, steps wait for these (0: every caught-up one)
    sync_followers: int = 0
    #: what a follower dials its leader with (``--peer-tls-*``, ``--peer-token-file``); None: plain text
    peer_tls: TlsConfig | None = None
    peer_token: str | None = None
    #: the feeds' transport: "socket" (the replication port, :mod:`blockd.replication.transport`) or "grpc"
    transport: str = "socket"
    #: the server's ``--listen`` address: the replication port binds its host
    listen: str = "127.0.0.1:0"
    #: the replication port (``--replication-port``; 0: any free one)
    replication_port: int = 0
    #: the server's own TLS (``--tls-*``): the replication port serves it too; None: plain text
    server_tls: TlsConfig | None = None

    @property
    def frames(self) -> bool:
        """Whether feeds go on the replication port."""
        return self.transport == "socket"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--replication must be one of {MODES}, got {self.mode!r}")
        if self.min_in_sync < 1:
            raise ValueError(f"--min-in-sync must be >= 1 (the leader counts), got {self.min_in_sync}")
        if self.ack_timeout_s <= 0:
            raise ValueError(f"--ack-timeout-s must be > 0, got {self.ack_timeout_s}")
        if self.max_lag_records < 0:
            raise ValueError(f"--max-lag-records must be >= 0 (0: unbounded), got {self.max_lag_records}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--replication-transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.sync_followers < 0:
            raise ValueError(f"--sync-followers must be >= 0 (0: every follower that has caught up), got "
                             f"{self.sync_followers}")
        if self.sync_followers and self.sync_followers + 1 < self.min_in_sync:
            raise ValueError(f"--sync-followers {self.sync_followers} leaves fewer replicas in the in-sync set "
                             f"than --min-in-sync {self.min_in_sync} needs: no step could be acknowledged")


def log_identity(data_dir: str, empty: bool) -> str:
    """The id of this data dir's copy of the log (file ``LOG_ID_FILE``), made anew when the log is empty.

    The in-sync set in etcd names it (:mod:`blockd.ha.insync`): an entry
    earned by one copy of a replica's log must not let another copy lead, as
    it would after the data dir was lost (an empty log, a new id) or its
    id file with it. A log without an id file (written before ids existed,
    or damaged) also gets a new one: the safe direction, since a leader
    admits the replica again once it has caught up.
    """
    path = os.path.join(data_dir, LOG_ID_FILE)
    if not empty:
        try:
            with open(path, encoding="ascii") as f:
                found = f.read().strip()
            if found and found.isalnum():
                return found
        except (OSError, UnicodeDecodeError):
            pass
    made = uuid.uuid4().hex
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(made + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(data_dir)
    log.info("data dir %s holds log %s", data_dir, made)
    return made


class _EtcdInSync:
    """The in-sync set through one etcd client shared by the RPC threads (calls serialised)."""

    def __init__(self, endpoints: str, group: str, timeout_s: float) -> None:
        self._lock = threading.Lock()
        self._set = InSyncSet(EtcdClient(endpoints, timeout_s), group)

    def members(self) -> dict[str, str]:
        with self._lock:
            return {m.replica_id: m.log_id for m in self._set.members()}

    def add(self, term: int, replica_id: str, lsn: int, log_id: str = "") -> None:
        with self._lock:
            self._set.add(term, replica_id, lsn, log_id)

    def remove(self, term: int, replica_id: str) -> None:
        with self._lock:
            self._set.remove(term, replica_id)


class Replica:
    """See the module docstring. Build it, build the engine with it
    (``EngineConfig(replication=replica, log_observer=replica.tail)``), then
    :meth:`start` once the server's address is known."""

    def __init__(self, config: ReplicaConfig, data_dir: str) -> None:
        self.config, self.data_dir = config, data_dir
        self.tail = LogTail()
        self.commits = Commits(config.replica_id, config.mode, config.min_in_sync,
                               _EtcdInSync(config.etcd, config.group, 1.0),
                               max_lag_records=config.max_lag_records, live_s=config.ack_timeout_s,
                               max_members=config.sync_followers)
        self.stopping = threading.Event()
        self.frames: FramesListener | None = None
        self.engine: Engine
        self.election: Election | None = None
        self._term = 0  #: the term this replica leads and serves in (0: it does not)
        self._known_term = 0
        self._roles = threading.Lock()
        self._follower: FollowerLoop | None = None
        self._past_snapshots = self._past_truncations = 0  #: of follower loops that have ended
        #: called with True when this replica starts serving as leader, False when it stops
        self.on_role: Callable[[bool], None] = lambda leading: None

    # --- the engine's gate ------------------------------------------------------------------
    @property
    def term(self) -> int:
        return self._term

    def writable(self) -> None:
        election = self.election
        if not self._term or election is None or not election.can_acknowledge():
            raise self.not_leader("this replica does not lead its group")

    def committed(self, lsn: int) -> int:
        election, term = self.election, self._term
        if not term or election is None:
            raise self.not_leader("this replica stopped leading")
        deadline = min(time.monotonic() + self.config.ack_timeout_s, election.lease_valid_until())
        self.commits.wait(lsn, self.tail.last_lsn, deadline, election.can_acknowledge)
        if not election.can_acknowledge() or self._term != term:
            raise self.not_leader("this replica's lease could not be proven valid; not acknowledged")
        # kept in memory; the election writes it to this replica's member key on its next cycle, so
        # `blockctl cluster status` measures the followers against where the leader is now
        election.report_progress(self.tail.last_lsn, 0)
        return term

    @property
    def keeps_committed(self) -> bool:
        return self.config.mode == "sync" and self.config.min_in_sync >= 2

    def not_leader(self, why: str) -> NotLeader | NoLeader:
        leader = self.election.leader() if self.election is not None else None
        if leader is None or leader.replica_id == self.config.replica_id:  # stale: it names this replica
            return NoLeader(f"{why}; group {self.config.group} has no leader now: retry shortly")
        return NotLeader(f"{why}; call the leader {leader.replica_id} at {leader.address} (term {leader.term})",
                         leader_id=leader.replica_id, leader_address=leader.address, term=leader.term)

    def leading_term(self) -> int:
        return self._term

    # --- what the metrics and GetReplicaStatus read ----------------------------------------------
    def status(self) -> ReplicaStatus:
        """This replica's view of its group now (``GetReplicaStatus``, :mod:`blockd.replication.metrics`)."""
        cfg, election, follower, term = self.config, self.election, self._follower, self._term
        last = self.engine.log_state()[0]
        leader = election.leader() if election is not None else None
        role = "leader" if term else "follower" if leader is not None and leader.replica_id != cfg.replica_id \
            else "candidate"
        if not term:
            return ReplicaStatus(cfg.replica_id, cfg.group, role, max(self._known_term, leader.term if leader else 0),
                                 leader.replica_id if leader else "", leader.address if leader else "", last,
                                 follower.leader_commit_lsn if follower is not None else 0, cfg.mode,
                                 streaming=follower is not None and follower.streaming)
        view = self.commits.view(last)
        followers = tuple(FollowerStatus(f.replica_id, f.address, f.persisted_lsn, max(0, last - f.persisted_lsn),
                                         f.replica_id in view.members,
                                         max(0.0, view.now - f.last_ack) if f.last_ack else 0.0)
                          for f in sorted(view.followers, key=lambda f: f.replica_id))
        return ReplicaStatus(cfg.replica_id, cfg.group, role, term, cfg.replica_id, self.address, last,
                             view.commit_lsn, cfg.mode, in_sync_replicas=len(view.members) + 1, followers=followers)

    # --- what the metrics read (blockd.replication.metrics) ---------------------------------------------
    @property
    def follower(self) -> FollowerLoop | None:
        return self._follower

    @property
    def snapshots_installed(self) -> int:
        follower = self._follower
        return self._past_snapshots + (follower.snapshots_installed if follower is not None else 0)

    @property
    def truncations(self) -> int:
        follower = self._follower
        return self._past_truncations + (follower.truncations if follower is not None else 0)

    def _drop_follower(self) -> None:
        follower = self._follower
        if follower is not None:
            follower.stop()
            self._past_snapshots += follower.snapshots_installed
            self._past_truncations += follower.truncations
            self._follower = None

    # --- lifetime ----------------------------------------------------------------------------
    def start(self, engine: Engine, address: str) -> None:
        self.engine, self.address = engine, address
        cfg = self.config
        if cfg.frames:
            host = split_bind(cfg.listen)
            self.frames = FramesListener(host, cfg.replication_port, cfg.server_tls)
            self.commits.use_reader(self.frames.acks)
            log.info("replication port %s:%d%s", host, self.frames.port, " (TLS)" if cfg.server_tls else "")
        self.log_id = log_identity(self.data_dir, empty=engine.log_state()[0] == 0)
        self.election = Election(cfg.etcd, ElectionConfig(
            group=cfg.group, replica_id=cfg.replica_id, address=address, ttl_s=cfg.ttl_s, margin_s=cfg.margin_s,
            require_in_sync=cfg.mode == "sync", log_id=self.log_id),
            on_elected=self._elected, on_stepped_down=self._stepped_down,
            local_lsn=lambda: engine.log_state()[0], leader_heard=self._leader_heard)
        self._follow()
        self.election.start()

    def _leader_heard(self, term: int) -> bool:
        follower = self._follower
        return follower is not None and follower.heard_from(term)

    def servicer(self) -> tuple[ReplicationServicer, object]:
        return ReplicationServicer(self), rpb.DESCRIPTOR.services_by_name["ReplicationService"]

    def stop(self) -> None:
        self.stopping.set()
        if self.election is not None:
            self.election.resign()
        with self._roles:
            self._drop_follower()
        self.tail.wake()
        if self.frames is not None:
            self.frames.close()

    # --- roles ----------------------------------------------------------------------------------
    def _elected(self, leadership: Leadership) -> None:
        threading.Thread(target=self._lead, args=(leadership,), name="replica-lead", daemon=True).start()

    def _lead(self, leadership: Leadership) -> None:
        with self._roles:
            election = self.election
            assert election is not None, "elected before the election started"

            def still() -> bool:
                current = election.leadership
                return current is not None and current.term == leadership.term and not self.stopping.is_set()

            self._drop_follower()
            try:
                self.commits.begin(leadership.term, leadership.previous_leader)
            except Exception:  # etcd refused or failed: this term cannot serve; the election moves on
                log.exception("replica %s cannot take up term %d", self.config.replica_id, leadership.term)
                self._follow()
                return
            self._known_term = max(self._known_term, leadership.term)
            lsn = self.engine.begin_term(leadership.term, leadership.previous_term, self.config.replica_id, still)
            if not lsn or not still():
                self._follow()
                return
            self.commits.started(lsn)
            self._term = leadership.term
            self.on_role(True)
            election.report_progress(lsn, 0)
            log.info("replica %s serves as leader of %s in term %d (term_start at lsn %d)", self.config.replica_id,
                     self.config.group, leadership.term, lsn)

    def _stepped_down(self, leadership: Leadership, reason: str) -> None:
        self._term = 0  # at once: nothing more is acknowledged
        self.on_role(False)
        self.commits.end()
        self.tail.wake()
        if not self.stopping.is_set():
            threading.Thread(target=self._after_step_down, name="replica-follow", daemon=True).start()

    def _after_step_down(self) -> None:
        with self._roles:
            if not self._term and self._follower is None:
                self._follow()

    def _follow(self) -> None:
        if self.stopping.is_set():
            return
        election = self.election
        assert election is not None, "follow() before start()"

        def leader() -> str:
            info = election.leader()
            return info.address if info is not None and info.replica_id != self.config.replica_id else ""

        def saw(term: int) -> None:
            self._known_term = max(self._known_term, term)

        self._follower = FollowerLoop(self.config.replica_id, self.address, self.engine, self.data_dir, leader,
                                      lambda: not self._term and not self.stopping.is_set(),
                                      lambda: self._known_term, saw, election.report_progress, self.log_id,
                                      self.config.peer_tls, self.config.peer_token, frames=self.config.frames)
        self._follower.start()
