"""Steps over one long-lived ``BlockService.StepStream`` call: :class:`StepStream`.

A scheduler that steps every iteration pays, with unary ``Step``, for a new call each time: on
the daemon that set-up (a call object, the handler's thread, the status and trailers) is part of
every step's CPU (``bench/rpc.py --part daemon_cost`` measures how much). On a stream each step is
one request message and one answer message, in order; blockd answers each as ``Step`` would (the
same idempotency by request id, the same refusals, raised here as the same :mod:`client.errors`
exceptions) and the stream stays open after a refusal.

What holds on a stream that unary calls give for free, kept here:

* a deadline per step: a watchdog thread cancels the stream when an answer
  is late; the step raises :class:`~client.errors.DeadlineExceededError` and,
  as with a unary deadline, may or may not have been applied (resend it with
  its request id);
* a broken stream (the daemon restarted, the connection dropped) raises the
  call's error for the step in flight, and the next step opens a new stream;
* a replicated group: a refusal that names the leader, or a replica gone
  down, moves the client on (:mod:`client.leader`) and the same request is
  sent again on a stream to the next replica within the step's deadline,
  exactly as :meth:`client.sdk.BlockdClient.step` resends a unary call.

A daemon serves at most half its ``--max-workers`` step streams at once (each holds one of its
threads); beyond that it answers the first step with ``STEP_STREAMS_FULL`` (nothing applied) and
:class:`StepStream` (and :class:`AsyncStepStream`) sends that step, and the next ones for
``UNARY_AFTER_FULL_S``, by unary ``Step``.

Credentials are checked when a stream opens (as for ``Watch``); a revoked
token keeps a stream it already opened until the stream ends.

The step lane: when the daemon serves one (``blockd serve
--step-lane-port``; ``GetStepLane`` says where), a stream opens as a lane
connection instead (:mod:`blockd.rpc.lane`: the same messages, framed over
TCP or TLS with the client's own TLS files and token), for a fraction of
the daemon's CPU per step; everything above holds the same. A lane that
cannot be reached (a firewall, a port not exposed) costs one connect of at
most 2 s, logged once, and the client steps over the gRPC stream for
:data:`LANE_RETRY_S` before it tries the lane again. ``BlockdClient(...,
step_lane=False)`` never tries it.

One step at a time: a stream is one ordered conversation, so a second thread waits for the
first's answer (the lock) rather than interleave.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from blockd.auth.config import target_host
from blockd.core.types import DecodeAppend, Op, OpResult, StepResult
from blockd.rpc import convert
from blockd.rpc.lane import FrameTooLarge, LaneConnection
from blockd.rpc.tracing import traceparent
from blockd.v1 import blockd_pb2 as pb
from client import messages
from client.errors import BlockdClientError, DeadlineExceededError, UnavailableError, from_rpc_error, from_status_bytes

log = logging.getLogger("blockd.client")

_END = object()
#: how long a client that could not reach a daemon's step lane steps over the gRPC stream before trying it again
LANE_RETRY_S = 30.0
#: the deadline of the one GetStepLane call a client makes per replica
LANE_ASK_TIMEOUT_S = 2.0
#: the daemon's refusal of a stream beyond its slots (blockd.service.servicer.StepStreamsFull)
STREAMS_FULL = "STEP_STREAMS_FULL"
#: how long a StepStream refused a slot steps by unary Step before it tries a stream again
UNARY_AFTER_FULL_S = 10.0


def _late(timeout_s: float) -> DeadlineExceededError:
    """A step whose answer did not come within its deadline (both stream forms)."""
    return DeadlineExceededError(f"blockd gave no answer to a step within {timeout_s:g} s; it may or may not have "
                                 "been applied: resend it with its request id",
                                 code=grpc.StatusCode.DEADLINE_EXCEEDED)


def _ended() -> UnavailableError:
    return UnavailableError("blockd ended the step stream without answering", code=grpc.StatusCode.UNAVAILABLE)


def _unsent(err: grpc.RpcError | asyncio.InvalidStateError) -> BlockdClientError:
    """An asyncio stream's failed write to a stream the daemon had ended (as an older daemon's refusal of a
    slot did): the step never left, nothing was applied, it may go again. gRPC says "RPC already finished",
    or a bare "INTERNAL: Internal error from Core" when the end came while the write was under way."""
    if isinstance(err, asyncio.InvalidStateError) or (
            err.code() == grpc.StatusCode.INTERNAL and err.details() == "Internal error from Core"):
        return UnavailableError("blockd ended the step stream before this step was sent; nothing was applied",
                                code=grpc.StatusCode.UNAVAILABLE)
    return from_rpc_error(err)


class _Call:
    """One open stream: its request queue and its answers."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.answers = method(iter(self.requests.get, _END))
        self.timed_out = False

    def exchange(self, request: pb.StepStreamRequest) -> pb.StepStreamResponse:
        self.requests.put(request)
        return next(self.answers)

    def cancel(self) -> None:
        self.answers.cancel()

    def close(self) -> None:
        self.requests.put(_END)
        self.answers.cancel()


