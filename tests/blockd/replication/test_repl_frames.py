"""The replication transport's framed socket (:mod:`blockd.replication.transport`, its frames
:mod:`blockd.replication.framing`, the feed :mod:`blockd.replication.feeds`) on real loopback sockets:
a ticket admits one connection to the feed it was offered for, anything else is closed, and
frames that cannot be messages of the feed end the connection instead of being guessed at."""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
import threading
import time

import pytest

from blockd.replication.feeds import LinkFeed
from blockd.replication.framing import FrameError, Link
from blockd.replication.log_tail import LogTail
from blockd.replication.transport import FramesListener, connect, split_bind
from blockd.v1 import replication_pb2 as rpb


@pytest.fixture
def listener():
    frames = FramesListener("127.0.0.1")
    yield frames
    frames.close()


pytest_plugins = ["tests.support.auth_fixtures"]


def _feed_both_ways(leader: Link, follower: Link) -> None:
    sent = rpb.ReplicateLogResponse(records=rpb.LogRecords(records=[
        rpb.LogRecord(lsn=7, term=3, body=b'{"op":"x"}' * 1000, crc32=1)]), term=3, commit_lsn=6)
    leader.records.send(sent)
    leader.records.send(rpb.ReplicateLogResponse(heartbeat=rpb.ReplicateHeartbeat(), term=3))
    assert follower.records.receive(rpb.ReplicateLogResponse.FromString) == sent
    assert follower.records.receive(rpb.ReplicateLogResponse.FromString).WhichOneof("kind") == "heartbeat"
    follower.acks.send(rpb.StreamAcksRequest(replica_id="r1", term=3, persisted_lsn=7))
    assert leader.acks.receive(rpb.StreamAcksRequest.FromString).persisted_lsn == 7
    follower.close()
    assert leader.acks.receive(rpb.StreamAcksRequest.FromString) is None  # the end, not a message


def test_a_ticket_admits_its_feed_and_messages_go_both_ways(listener):
    offer = listener.offer()
    follower = connect("127.0.0.1:1", offer.port, offer.ticket)  # the host of the address dialled
    leader = offer.wait(5)
    assert leader is not None and leader.records is leader.acks  # plain text: one connection
    try:
        _feed_both_ways(leader, follower)
    finally:
        leader.close()


def test_over_tls_a_feed_takes_a_connection_each_way_and_the_leader_is_verified(pki):
    listener = FramesListener("127.0.0.1", tls=pki.server_tls(mutual=True))
    try:
        offer = listener.offer()
        follower = connect(f"localhost:{50051}", offer.port, offer.ticket, pki.tls("admin"))
        leader = offer.wait(5)
        assert leader is not None and leader.records is not leader.acks
        try:
            _feed_both_ways(leader, follower)
        finally:
            leader.close()
        # a follower that trusts another CA, or (mutual TLS) brings no certificate, gets nothing
        offer = listener.offer()
        with pytest.raises(ssl.SSLError):
            connect("127.0.0.1:1", offer.port, offer.ticket, pki.tls("admin", ca=pki.path("rogue")))
        with pytest.raises((ssl.SSLError, ConnectionError)):  # a TLS alert, or a reset
            connect("127.0.0.1:1", offer.port, offer.ticket, pki.tls(None)).records.receive(bytes)
        assert offer.wait(0.5) is None
    finally:
        listener.close()


def test_a_ticket_is_good_once_and_a_wrong_one_is_closed(listener):
    offer = listener.offer()
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as wrong:
        wrong.sendall(bytes(32) + b"B")
        assert wrong.recv(1) == b""
    assert offer.wait(0.2) is None  # spent: the feed gives up on it
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as late:
        late.sendall(offer.ticket + b"B")
        assert late.recv(1) == b""


@pytest.mark.parametrize(("raw", "why"), [
    (struct.pack(">I", 1 << 30), "larger than any message"),
    (struct.pack(">I", 100) + b"x" * 10, r"inside a frame \(10 of 100 bytes\)"),
    (b"\0\0", "inside a frame's length"),
])
def test_a_frame_that_cannot_be_a_message_ends_the_connection(listener, raw, why):
    offer = listener.offer()
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as peer:
        peer.sendall(offer.ticket + b"B")
        leader = offer.wait(5)
        assert leader is not None
        peer.sendall(raw)
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match=why):
            leader.acks.receive(rpb.StreamAcksRequest.FromString)
        leader.close()


def test_the_replication_port_binds_the_host_of_the_listen_address():
    assert split_bind("127.0.0.1:50051") == "127.0.0.1"
    assert split_bind("[::1]:0") == "::1"
    assert split_bind(":50051") == "0.0.0.0"


class _Leading:
    """What a feed asks its replica: the term it leads, the commit point, the log's tail."""

    def __init__(self, tail: LogTail) -> None:
        self.tail, self.stopping = tail, threading.Event()

    def leading_term(self) -> int:
        return 5

    @property
    def commits(self) -> _Leading:
        return self

    def commit_lsn(self, lsn: int) -> int:
        return lsn


