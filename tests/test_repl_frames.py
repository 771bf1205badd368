"""The replication transport's framed socket (:mod:`blockd.repl_frames`) on real loopback sockets:
a ticket admits one connection to the feed it was offered for, anything else is closed, and
frames that cannot be messages of the feed end the connection instead of being guessed at."""

from __future__ import annotations

import socket
import struct

import pytest

from blockd.repl_frames import FrameError, FramesListener, connect, split_bind
from blockd.v1 import replication_pb2 as rpb


@pytest.fixture
def listener():
    frames = FramesListener("127.0.0.1")
    yield frames
    frames.close()


def test_a_ticket_admits_its_feed_and_messages_go_both_ways(listener):
    offer = listener.offer()
    follower = connect("127.0.0.1:1", offer.port, offer.ticket)  # the host of the address dialled
    leader = offer.wait(5)
    assert leader is not None
    try:
        sent = rpb.ReplicateLogResponse(records=rpb.LogRecords(records=[
            rpb.LogRecord(lsn=7, term=3, body=b'{"op":"x"}' * 1000, crc32=1)]), term=3, commit_lsn=6)
        leader.send(sent)
        leader.send(rpb.ReplicateLogResponse(heartbeat=rpb.ReplicateHeartbeat(), term=3))
        assert follower.receive(rpb.ReplicateLogResponse.FromString) == sent
        assert follower.receive(rpb.ReplicateLogResponse.FromString).WhichOneof("kind") == "heartbeat"
        follower.send(rpb.StreamAcksRequest(replica_id="r1", term=3, persisted_lsn=7))
        assert leader.receive(rpb.StreamAcksRequest.FromString).persisted_lsn == 7
        follower.close()
        assert leader.receive(rpb.StreamAcksRequest.FromString) is None  # the end, not a message
    finally:
        leader.close()


def test_a_ticket_is_good_once_and_a_wrong_one_is_closed(listener):
    offer = listener.offer()
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as wrong:
        wrong.sendall(bytes(32))
        assert wrong.recv(1) == b""
    assert offer.wait(0.2) is None  # spent: the feed gives up on it
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as late:
        late.sendall(offer.ticket)
        assert late.recv(1) == b""


@pytest.mark.parametrize(("raw", "why"), [
    (struct.pack(">I", 1 << 30), "larger than any message"),
    (struct.pack(">I", 100) + b"x" * 10, r"inside a frame \(10 of 100 bytes\)"),
    (b"\0\0", "inside a frame's length"),
])
def test_a_frame_that_cannot_be_a_message_ends_the_connection(listener, raw, why):
    offer = listener.offer()
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as peer:
        peer.sendall(offer.ticket)
        leader = offer.wait(5)
        assert leader is not None
        peer.sendall(raw)
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match=why):
            leader.receive(rpb.StreamAcksRequest.FromString)
        leader.close()


def test_the_replication_port_binds_the_host_of_the_listen_address():
    assert split_bind("127.0.0.1:50051") == "127.0.0.1"
    assert split_bind("[::1]:0") == "::1"
    assert split_bind(":50051") == "0.0.0.0"
