"""``ReplicationService``, the replication protocol's gRPC adapter on the leader (``docs/ha.md`` 2.3).

:class:`ReplicationServicer` converts requests and calls the replication
core; it keeps no state of its own but the frames shared by its feeds.

* ``ReplicateLog`` opens a feed: it checks where the follower's log stops
  agreeing with the leader's (their term histories,
  :func:`blockd.core.terms.common_prefix`) and tells it to cut its tail
  there, registers the follower with the commit point, then either streams
  the feed on the call (:func:`blockd.replication.feeds.grpc_feed`) or, for
  a follower that asks for frames, sends a ``FramesOffer`` and runs the
  feed on the replication port (:class:`blockd.replication.feeds.LinkFeed`,
  :mod:`blockd.replication.transport`), its acknowledgements taken by
  :class:`blockd.replication.acks.AckIntake`;
* ``StreamAcks`` and ``AckLog`` hand every acknowledgement to the same
  intake (that module says why each carrier exists);
* ``GetReplicaStatus`` answers the replica's view
  (:meth:`blockd.replication.replica.Replica.status`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Protocol

from blockd.core.terms import TermHistory, common_prefix
from blockd.core.types import ReplicaStatus
from blockd.replication.acks import AckGate, AckIntake
from blockd.replication.feeds import FeedSource, LinkFeed, PushedFrames, Snapshot, grpc_feed, snapshot_messages
from blockd.replication.transport import CONNECT_S, FramesListener
from blockd.rpc.convert import replica_status_to_proto
from blockd.rpc.errors import client_stream, server_stream, unary
from blockd.v1 import replication_pb2 as rpb
from blockd.v1 import replication_pb2_grpc as rpb_grpc

log = logging.getLogger("blockd.replication")

#: a socket feed whose follower takes no bytes for this long is closed (it may be applying a snapshot)
FRAMES_SEND_S = 30.0


class Leading(FeedSource, AckGate, Protocol):
    """What the servicer asks the replica (:class:`blockd.replication.replica.Replica`)."""

    frames: FramesListener | None  #: the replication port (None: feeds stay on gRPC)

    def status(self) -> ReplicaStatus: ...


class ReplicationServicer(rpb_grpc.ReplicationServiceServicer):
    def __init__(self, replica: Leading) -> None:
        self._replica = replica
        self._acks = AckIntake(replica)
        self._pushed = PushedFrames()

    @server_stream
    def ReplicateLog(self, request: rpb.ReplicateLogRequest, context) -> Iterator[rpb.ReplicateLogResponse]:
        r = self._replica
        term = r.leading_term()
        if not term:
            raise r.not_leader("only the leader serves its log")
        if request.term > term:
            raise r.not_leader(f"the follower knows term {request.term}, newer than this leader's {term}")
        last, history, _ = r.engine.log_state()
        theirs = TermHistory((t.term, t.first_lsn) for t in request.terms)
        agreed = common_prefix(history, last, theirs, request.from_lsn - 1)
        if agreed < request.from_lsn - 1:
            log.info("replica %s: its log stops agreeing after lsn %d (it has %d): cut", request.replica_id,
                     agreed, request.from_lsn - 1)
            yield rpb.ReplicateLogResponse(truncate=rpb.TruncateTo(lsn=agreed), term=term)
            return
        r.commits.opened(term, request.replica_id, request.address, request.from_lsn - 1, request.log_id)
        frames = r.frames
        if not request.frames or frames is None:
            yield from grpc_feed(r, term, request.from_lsn, context.is_active)
            return
        offer = frames.offer()
        yield rpb.ReplicateLogResponse(frames=rpb.FramesOffer(port=offer.port, ticket=offer.ticket), term=term)
        link = offer.wait(CONNECT_S)
        if link is None:
            log.warning("replica %s did not connect to the replication port %d in %g s; it dials again (over "
                        "gRPC if the port stays out of its reach)", request.replica_id, offer.port, CONNECT_S)
            return
        # a follower that stops reading (paused, partitioned) blocks a send at most this long
        link.records.settimeout(FRAMES_SEND_S)
        link.acks.settimeout(FRAMES_SEND_S)
        self._acks.watch(link, request.replica_id, frames.acks)
        feed = LinkFeed(link, term, request.from_lsn, r, self._pushed)
        feed.attach()
        try:
            feed.run(lambda: context.is_active() and not link.closed, self._snapshot)
        except OSError as err:
            log.info("the feed of replica %s on the replication port ended: %s", request.replica_id, err)
        finally:
            feed.detach()
            self._acks.unwatch(link, frames.acks)
            link.close()

    def _snapshot(self, term: int) -> Snapshot:
        return snapshot_messages(self._replica, term)

    @unary
    def AckLog(self, request: rpb.AckLogRequest, context) -> rpb.AckLogResponse:
        self._acks.take(request)
        return rpb.AckLogResponse()

    @client_stream
    def StreamAcks(self, requests: Iterator[rpb.StreamAcksRequest], context) -> rpb.StreamAcksResponse:
        acks = 0
        for request in requests:
            self._acks.take(request)
            acks += 1
        return rpb.StreamAcksResponse(acks=acks)

    @unary
    def GetReplicaStatus(self, request: rpb.GetReplicaStatusRequest, context) -> rpb.GetReplicaStatusResponse:
        return replica_status_to_proto(self._replica.status())
