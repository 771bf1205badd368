"""The one way a follower's acknowledgement reaches the leader's commit point (``docs/ha.md`` 2.4).

An acknowledgement says "``replica_id`` has persisted up to ``persisted_lsn``
of ``term``". Whatever carried it, :meth:`AckIntake.take` checks that this
replica leads that term (a feed opened in an older term is told to open
again; NOT_LEADER otherwise) and hands it to
:meth:`blockd.replication.commits.Commits.ack`: there is no other path.

Four carriers bring them, each for a reason that still holds:

* ``StreamAcks`` (gRPC, one client stream per feed): the feeds that stay on
  gRPC (``--replication-transport grpc``, or a replication port out of the
  follower's reach). A message on an open stream costs about a quarter of
  an ``AckLog`` call;
* ``AckLog`` (gRPC, one call each): what a follower falls back to when its
  leader does not serve ``StreamAcks`` (an older blockd), and what an older
  follower calls; dropping it would break a group being upgraded one
  replica at a time;
* the replication port, plain text (:mod:`blockd.replication.transport`):
  the frames on the feed's own connection, read by the step that waits for
  them (:class:`~blockd.replication.ack_reader.AckReader`: no thread
  hand-off on the way to the commit);
* the replication port, TLS: the feed's acknowledgement connection, read by
  a thread of its own, because ``ssl`` takes no ``MSG_DONTWAIT`` and keeps
  decrypted bytes a ``select`` does not see, so the reader's non-blocking
  reads cannot serve it.

A bad acknowledgement on a socket, or one this replica refuses, ends that
feed (the follower dials again); on gRPC it is the call's status.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from blockd.core.errors import NoLeader, NotLeader
from blockd.replication.ack_reader import AckReader
from blockd.replication.commits import Commits
from blockd.replication.framing import Link
from blockd.v1 import replication_pb2 as rpb

log = logging.getLogger("blockd.replication")


class AckGate(Protocol):
    """What the intake asks its replica (:class:`blockd.replication.replica.Replica`)."""

    commits: Commits
    address: str

    def leading_term(self) -> int: ...
    def not_leader(self, why: str) -> NotLeader | NoLeader: ...


class AckIntake:
    """Every acknowledgement of one leader, from every carrier; see the module docstring."""

    def __init__(self, replica: AckGate) -> None:
        self._replica = replica

    def take(self, request: rpb.AckLogRequest | rpb.StreamAcksRequest) -> None:
        """One acknowledgement, for the term this replica leads (NotLeader / NoLeader otherwise)."""
        r = self._replica
        term = r.leading_term()
        if term and request.term < term:  # a feed opened in an older term: the follower opens it again
            raise NotLeader(f"acknowledgement for term {request.term}; this replica leads term {term}: open the "
                            f"feed again", leader_id=r.commits.replica_id, leader_address=r.address, term=term)
        if not term or request.term != term:
            raise r.not_leader(f"acknowledgement for term {request.term}; this replica does not lead it")
        r.commits.ack(term, request.replica_id, request.persisted_lsn)

    # --- the replication port ---------------------------------------------------------------------
    def watch(self, link: Link, replica_id: str, reader: AckReader) -> None:
        """Take the acknowledgements that come back on ``link`` until it closes: through
        ``reader`` in plain text, on a thread of their own over TLS."""
        if link.acks.can_try_send:
            def ended(err: BaseException | None) -> None:
                self._ended(link, replica_id, err)

            reader.add(link.acks, self._take_frame, ended)
        else:
            threading.Thread(target=self._read, args=(link, replica_id), name="repl-acks", daemon=True).start()

    @staticmethod
    def unwatch(link: Link, reader: AckReader) -> None:
        """Before ``link`` is closed (nothing for a TLS link, whose thread sees the close)."""
        reader.remove(link.acks)

    def _take_frame(self, payload: bytes) -> None:
        self.take(rpb.StreamAcksRequest.FromString(payload))

    def _read(self, link: Link, replica_id: str) -> None:
        """A TLS feed's acknowledgements, until it closes; a bad one closes it (the follower dials again)."""
        error: BaseException | None = None
        try:
            while True:
                request = link.acks.receive(rpb.StreamAcksRequest.FromString)
                if request is None:
                    return
                self.take(request)
        except Exception as err:  # noqa: BLE001 - any failure ends this feed; the follower opens it again
            error = err
        finally:
            self._ended(link, replica_id, error)

    @staticmethod
    def _ended(link: Link, replica_id: str, err: BaseException | None) -> None:
        if err is not None and not link.closed:
            log.info("acknowledgements of replica %s on the replication port ended: %s", replica_id, err)
        link.shutdown()  # the sender notices at its next message (a heartbeat within 0.1 s)