@contextlib.contextmanager
def _running_feed(listener: FramesListener, send_buffer: int = 0, send_timeout_s: float | None = None):
    """A socket feed of a fresh tail (term 5), pushing and with its thread running: ``(tail, follower)``."""
    tail = LogTail()
    tail.reset(0)
    link, follower = _linked(listener)
    if send_buffer:  # pushes find it full and send part of a frame
        link.records.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    link.records.settimeout(send_timeout_s)
    feed = LinkFeed(link, 5, 1, _Leading(tail))
    feed.attach()
    stop = threading.Event()
    thread = threading.Thread(target=feed.run, args=(lambda: not stop.is_set(), None), daemon=True)
    thread.start()
    try:
        yield tail, follower
    finally:
        stop.set()
        feed.detach()
        link.close()
        thread.join(5)
        follower.close()


def _received_lsns(follower: Link, records: int, pause_s: float = 0.0) -> list[int]:
    got: list[int] = []
    while len(got) < records:
        time.sleep(pause_s)
        msg = follower.records.receive(rpb.ReplicateLogResponse.FromString)
        assert msg is not None
        got += [r.lsn for r in msg.records.records]
    return got


@pytest.mark.parametrize("slow_follower", [False, True])
def test_a_socket_feed_delivers_every_record_once_and_in_order(listener, slow_follower):
    """Records pushed by the appending thread and sent by the feed's own thread
    (when a push finds it sending, or finds the socket full and leaves the rest
    of a frame to it) reach the follower each once, in order."""
    records = 400
    with _running_feed(listener, send_buffer=4096 if slow_follower else 0) as (tail, follower):
        for lsn in range(1, records + 1):
            tail.record(lsn, 5, str(lsn).encode() * (2000 if slow_follower else 10))
            if lsn % 50 == 0:
                time.sleep(0.01)
        assert _received_lsns(follower, records, 0.001 if slow_follower else 0.0) == list(range(1, records + 1))


def test_a_push_never_waits_for_a_follower_that_stopped_reading(listener):
    """The step that logs a record pushes it under the engine lock: with the socket's
    send timeout the leader sets (30 s) and buffers a stopped follower has left full,
    a push must come back at once, and the feed's thread sends the rest once the
    follower reads again, each record once and in order."""
    body = b"r" * 20_000
    records, slowest = 200, 0.0  # 4 MB: more than the socket buffers hold
    with _running_feed(listener, send_buffer=4096, send_timeout_s=30) as (tail, follower):  # 30 s: as ReplicateLog
        for lsn in range(1, records + 1):
            started = time.monotonic()
            tail.record(lsn, 5, body)
            slowest = max(slowest, time.monotonic() - started)
        assert slowest < 1.0, f"a push waited {slowest:.1f} s for a follower that does not read"
        assert _received_lsns(follower, records) == list(range(1, records + 1))


def _linked(listener: FramesListener) -> tuple[Link, Link]:
    offer = listener.offer()
    follower = connect("127.0.0.1:1", offer.port, offer.ticket)
    leader = offer.wait(5)
    assert leader is not None
    return leader, follower


def _ack(follower: Link, lsn: int) -> None:
    follower.acks.send(rpb.StreamAcksRequest(replica_id="r1", term=3, persisted_lsn=lsn))


def test_acknowledgements_no_step_waits_for_are_read_by_the_readers_own_thread(listener):
    leader, follower = _linked(listener)
    got: list[tuple[int, str]] = []
    listener.acks.add(leader.acks, lambda payload: got.append(
        (rpb.StreamAcksRequest.FromString(payload).persisted_lsn, threading.current_thread().name)),
        lambda err: None)
    for lsn in (1, 2, 3):
        _ack(follower, lsn)
    deadline = time.monotonic() + 5
    while len(got) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [(1, "repl-acks"), (2, "repl-acks"), (3, "repl-acks")]
    listener.acks.remove(leader.acks)
    leader.close()
    follower.close()


def test_a_waiter_reads_what_arrives_and_a_bad_or_closed_feed_ends_alone(listener):
    """The waiting thread handles the acknowledgement itself; a frame no message can be
    ends that feed (and only it) with FrameError, a follower's close ends its feed."""
    reader = listener.acks
    (good, good_follower), (bad, bad_follower), (gone, gone_follower) = (_linked(listener) for _ in range(3))
    handled: list[tuple[int, int]] = []
    ended: dict[str, BaseException | None] = {}
    for name, link in (("good", good), ("bad", bad), ("gone", gone)):
        reader.add(link.acks, lambda payload: handled.append(
            (rpb.StreamAcksRequest.FromString(payload).persisted_lsn, threading.get_ident())),
            lambda err, name=name: ended.__setitem__(name, err))
    assert reader.has_links
    threading.Timer(0.2, _ack, (good_follower, 7)).start()
    deadline = time.monotonic() + 5
    while not handled and time.monotonic() < deadline:
        reader.read(0.05)
    assert handled == [(7, threading.get_ident())], "the waiter did not read the acknowledgement itself"
    bad_follower.acks.socket.sendall(struct.pack(">I", 1 << 30))
    gone_follower.close()
    while len(ended) < 2 and time.monotonic() < deadline:
        reader.read(0.05)
    assert isinstance(ended["bad"], FrameError) and ended["gone"] is None and "good" not in ended
    _ack(good_follower, 8)
    while len(handled) < 2 and time.monotonic() < deadline:
        reader.read(0.05)
    assert [lsn for lsn, _ in handled] == [7, 8]
    for link in (good, bad, gone):
        reader.remove(link.acks)
        link.close()
    good_follower.close()
    bad_follower.close()