class _LaneCall:
    """One open lane connection, read and written as a :class:`_Call`; ``method``:
    the gRPC StepStream of the same replica (where a failure is followed from)."""

    def __init__(self, method: Callable[..., Any], connection: LaneConnection, where: str) -> None:
        self.method, self.connection, self.where = method, connection, where
        self.timed_out = False

    def exchange(self, request: pb.StepStreamRequest) -> pb.StepStreamResponse:
        try:
            answer = pb.StepStreamResponse.FromString(self.connection.exchange(request.SerializeToString()))
        except (OSError, EOFError, FrameTooLarge) as err:
            raise UnavailableError(f"the step lane to {self.where} broke ({err}); the step may or may not have "
                                   "been applied: resend it with its request id (the SDK does)",
                                   code=grpc.StatusCode.UNAVAILABLE) from None
        return answer

    def cancel(self) -> None:
        self.connection.cancel()

    def close(self) -> None:
        self.connection.close()


class StepLanes:
    """Where each replica of one client serves its step lane (one ``GetStepLane``
    per replica), how to connect to it, and which lanes are off for now."""

    def __init__(self, client: Any, enabled: bool) -> None:
        self._client, self.enabled = client, enabled
        self._where: dict[str, tuple[int, bool]] = {}
        self._off_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def open(self) -> _LaneCall | None:
        """A lane connection to the replica calls go to now; None: step over gRPC."""
        client = self._client
        address = client._replicas.targets.current
        if not self.enabled or time.monotonic() < self._off_until.get(address, 0.0):
            return None
        try:
            # a lane learnt before may be gone with its daemon (a restart picks a new free port): ask again once
            for asked in (False, True) if address in self._where else (True,):
                if asked:
                    reply = client._blocks.GetStepLane(pb.GetStepLaneRequest(), timeout=LANE_ASK_TIMEOUT_S)
                    self._where[address] = (reply.port, reply.tls)
                port, tls = self._where[address]
                if not port:
                    return None
                try:
                    return self._connect(address, port, tls)
                except OSError:
                    if asked:
                        raise
            return None  # not reached: the last try returns or raises
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # a daemon older than the lane
                self._where[address] = (0, False)
            # else the daemon is down, or refuses this caller: the gRPC stream raises what it says
            return None
        except (OSError, ssl.SSLError, ValueError) as err:
            reason = f"cannot connect: {err}"
        with self._lock:
            self._off_until[address] = time.monotonic() + LANE_RETRY_S
        log.warning("the step lane of %s is out of reach (%s); stepping over the gRPC stream for %g s",
                    address, reason, LANE_RETRY_S)
        return None

    def _connect(self, address: str, port: int, tls: bool) -> _LaneCall:
        client = self._client
        host = target_host(address)
        metadata = [("authorization", f"Bearer {client.token}")] if client.token else []
        connection = LaneConnection(host, port, metadata, tls=self._tls_context() if tls else None,
                                    server_name=client.tls.server_name if client.tls is not None else None)
        return _LaneCall(client._blocks.StepStream, connection, f"{host}:{port}")

    def _tls_context(self) -> ssl.SSLContext:
        tls = self._client.tls
        if tls is None:
            raise ValueError("the daemon's step lane speaks TLS and this client has no TLS settings")
        context = ssl.create_default_context(cafile=tls.ca)
        if tls.cert is not None and tls.key is not None:
            context.load_cert_chain(tls.cert, tls.key)
        return context


