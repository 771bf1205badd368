"""The step lane (blockd.service.lane, blockd.rpc.lane) on its own: bad bytes
are refused with a clear status and change nothing, the daemon serves on
after any of them; the lane authenticates and authorizes exactly as the gRPC
stream does (mutual TLS, tokens, tenants); a lane the client cannot reach
costs it nothing but a fallback to the gRPC stream; ``blockd serve
--step-lane-port`` serves one and says where.

That every step's answer over the lane equals the gRPC stream's and unary
Step's (refusals, idempotency, deadlines, a killed daemon, the stream slots)
is ``tests/client/test_step_stream.py``, run over both."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import ssl
import struct
import time

import pytest
from google.rpc import status_pb2

from blockd.auth import server_security, tokens
from blockd.core import Allocate, PoolConfig
from blockd.core.types import DecodeAppend
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.rpc.lane import LaneConnection, frame, hello_frame
from blockd.service import lane_loop
from blockd.service.server import BlockdServer
from blockd.storage import fsyncer as fsyncer_module
from blockd.storage.wal import WriteAheadLog
from blockd.v1 import blockd_pb2 as pb
from client import messages
from client.errors import BlockdClientError, PermissionDeniedError, UnauthenticatedError
from client.sdk import BlockdClient
from client.step_stream import _LaneCall
from tests.support.procs import start_blockd

pytest_plugins = ["tests.support.auth_fixtures", "tests.support.grpc_fixtures", "tests.support.etcd"]


@pytest.fixture
def lane_server():
    engine = Engine()
    engine.create_pool(PoolConfig("p", num_blocks=64, block_size=4))
    engine.step("p", [Allocate("a", [1, 2, 3])])
    server = BlockdServer(engine, "127.0.0.1:0", max_workers=8, grace_s=0.5, step_lane_port=0)
    server.start()
    try:
        yield server
    finally:
        server.stop(0.2)


def _step_bytes(pool: str = "p", seq: str = "a", token: int = 9) -> bytes:
    return pb.StepStreamRequest(step=messages.step_request(pool, [DecodeAppend([seq], [token])], None)
                                ).SerializeToString()


def _raw(server: BlockdServer) -> socket.socket:
    assert server.lane is not None
    return socket.create_connection(("127.0.0.1", server.lane.port), timeout=5)


def _answers(sock: socket.socket) -> list[pb.StepStreamResponse]:
    """Every answer until the daemon closes the connection."""
    reader, found = sock.makefile("rb"), []
    while True:
        head = reader.read(4)
        if len(head) < 4:
            return found
        found.append(pb.StepStreamResponse.FromString(reader.read(struct.unpack(">I", head)[0])))


def _refusal(answer: pb.StepStreamResponse) -> status_pb2.Status:
    assert answer.WhichOneof("outcome") == "error_status"
    return status_pb2.Status.FromString(answer.error_status)


def test_bad_bytes_are_refused_with_a_clear_status_change_nothing_and_the_lane_serves_on(lane_server):
    engine = lane_server.engine
    before = engine.capture()
    # not a hello: an HTTP request sent to the lane's port by mistake
    with _raw(lane_server) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        (answer,) = _answers(sock)
        assert _refusal(answer).code == 3 and "StepLaneHello" in _refusal(answer).message  # INVALID_ARGUMENT
    # a frame longer than the daemon's message limit: refused unread, the connection closed
    with _raw(lane_server) as sock:
        sock.sendall(hello_frame([]) + struct.pack(">I", (64 << 20) + 1) + b"x" * 100)
        (answer,) = _answers(sock)
        status = _refusal(answer)
        assert status.code == 8 and "over this end's limit" in status.message  # RESOURCE_EXHAUSTED
    # a request that does not parse is refused in band, and the connection reads on
    with _raw(lane_server) as sock:
        sock.sendall(hello_frame([]) + frame(b"\xff\xff\xff") + frame(_step_bytes(seq="nobody")))
        sock.shutdown(socket.SHUT_WR)
        first, second = _answers(sock)
        assert _refusal(first).code == 3
        assert _refusal(second).code == 5 and "nobody" in _refusal(second).message  # NOT_FOUND
    # a connection that ends inside a frame, and one that never says hello
    with _raw(lane_server) as sock:
        sock.sendall(hello_frame([]) + struct.pack(">I", 500) + b"half")
    with _raw(lane_server) as sock:
        sock.sendall(b"\x00\x00")
    assert engine.capture() == before
    # the lane still serves, and its answer is the step's
    connection = LaneConnection("127.0.0.1", lane_server.lane.port, [])
    try:
        answer = pb.StepStreamResponse.FromString(connection.exchange(_step_bytes()))
        assert answer.response.results[0].slot_mapping == [3]
    finally:
        connection.close()
    assert engine.sequence_info("p", "a").num_tokens == 4


def test_the_lane_checks_callers_as_the_grpc_port_does(pki, tmp_path):
    """Mutual TLS with an identities file: a client certificate, a token, a
    token of another tenant, and no credentials at all; a plain-text caller
    at a TLS lane gets nothing."""
    ids = str(tmp_path / "ids.json")
    acme = tokens.add_token(ids, "sched", "acme", ["scheduler"])
    globex = tokens.add_token(ids, "other", "globex", ["scheduler"])
    admin = tokens.add_token(ids, "adm", "acme", ["admin"])
    security = server_security("127.0.0.1:0", pki.server_tls(mutual=False), ids)
    engine = Engine(EngineConfig(quotas=security.quota_source()))
    server = BlockdServer(engine, "127.0.0.1:0", max_workers=8, grace_s=0.5, interceptors=security.interceptors,
                          credentials=security.credentials, step_lane_port=0, lane_tls=pki.server_tls(mutual=False))
    server.start()
    try:
        assert server.lane is not None and server.lane.tls
        with BlockdClient(server.address, tls=pki.tls(), token=admin) as client:
            client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
        with BlockdClient(server.address, tls=pki.tls(), token=acme) as client, client.step_stream() as stream:
            assert stream.step("p", [Allocate("a", [1, 2, 3])]).results[0].num_tokens == 3
            assert isinstance(stream._call, _LaneCall)
        before = engine.capture()
        with BlockdClient(server.address, tls=pki.tls(), token=globex) as client, client.step_stream() as stream, \
                pytest.raises(PermissionDeniedError, match="globex"):
            stream.step("p", [Allocate("b", [1, 2, 3])])
        # no token and no certificate: the lane's answer is gRPC's, UNAUTHENTICATED, and nothing is applied
        connection = LaneConnection("127.0.0.1", server.lane.port, [], tls=ssl.create_default_context(cafile=pki.ca))
        try:
            status = _refusal(pb.StepStreamResponse.FromString(connection.exchange(_step_bytes())))
            assert status.code == 16 and "no credentials" in status.message
        finally:
            connection.close()
        # plain text at a TLS lane: the handshake fails, nothing is read as a step
        with _raw(server) as sock:
            sock.sendall(hello_frame([("authorization", f"Bearer {acme}")]) + frame(_step_bytes()))
            with contextlib.suppress(ConnectionResetError):  # closed with the caller's bytes unread: a reset
                assert _answers(sock) == []
        assert engine.capture() == before
    finally:
        server.stop(0.2)
    # mutual TLS: the client certificate says who calls, as on the gRPC port
    security = server_security("127.0.0.1:0", pki.server_tls(mutual=True), None)
    server = BlockdServer(Engine(), "127.0.0.1:0", max_workers=8, grace_s=0.5, interceptors=security.interceptors,
                          credentials=security.credentials, step_lane_port=0, lane_tls=pki.server_tls(mutual=True))
    server.start()
    try:
        with BlockdClient(server.address, tls=pki.tls("admin")) as admin_client:
            admin_client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
        with BlockdClient(server.address, tls=pki.tls("scheduler")) as client, client.step_stream() as stream:
            assert stream.step("p", [Allocate("a", [1, 2])]).results[0].num_tokens == 2
            assert isinstance(stream._call, _LaneCall)
        with BlockdClient(server.address, tls=pki.tls("reader")) as client, client.step_stream() as stream, \
                pytest.raises(PermissionDeniedError, match="step"):
            stream.step("p", [Allocate("r", [1, 2])])
    finally:
        server.stop(0.2)


def test_a_lane_out_of_reach_costs_a_fallback_to_the_grpc_stream(lane_server, caplog):
    assert lane_server.lane is not None
    lane_server.lane.stop()  # the port is gone: as a firewall or an unexposed port would leave it
    with caplog.at_level(logging.WARNING, "blockd.client"), BlockdClient(lane_server.address, timeout_s=5) as client:
        with client.step_stream() as stream:
            assert stream.decode_append("p", ["a"], [5]).slot_mapping == (3,)
            assert stream._call is not None and not isinstance(stream._call, _LaneCall)
            assert stream.decode_append("p", ["a"], [6]).slot_mapping == (4,)
        with client.step_stream() as again:  # within LANE_RETRY_S: no second connect, no second warning
            assert again.decode_append("p", ["a"], [7]).slot_mapping == (5,)
    assert sum("out of reach" in r.getMessage() for r in caplog.records) == 1
    with BlockdClient(lane_server.address, timeout_s=5, step_lane=False) as client, client.step_stream() as stream:
        assert stream.decode_append("p", ["a"], [8]).slot_mapping == (6,)
        assert not isinstance(stream._call, _LaneCall)


def test_a_client_without_tls_settings_at_a_tls_lane_is_told_and_uses_grpc(pki):
    """A lane that speaks TLS to a client given no TLS files cannot happen through
    gRPC (that client could not call at all); the lane refuses it in words."""
    with pytest.raises(ValueError, match="TLS files"):
        BlockdServer(Engine(), "127.0.0.1:0", credentials=server_security(
            "127.0.0.1:0", pki.server_tls(mutual=False), None).credentials, step_lane_port=0)


def test_blockd_serve_serves_a_lane_when_asked_and_refuses_a_bad_port(run_module):
    proc = start_blockd("--step-lane-port", "0")
    try:
        with BlockdClient(proc.address, timeout_s=5) as client, client.step_stream() as stream:
            client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
            assert stream.step("p", [Allocate("a", [1, 2, 3])]).results[0].num_tokens == 3
            assert isinstance(stream._call, _LaneCall)
            port = client._blocks.GetStepLane(pb.GetStepLaneRequest()).port
        assert f"blockd step lane on 127.0.0.1:{port}" in proc.output()
    finally:
        proc.kill()
    done = run_module("blockd.cli", "serve", "--listen", "127.0.0.1:0", "--step-lane-port", "70000")
    assert done.returncode == 2 and "--step-lane-port: must be a port number" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_plain_daemon_says_it_has_no_lane_and_the_sdk_streams_over_grpc():
    server = BlockdServer(Engine(), "127.0.0.1:0", max_workers=8)
    server.start()
    try:
        with BlockdClient(server.address, timeout_s=5) as client, client.step_stream() as stream:
            assert client._blocks.GetStepLane(pb.GetStepLaneRequest()).port == 0
            client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
            stream.step("p", [Allocate("a", [1, 2, 3])])
            assert not isinstance(stream._call, _LaneCall)
    finally:
        server.stop(0.2)


def test_unauthenticated_lane_answer_is_raised_as_grpc_would(pki, tmp_path):
    """Server-auth TLS and a token file: a client with no token steps over the lane
    and is refused UNAUTHENTICATED, exactly as its gRPC stream would be."""
    ids = str(tmp_path / "ids.json")
    tokens.add_token(ids, "sched", "acme", ["scheduler"])
    security = server_security("127.0.0.1:0", pki.server_tls(mutual=False), ids)
    server = BlockdServer(Engine(), "127.0.0.1:0", max_workers=8, interceptors=security.interceptors,
                          credentials=security.credentials, step_lane_port=0, lane_tls=pki.server_tls(mutual=False))
    server.start()
    try:
        for lane in (True, False):
            with BlockdClient(server.address, tls=pki.tls(), step_lane=lane) as client, \
                    client.step_stream() as stream, pytest.raises(UnauthenticatedError, match="credentials"):
                stream.step("p", [Allocate("a", [1])])
    finally:
        server.stop(0.2)


def test_a_lane_past_its_connection_limit_answers_streams_full_and_the_sdk_steps_on():
    """Past ``max_connections`` the lane answers STEP_STREAMS_FULL without
    reading and closes, lingering until the caller closes: closed at once,
    the caller's unread hello and step reset the connection, and the reset
    beat the answer ("Broken pipe"), so the SDK retried into the same
    refusal until its deadline instead of stepping by unary Step."""
    import time

    from blockd.core.types import Append
    from blockd.rpc.lane import hello_frame
    from blockd.service import lane

    server = BlockdServer(Engine(), "127.0.0.1:0", max_workers=4, step_lane_port=0)  # 2 slots + 16 connections
    server.start()
    held: list[socket.socket] = []
    try:
        assert server.lane is not None
        with BlockdClient(server.address, timeout_s=5) as client:
            client.create_pool(PoolConfig("p", num_blocks=64, block_size=4))
            for _ in range(18):
                held.append(_raw(server))
                held[-1].sendall(hello_frame([]))
            time.sleep(0.2)  # every one accepted: the lane has no connection left
            with client.step_stream() as stream:
                stream.step("p", [Allocate("a", [1, 2, 3])])
                for token in range(30):
                    stream._unary_until = 0.0  # try the lane again each step: turned away each time
                    stream.step("p", [Append("a", [token])])
                    assert stream._call is None and stream._unary_until > time.monotonic()  # went by unary
            assert client.get_sequence("p", "a").num_tokens == 33
            deadline = time.monotonic() + 5
            while server.lane._lingering._value != lane.LINGERING:  # every turned-away connection closed
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        for sock in held:
            sock.close()
        server.stop(0.2)


def test_a_stalled_caller_never_stalls_the_others(lane_server):
    """All lane connections share one thread (blockd.service.lane_loop): one
    that sends half a frame, and one that sends steps and reads no answer,
    cost the others nothing."""
    engine = lane_server.engine
    half, flood = _raw(lane_server), _raw(lane_server)
    try:
        half.sendall(hello_frame([]) + struct.pack(">I", 500) + b"half")
        dry = pb.StepStreamRequest(step=messages.step_request("p", [DecodeAppend(["a"], [7])], None, dry_run=True))
        flood.sendall(hello_frame([]) + frame(dry.SerializeToString()) * 2000)  # 2,000 answers nobody reads
        connection = LaneConnection("127.0.0.1", lane_server.lane.port, [])
        connection._sock.settimeout(5)  # a stall fails the test rather than hanging it
        try:
            for token in range(20):
                answer = pb.StepStreamResponse.FromString(connection.exchange(_step_bytes(token=token)))
                assert answer.WhichOneof("outcome") == "response", answer
        finally:
            connection.close()
        assert engine.sequence_info("p", "a").num_tokens == 3 + 20  # the dry runs changed nothing
    finally:
        half.close()
        flood.close()


def _alloc_frame(seq: str) -> bytes:
    return frame(pb.StepStreamRequest(step=messages.step_request("p", [Allocate(seq, [1, 2])], None))
                 .SerializeToString())


def _durable_lane(tmp_path, syncs: list, max_workers: int = 8) -> BlockdServer:
    engine = Engine(EngineConfig(data_dir=str(tmp_path), fsync="always", observe_wal_sync=syncs.append))
    engine.create_pool(PoolConfig("p", num_blocks=64, block_size=4))
    server = BlockdServer(engine, "127.0.0.1:0", max_workers=max_workers, grace_s=0.5, step_lane_port=0)
    server.start()
    return server


def test_a_round_of_steps_shares_one_fsync_and_answers_after_it(tmp_path):
    syncs: list[float] = []
    server = _durable_lane(tmp_path, syncs)
    try:
        wal, before = server.engine._durability._wal, len(syncs)
        with _raw(server) as sock:
            # eight steps in one write: one round of the loop, so one fsync covers them
            sock.sendall(hello_frame([]) + b"".join(_alloc_frame(f"s{i}") for i in range(8)))
            sock.shutdown(socket.SHUT_WR)
            answers = _answers(sock)
        assert [a.WhichOneof("outcome") for a in answers] == ["response"] * 8
        assert wal.durable_lsn == wal.lsn  # every answered record is on disk
        assert len(syncs) - before < 8, f"{len(syncs) - before} fsyncs for 8 steps sent at once"
    finally:
        server.stop(0.2)


def _fsyncer_build(build: str, monkeypatch) -> None:
    """The lane's fsyncer from now on: ``compiled`` (skips where it was not) or ``python``."""
    if build == "compiled" and fsyncer_module.BUILD != "compiled":
        if os.environ.get("BLOCKD_EXPECT_COMPILED") == "1":
            pytest.fail(f"BLOCKD_EXPECT_COMPILED=1 but the fsyncer runs as {fsyncer_module.BUILD}")
        pytest.skip(f"the fsyncer runs as {fsyncer_module.BUILD}")
    monkeypatch.setattr(lane_loop, "Fsyncer", functools.partial(fsyncer_module.Fsyncer, python=build == "python"))


