"""The transport's floor: server CPU per message of a request/response stream
that does no work, carrying the bytes of a real 256-sequence decode step.

``bench/rpc.py --part transport_floor`` prints one row per transport
(``name: transport_floor``): a ``grpc.server`` (sync, the daemon's) and a
``grpc.aio`` server each echoing over a bidirectional stream, and a plain TCP
socket with length-prefixed frames (the fastest simple baseline). The server
runs in a child process; its CPU is the process's CPU clock (user + system
time of all threads, as ``/proc`` counts them) over ``MESSAGES`` round trips of one client, after a warm-up. The
payloads are the serialized ``StepRequest`` and ``StepResponse`` of the
decode step :mod:`bench.daemon_cost` times, so the rows say how much of
``daemon_cpu_us_per_step`` no code of blockd's can take away while steps
travel over that transport (issue 29: the gRPC rows against the 300 us
target). Handlers pass bytes through (identity serializers): no protobuf.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures

MESSAGES = 3000
WARMUP = 200
TRANSPORTS = ("grpc_sync_stream", "grpc_aio_stream", "socket_frames")
_SERVICE, _METHOD = "bench.Floor", "Echo"


def step_payloads() -> tuple[bytes, bytes]:
    """The serialized request and response of one 256-sequence decode step."""
    from bench.daemon import BLOCK_SIZE, NUM_BLOCKS, NUM_SEQS
    from blockd.core import Allocate, Pool, PoolConfig
    from blockd.core.types import DecodeAppend
    from blockd.rpc import convert

    pool = Pool(PoolConfig("decode-0", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE))
    ids = [f"decode-0-{i}" for i in range(NUM_SEQS)]
    pool.step([Allocate(s, list(range(BLOCK_SIZE))) for s in ids])
    ops = [DecodeAppend(ids, [7] * NUM_SEQS)]
    request = convert.step_request_to_proto("decode-0", ops, "scheduler-1-000000000042")
    return request.SerializeToString(), convert.step_result_to_proto(pool.step(ops)).SerializeToString()


def _identity(data: bytes) -> bytes:
    return data


def _cpu_s() -> float:
    # the process's CPU clock, every thread (utime + stime as /proc has them, to the nanosecond
    # rather than /proc's 10 ms ticks: the quick run's framed socket uses about 15 ms in all)
    return time.process_time()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _serve(transport: str, response: bytes) -> None:
    """The child: serve ``transport`` on a free port, print it, then print the
    CPU seconds used between the parent's two lines on stdin."""
    def echo(requests, _context):
        for _ in requests:
            yield response

    async def aecho(requests, _context):
        async for _ in requests:
            yield response

    import grpc

    listener = None
    if transport == "grpc_sync_stream":
        handler = grpc.method_handlers_generic_handler(_SERVICE, {_METHOD: grpc.stream_stream_rpc_method_handler(
            echo, _identity, _identity)})
        server = grpc.server(futures.ThreadPoolExecutor(8))
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
    elif transport == "grpc_aio_stream":
        import threading

        ready, box = threading.Event(), []

        async def run() -> None:
            handler = grpc.method_handlers_generic_handler(_SERVICE, {_METHOD: grpc.stream_stream_rpc_method_handler(
                aecho, _identity, _identity)})
            aio = grpc.aio.server()
            aio.add_generic_rpc_handlers((handler,))
            box.append(aio.add_insecure_port("127.0.0.1:0"))
            await aio.start()
            ready.set()
            await aio.wait_for_termination()

        threading.Thread(target=lambda: asyncio.run(run()), daemon=True).start()
        ready.wait(30)
        port = box[0]
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        import threading

        def frames() -> None:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            framed = struct.pack("!I", len(response)) + response
            try:
                while True:
                    (size,) = struct.unpack("!I", _recv_exact(conn, 4))
                    _recv_exact(conn, size)
                    conn.sendall(framed)
            except (EOFError, OSError):
                conn.close()

        threading.Thread(target=frames, daemon=True).start()
    print(port, flush=True)
    sys.stdin.readline()
    began = _cpu_s()
    sys.stdin.readline()
    print(f"{_cpu_s() - began:.6f}", flush=True)


def _client(transport: str, port: int, request: bytes):
    """A function sending one request and waiting for its response, and a closer."""
    if transport == "socket_frames":
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        framed = struct.pack("!I", len(request)) + request

        def round_trip() -> None:
            sock.sendall(framed)
            (size,) = struct.unpack("!I", _recv_exact(sock, 4))
            _recv_exact(sock, size)
        return round_trip, sock.close
    import queue

    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def sent() -> Iterator[bytes]:
        while (item := outbox.get()) is not None:
            yield item
    responses = channel.stream_stream(f"/{_SERVICE}/{_METHOD}", request_serializer=_identity,
                                      response_deserializer=_identity)(sent())

    def round_trip_grpc() -> None:
        outbox.put(request)
        next(responses)

    def close() -> None:
        outbox.put(None)
        channel.close()
    return round_trip_grpc, close


def measure(transport: str, messages: int = MESSAGES) -> dict:
    request, response = step_payloads()
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", transport],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(
                                 os.path.abspath(__file__)))})
    try:
        assert child.stdin is not None and child.stdout is not None
        port = int(child.stdout.readline())
        round_trip, close = _client(transport, port, request)
        for _ in range(WARMUP):
            round_trip()
        child.stdin.write("go\n")
        child.stdin.flush()
        began = time.perf_counter()
        for _ in range(messages):
            round_trip()
        wall = time.perf_counter() - began
        child.stdin.write("stop\n")
        child.stdin.flush()
        used = float(child.stdout.readline())
        close()
    finally:
        child.kill()
        child.wait(30)
    return {"name": "transport_floor", "transport": transport, "messages": messages,
            "request_bytes": len(request), "response_bytes": len(response),
            "server_cpu_us_per_message": round(used / messages * 1e6, 1),
            "wall_us_per_round_trip": round(wall / messages * 1e6, 1), "cpus": os.cpu_count()}


def transport_floor(messages: int = MESSAGES) -> Iterator[dict]:
    """One row per transport, the framed socket first; the others carry their
    ratio against it (``ratio_cpu_vs_socket``)."""
    base = measure("socket_frames", messages)
    yield base
    for transport in TRANSPORTS[:2]:
        row = measure(transport, messages)
        socket_us = base["server_cpu_us_per_message"]
        row["ratio_cpu_vs_socket"] = round(row["server_cpu_us_per_message"] / socket_us, 2) if socket_us else None
        yield row


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "serve":
    _serve(sys.argv[2], step_payloads()[1])