class StepStream:
    """``BlockdClient.step`` over one stream (module docstring); from
    :meth:`client.sdk.BlockdClient.step_stream`. Close it (or use it as a
    context manager) to end the stream."""

    def __init__(self, client: Any, timeout_s: float) -> None:
        # client: the BlockdClient it came from (its stubs and its leader-following; not
        # imported here, so the SDK module and this one form no import cycle)
        self._client = client
        self.timeout_s = timeout_s
        self._call: _Call | _LaneCall | None = None
        self._lock = threading.Lock()
        self._closed = False
        # the watchdog: the deadline of the step in flight (None: none), and
        # whether the watchdog sleeps without one (then a step wakes it)
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._idle = True
        #: until when steps go by unary Step (the daemon had no stream slot: STREAMS_FULL)
        self._unary_until = 0.0
        self._watchdog = threading.Thread(target=self._watch, name="blockd-step-stream-watchdog", daemon=True)
        self._watchdog.start()

    def __enter__(self) -> StepStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        call, self._call = self._call, None
        if call is not None:
            call.close()

    # --- steps -------------------------------------------------------------------------
    def step(self, pool: str, ops: Sequence[Op], *, request_id: str | None = None,
             timeout_s: float | None = None, dry_run: bool = False, incarnation: str = "",
             previous_term: int = 0) -> StepResult:
        """As :meth:`client.sdk.BlockdClient.step`, over the stream."""
        request = pb.StepStreamRequest(step=messages.step_request(pool, ops, request_id, dry_run, incarnation,
                                                                  previous_term))
        # a stream message has no metadata of its own: the step carries its trace context ("" when off)
        request.step.traceparent = traceparent()
        with self._lock:
            return convert.step_result_from_proto(self._send(request, timeout_s or self.timeout_s))

    def decode_append(self, pool: str, seq_ids: Sequence[str], token_ids: Sequence[int], *,
                      request_id: str | None = None) -> OpResult:
        return self.step(pool, [DecodeAppend(list(seq_ids), list(token_ids))], request_id=request_id).results[0]

    def _send(self, request: pb.StepStreamRequest, timeout_s: float) -> pb.StepResponse:
        if self._closed:
            raise ValueError("this StepStream is closed")
        deadline = time.monotonic() + timeout_s
        if time.monotonic() < self._unary_until:
            return self._unary(request, deadline)
        attempt = 0
        while True:
            call = self._open()
            try:
                answer = self._exchange(call, request, deadline, timeout_s)
            except BlockdClientError as err:
                error = err
            else:
                if answer.HasField("response"):
                    return answer.response
                error = from_status_bytes(answer.error_status)
                if isinstance(call, _LaneCall):  # it may be the connection's last answer: the next step reconnects
                    self._drop(call)
                if error.reason == STREAMS_FULL:  # nothing applied; the daemon has no stream slot for us
                    self._drop(call)
                    self._unary_until = time.monotonic() + UNARY_AFTER_FULL_S
                    return self._unary(request, deadline)
            step = self._client._follow_next(call.method, error, attempt)
            if step is None or time.monotonic() + step[1] >= deadline:
                raise error from None
            self._drop(call)
            time.sleep(step[1])
            attempt += 1
            # where the next call goes (the replica followed to): its lane, else step[0], its gRPC stream
            self._call = self._client._lanes.open() or _Call(step[0])

    def _unary(self, request: pb.StepStreamRequest, deadline: float) -> pb.StepResponse:
        return self._client._unary(self._client._blocks.Step, request.step, max(0.001, deadline - time.monotonic()))

    def _open(self) -> _Call | _LaneCall:
        if self._call is None:
            self._call = self._client._lanes.open() or _Call(self._client._blocks.StepStream)
        return self._call

    def _drop(self, call: _Call | _LaneCall) -> None:
        if self._call is call:
            self._call = None
        call.close()

    def _exchange(self, call: _Call | _LaneCall, request: pb.StepStreamRequest, deadline: float,
                  timeout_s: float) -> pb.StepStreamResponse:
        """Send one request and read its answer, under the watchdog's deadline."""
        with self._cond:
            self._deadline = deadline
            if self._idle:
                self._cond.notify()
        try:
            answer = call.exchange(request)
        except grpc.RpcError as err:
            self._drop(call)
            if call.timed_out:
                raise _late(timeout_s) from None
            raise from_rpc_error(err) from None
        except BlockdClientError:  # the lane broke (_LaneCall)
            self._drop(call)
            if call.timed_out:
                raise _late(timeout_s) from None
            raise
        except StopIteration:
            self._drop(call)
            raise _ended() from None
        finally:
            with self._cond:
                self._deadline = None
        if call.timed_out:  # the watchdog cancelled the stream as the answer came: the answer stands
            self._drop(call)
        return answer

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._idle = True
                    self._cond.wait()
                    self._idle = False
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._deadline = None
                call = self._call
                if call is not None:
                    call.timed_out = True
                    call.cancel()