@pytest.mark.parametrize(("connections", "build"), [(1, "python"), (3, "python"), (3, "compiled")])
def test_a_failed_fsync_refuses_every_held_answer(tmp_path, monkeypatch, connections, build):
    """Whether the round's wait runs on the loop's thread (one connection) or
    behind it on its fsyncer (several; compiled or Python), an fsync that
    fails answers no step OK."""
    _fsyncer_build(build, monkeypatch)
    server = _durable_lane(tmp_path, [])
    assert server.lane._loop._fsyncer.build == build
    socks = [_raw(server) for _ in range(connections)]
    try:
        for sock in socks:
            sock.sendall(hello_frame([]))
        # the first connection's step is answered once the others are in the loop
        first = LaneConnection("127.0.0.1", server.lane.port, [])
        first.exchange(_alloc_frame("warm")[4:])
        first.close()

        def fails(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fdatasync", fails)  # the loop's own sync and the Python fsyncer's
        pipe = os.pipe()
        if build == "compiled":  # the C thread's fdatasync is not Python's: a pipe's fails for real (EINVAL)
            def on_a_pipe(self, lsn: int, fsyncer) -> bool:
                fsyncer.request(pipe[1], self._written_lsn)
                return True

            monkeypatch.setattr(WriteAheadLog, "sync_behind", on_a_pipe)
        for i, sock in enumerate(socks):
            sock.sendall(_alloc_frame(f"s{i}"))
            sock.shutdown(socket.SHUT_WR)
        for sock in socks:
            (answer,) = _answers(sock)
            status = _refusal(answer)
            # INTERNAL; or FAILED_PRECONDITION for a step of a later round, which finds the log broken
            assert status.code in (13, 9) and "write-ahead log failed" in status.message
        assert server.engine._durability.broken
        monkeypatch.undo()
        for fd in pipe:
            os.close(fd)
    finally:
        for sock in socks:
            sock.close()
        server.stop(0.2)


@pytest.mark.parametrize("build", ["compiled", "python"])
def test_several_connections_answer_only_what_the_fsyncer_made_durable(tmp_path, monkeypatch, build):
    """With three connections the waits go behind the loop: an answer leaves
    only once its record is durable (the Python fsyncer's disk is made slow, so
    an early answer would be seen), and steps sent on all three at once are all
    answered, their records on disk."""
    _fsyncer_build(build, monkeypatch)
    if build == "python":
        real = os.fdatasync

        def slow(fd: int) -> None:
            time.sleep(0.02)
            real(fd)

        monkeypatch.setattr(os, "fdatasync", slow)
    syncs: list[float] = []
    server = _durable_lane(tmp_path, syncs, max_workers=16)  # room for six step streams
    wal = server.engine._durability._wal
    conns = [LaneConnection("127.0.0.1", server.lane.port, []) for _ in range(3)]
    socks: list[socket.socket] = []
    try:
        for n in range(9):  # one step at a time: its record is the log's next
            lsn = wal.lsn + 1
            answer = pb.StepStreamResponse.FromString(conns[n % 3].exchange(_alloc_frame(f"one-{n}")[4:]))
            assert answer.WhichOneof("outcome") == "response", answer
            assert wal.durable_lsn >= lsn, f"answered with record {lsn} not durable ({wal.durable_lsn})"
        assert len(syncs) >= 9 and server.lane._loop._fsyncer.build == build
        socks = [_raw(server) for _ in range(3)]
        for sock in socks:
            sock.sendall(hello_frame([]))
        for sock in socks:  # all at once
            sock.sendall(b"".join(_alloc_frame(f"{sock.fileno()}-{i}") for i in range(5)))
            sock.shutdown(socket.SHUT_WR)
        for sock in socks:
            got = _answers(sock)
            assert [a.WhichOneof("outcome") for a in got] == ["response"] * 5, [_refusal(a) for a in got[:1]]
        assert wal.durable_lsn == wal.lsn
    finally:
        for conn in conns:
            conn.close()
        for sock in socks:
            sock.close()
        server.stop(0.2)


def test_a_replicated_leaders_lane_answers_in_its_term(etcd_server, tmp_path):
    """The loop holds a round's answers for one replication ack; each answer
    then says the term it was acknowledged in, as the gRPC stream's does."""
    proc = start_blockd("--etcd", etcd_server.url, "--group", f"lane-{os.getpid()}", "--replica-id", "r0",
                        "--data-dir", str(tmp_path / "r0"), "--replication", "sync", "--min-in-sync", "1",
                        "--step-lane-port", "0")
    try:
        with BlockdClient(proc.address, timeout_s=10) as client:
            deadline = time.monotonic() + 30
            while True:  # until it leads
                try:
                    client.create_pool(PoolConfig("p", num_blocks=16, block_size=4))
                    break
                except BlockdClientError:
                    assert time.monotonic() < deadline, "the replica never led"
                    time.sleep(0.1)
            term = client.step("p", [Allocate("a", [1])]).term
            assert term > 0
            port = client._blocks.GetStepLane(pb.GetStepLaneRequest()).port
        connection = LaneConnection("127.0.0.1", port, [])
        try:
            answer = pb.StepStreamResponse.FromString(connection.exchange(_alloc_frame("b")[4:]))
        finally:
            connection.close()
        assert answer.WhichOneof("outcome") == "response" and answer.response.term == term
    finally:
        proc.kill()


def test_pipelined_and_split_frames_over_tls_are_answered_in_order(pki, tmp_path):
    """Over TLS the loop reads what OpenSSL has decrypted already (frames
    sent in one write, a frame split over two), never waiting on the socket for it."""
    ids = str(tmp_path / "ids.json")
    token = tokens.add_token(ids, "sched", "acme", ["admin"])
    security = server_security("127.0.0.1:0", pki.server_tls(mutual=False), ids)
    server = BlockdServer(Engine(EngineConfig(quotas=security.quota_source())), "127.0.0.1:0", max_workers=8,
                          grace_s=0.5, interceptors=security.interceptors, credentials=security.credentials,
                          step_lane_port=0, lane_tls=pki.server_tls(mutual=False))
    server.start()
    try:
        with BlockdClient(server.address, tls=pki.tls(), token=token) as client:
            client.create_pool(PoolConfig("p", num_blocks=64, block_size=4))
        context = ssl.create_default_context(cafile=pki.ca)
        with context.wrap_socket(_raw(server), server_hostname="localhost") as sock:
            sock.settimeout(5)  # a frame the loop leaves unread fails the test rather than hanging it
            sock.sendall(hello_frame([("authorization", f"Bearer {token}")])
                         + b"".join(_alloc_frame(f"s{i}") for i in range(8)))
            reader, answers = sock.makefile("rb"), []

            def answer() -> pb.StepStreamResponse:
                head = reader.read(4)
                return pb.StepStreamResponse.FromString(reader.read(struct.unpack(">I", head)[0]))

            # the steps came in the hello's TLS record: decrypted when the hello was read, nothing left on the socket
            answers += [answer() for _ in range(8)]
            last = _alloc_frame("s8")
            sock.sendall(last[:7])  # a frame split over two TLS records
            time.sleep(0.2)
            sock.sendall(last[7:])
            answers.append(answer())
            reader.close()
        assert [a.WhichOneof("outcome") for a in answers] == ["response"] * 9
        assert [a.response.results[0].seq_id for a in answers] == [f"s{i}" for i in range(9)]
        assert [a.response.version for a in answers] == list(range(1, 10))
    finally:
        server.stop(0.2)
