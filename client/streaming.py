"""A request's tokens as they are produced, and the loop that produces them.

:meth:`client.scheduler.Scheduler.submit` returns a :class:`RequestStream`:
iterate it (``for token in stream`` or ``async for token in stream``) and
each :class:`StreamToken` arrives as soon as the scheduler step that made it
has applied it, so the first one arrives at the request's time to first
token; the iteration ends when every sample has ended, and
:meth:`RequestStream.result` is then the :class:`~client.serving.RequestOutput`.
Within a sample tokens arrive in order; samples interleave.

Who steps the scheduler:

* nobody else (one thread): iterating a stream that has nothing buffered
  runs scheduler steps until it has (each step also feeds every other
  stream), so ``for token in sched.submit(request)`` just works;
* a :class:`ServingLoop`: a thread that steps while there is work and sleeps
  when there is none; streams then wait for it (thread-safe), and any
  thread, or an asyncio task, may submit and consume.

Producer calls (``_push``, ``_close``) come from the thread that steps the
scheduler; consumers may be any threads or event loops. The loop knows the
scheduler only as a :class:`Steppable` (what it calls), so this module
imports no scheduler, no grpc, no torch.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from client.serving import GenerationRequest, RequestOutput


@dataclass(frozen=True)
class StreamToken:
    """One generated token of sample ``sample_index``; ``finish_reason`` is set
    on a sample's last token (``"stop"`` or ``"length"``)."""

    sample_index: int
    token_id: int
    finish_reason: str | None = None


class RequestStream:
    """The tokens of one request, in the order the scheduler produced them.

    ``drive`` runs one scheduler step (returns False when there was nothing
    to do); it is used when no :class:`ServingLoop` runs, so that the
    consumer's own thread makes progress.
    """

    def __init__(self, request_id: str, drive: Callable[[], bool] | None = None) -> None:
        self.request_id = request_id
        self._drive = drive
        self._cond = threading.Condition()
        self._buffer: deque[StreamToken] = deque()
        self._output: RequestOutput | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    # --- producer side (the stepping thread) -----------------------------------
    def _push(self, token: StreamToken) -> None:
        with self._cond:
            self._buffer.append(token)
            self._wake()

    def _close(self, output: RequestOutput) -> None:
        with self._cond:
            self._output = output
            self._wake()

    def _wake(self) -> None:
        self._cond.notify_all()
        for loop, future in self._waiters:
            loop.call_soon_threadsafe(_resolve, future)
        self._waiters.clear()

    # --- consumer side ---------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        """The request ended (tokens may still be buffered)."""
        return self._output is not None

    def result(self, timeout_s: float | None = None) -> RequestOutput:
        """The request's output once it ended (waiting, or driving the scheduler)."""
        for _ in self:
            pass
        with self._cond:
            if self._output is None and not self._cond.wait_for(lambda: self._output is not None, timeout_s):
                raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout_s} s")
            assert self._output is not None  # wait_for returned true
            return self._output

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> StreamToken:
        while True:
            with self._cond:
                if self._buffer:
                    return self._buffer.popleft()
                if self._output is not None:
                    raise StopIteration
                if self._drive is None:
                    self._cond.wait()
                    continue
            if not self._drive():
                raise RuntimeError(f"the scheduler has nothing to do, yet request {self.request_id!r} is "
                                   "not finished (a bug)")

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamToken:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._buffer:
                    return self._buffer.popleft()
                if self._output is not None:
                    raise StopAsyncIteration
                if self._drive is None:
                    future = loop.create_future()
                    self._waiters.append((loop, future))
            if self._drive is None:
                await future
            elif not await asyncio.to_thread(self._drive):
                raise RuntimeError(f"the scheduler has nothing to do, yet request {self.request_id!r} is "
                                   "not finished (a bug)")


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class Steppable(Protocol):
    """What a :class:`ServingLoop` needs from the scheduler it steps
    (:class:`client.scheduler.Scheduler` is one)."""

    @property
    def is_idle(self) -> bool:
        """No request left, and nothing left to tell blockd."""
        ...

    def step(self) -> bool:
        """One step; False if there was nothing to do."""
        ...

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue ``request`` and return the stream of its tokens."""
        ...

    def attach_loop(self, loop: ServingLoop | None) -> None:
        """Streams submitted from now on wait for ``loop`` (None: their consumers step)."""
        ...

    def fail_streams(self, error: str) -> None:
        """End every open stream with ``error``."""
        ...


class ServingLoop:
    """Steps ``scheduler`` on a background thread while it has work.

    ``with ServingLoop(sched) as loop:`` starts it and, on exit, stops it
    once the scheduler is idle (or at once after an error). Submit through
    :meth:`submit` (any thread); the streams it returns wait for this loop.
    An exception raised by a step stops the loop; it is raised again by
    :meth:`stop` and every waiting stream's request is left unfinished, so
    :meth:`check` lets consumers fail fast.
    """

    def __init__(self, scheduler: Steppable) -> None:
        self.scheduler = scheduler
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="serving-loop", daemon=True)

    def start(self) -> ServingLoop:
        self.scheduler.attach_loop(self)
        self._thread.start()
        return self

    def __enter__(self) -> ServingLoop:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, request: GenerationRequest) -> RequestStream:
        self.check()
        stream = self.scheduler.submit(request)
        self._wake.set()
        return stream

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError("the serving loop stopped on an error") from self.error

    def notify(self) -> None:
        self._wake.set()

    def stop(self, timeout_s: float | None = None) -> None:
        """Finish what was submitted, then stop the thread; raise the loop's error if it had one."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)
        self.scheduler.attach_loop(None)
        self.check()

    def _run(self) -> None:
        sched = self.scheduler
        try:
            while True:
                if sched.is_idle:
                    if self._stopping:
                        return
                    self._wake.wait()
                    self._wake.clear()
                    continue
                if not sched.step():
                    raise RuntimeError("scheduler made no progress with requests left (a bug)")
        except Exception as err:  # noqa: BLE001 -- any failure ends the loop; stop() raises it again
            self.error = err
            sched.fail_streams(f"the serving loop stopped: {err!r}")