class AsyncStepStream:
    """:class:`StepStream` for :class:`client.aio.AsyncBlockdClient` (from its
    ``step_stream()``): the same answers, refusals, deadline per step (here
    ``asyncio.wait_for`` on the answer, no watchdog thread), reopening and
    leader-following. One step at a time (an ``asyncio.Lock``)."""

    def __init__(self, client: Any, timeout_s: float) -> None:
        # client: the AsyncBlockdClient it came from (not imported here, as for StepStream)
        self._client = client
        self.timeout_s = timeout_s
        self._call: Any = None
        self._method: Callable[..., Any] | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self._unary_until = 0.0  # as StepStream's: no stream slot (STREAMS_FULL), step by unary Step

    async def __aenter__(self) -> AsyncStepStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        self._drop()

    def _drop(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    async def step(self, pool: str, ops: Sequence[Op], *, request_id: str | None = None,
                   timeout_s: float | None = None, dry_run: bool = False, incarnation: str = "",
                   previous_term: int = 0) -> StepResult:
        """As :meth:`client.aio.AsyncBlockdClient.step`, over the stream."""
        request = pb.StepStreamRequest(step=messages.step_request(pool, ops, request_id, dry_run, incarnation,
                                                                  previous_term))
        # a stream message has no metadata of its own: the step carries its trace context ("" when off)
        request.step.traceparent = traceparent()
        async with self._lock:
            return convert.step_result_from_proto(await self._send(request, timeout_s or self.timeout_s))

    async def decode_append(self, pool: str, seq_ids: Sequence[str], token_ids: Sequence[int], *,
                            request_id: str | None = None) -> OpResult:
        result = await self.step(pool, [DecodeAppend(list(seq_ids), list(token_ids))], request_id=request_id)
        return result.results[0]

    async def _send(self, request: pb.StepStreamRequest, timeout_s: float) -> pb.StepResponse:
        if self._closed:
            raise ValueError("this AsyncStepStream is closed")
        deadline = time.monotonic() + timeout_s
        if time.monotonic() < self._unary_until:
            return await self._unary(request, deadline)
        attempt = 0
        method: Callable[..., Any] = self._client._blocks.StepStream
        if self._call is not None and self._method is not None:
            method = self._method  # the stream open now is where the last step went
        while True:
            if self._call is None:
                self._method, self._call = method, method()
            sent = False
            try:
                await self._call.write(request)
                sent = True
                answer = await asyncio.wait_for(self._call.read(), max(0.001, deadline - time.monotonic()))
            except TimeoutError:
                self._drop()
                raise _late(timeout_s) from None
            except (grpc.RpcError, asyncio.InvalidStateError) as err:
                self._drop()
                error = from_rpc_error(err) if sent and isinstance(err, grpc.RpcError) else _unsent(err)
            else:
                if answer is grpc.aio.EOF:
                    self._drop()
                    error = _ended()
                elif answer.HasField("response"):
                    return answer.response
                else:
                    error = from_status_bytes(answer.error_status)
                    if error.reason == STREAMS_FULL:  # nothing applied; no stream slot for us
                        self._drop()
                        self._unary_until = time.monotonic() + UNARY_AFTER_FULL_S
                        return await self._unary(request, deadline)
            assert self._method is not None
            step = await self._client._next_call(self._method, error, attempt) if self._client._follow else None
            if step is None or time.monotonic() + step[1] >= deadline:
                raise error from None
            self._drop()
            await asyncio.sleep(step[1])
            attempt += 1
            method = step[0]

    async def _unary(self, request: pb.StepStreamRequest, deadline: float) -> pb.StepResponse:
        return await self._client._unary(self._client._blocks.Step, request.step,
                                         max(0.001, deadline - time.monotonic()))
