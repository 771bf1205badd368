"""A follower's acknowledgements (:class:`blockd.replication.follower.AckStream`) over real gRPC.

The acknowledgements of a live group travel on ``StreamAcks`` (every sync
step in ``tests/blockd/replication/test_ha_replication.py`` waits for them). Here: a leader
that does not serve the stream (an older blockd: only ``AckLog``) still
gets every acknowledgement, one call each; and a stream the leader ends
with an error makes the next ``send`` raise it, so the feed is reopened.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from blockd.replication.follower import AckStream
from blockd.v1 import replication_pb2 as rpb
from blockd.v1 import replication_pb2_grpc as rpb_grpc


class OlderLeader(rpb_grpc.ReplicationServiceServicer):
    """Serves AckLog only: the generated base answers UNIMPLEMENTED for StreamAcks."""

    def __init__(self) -> None:
        self.acks: list[tuple[str, int, int]] = []

    def AckLog(self, request, context):
        self.acks.append((request.replica_id, request.term, request.persisted_lsn))
        return rpb.AckLogResponse()


class RefusingLeader(rpb_grpc.ReplicationServiceServicer):
    def StreamAcks(self, request_iterator, context):
        next(request_iterator)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this replica does not lead term 7")


def _serve(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rpb_grpc.add_ReplicationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _until(check, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_a_leader_without_the_stream_gets_every_acknowledgement_as_calls():
    leader = OlderLeader()
    server, address = _serve(leader)
    try:
        with grpc.insecure_channel(address) as channel:
            acks = AckStream(rpb_grpc.ReplicationServiceStub(channel))
            try:
                lsn = 0
                # the stream's UNIMPLEMENTED arrives asynchronously: until then acks go on it and
                # are lost, which is harmless (they are cumulative); after it every one is a call
                deadline = time.monotonic() + 10
                while not leader.acks:
                    assert time.monotonic() < deadline, "never fell back to AckLog"
                    lsn += 1
                    acks.send("r1", 7, lsn)
                    time.sleep(0.01)
                for _ in range(3):
                    lsn += 1
                    acks.send("r1", 7, lsn)
                assert leader.acks[-3:] == [("r1", 7, lsn - 2), ("r1", 7, lsn - 1), ("r1", 7, lsn)]
            finally:
                acks.close()
    finally:
        server.stop(None)


def test_an_error_that_ends_the_stream_is_raised_by_the_next_send():
    server, address = _serve(RefusingLeader())
    try:
        with grpc.insecure_channel(address) as channel:
            acks = AckStream(rpb_grpc.ReplicationServiceStub(channel))
            try:
                acks.send("r1", 7, 1)
                ended = threading.Event()

                def raises() -> bool:
                    try:
                        acks.send("r1", 7, 2)
                    except grpc.RpcError as err:
                        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
                        assert "does not lead term 7" in err.details()
                        ended.set()
                    return ended.is_set()

                _until(raises, "send to raise the stream's error")
            finally:
                acks.close()
    finally:
        server.stop(None)


def test_close_ends_the_stream_without_sending_more():
    leader = OlderLeader()
    server, address = _serve(leader)
    try:
        with grpc.insecure_channel(address) as channel:
            acks = AckStream(rpb_grpc.ReplicationServiceStub(channel))
            acks.close()
            with pytest.raises((grpc.RpcError, ConnectionError)):
                _until(lambda: acks.send("r1", 7, 1) and False, "a closed stream to refuse", timeout_s=5)
    finally:
        server.stop(None)


def test_a_stream_closed_after_the_leader_refused_it_sends_no_more_calls():
    """An older leader's UNIMPLEMENTED has ended the call before ``close``: the
    acknowledgements must not go on as ``AckLog`` calls (the race made the test above flaky)."""
    leader = OlderLeader()
    server, address = _serve(leader)
    try:
        with grpc.insecure_channel(address) as channel:
            acks = AckStream(rpb_grpc.ReplicationServiceStub(channel))
            _until(acks._call.done, "the leader to refuse the stream")
            acks.close()
            with pytest.raises(ConnectionError, match="closed"):
                acks.send("r1", 7, 1)
            assert leader.acks == []
    finally:
        server.stop(None)


def test_a_feed_that_ends_the_same_way_again_is_logged_once_at_info():
    """During a failover the old leader refuses every retry (UNAVAILABLE every
    0.2 s) until the election names the next: one INFO line, then DEBUG."""
    import logging

    from blockd.replication.follower import Repeats

    ends = Repeats()
    assert ends.level("a:1", "UNAVAILABLE gone") == logging.INFO
    assert ends.level("a:1", "UNAVAILABLE gone") == logging.DEBUG
    assert ends.level("a:1", "UNAVAILABLE gone") == logging.DEBUG
    assert ends.level("b:1", "UNAVAILABLE gone") == logging.INFO  # another leader: say it
    assert ends.level("b:1", "CANCELLED stop") == logging.INFO  # another end: say it
