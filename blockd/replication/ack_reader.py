"""The acknowledgements of the plain-text feeds on the replication port, read by the steps that wait for them.

:class:`AckReader` is one ``select`` over every such feed's acknowledgement
connection (:class:`~blockd.replication.framing.Framed`). Its docstring says
why a waiting step reads them itself rather than a thread of their own; the
commit point (:class:`blockd.replication.commits.Commits`) lends it the
waiters. TLS feeds are not read here: ``ssl`` takes no ``MSG_DONTWAIT``, so
each has a thread of its own (:class:`blockd.replication.acks.AckIntake`).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from blockd.replication.framing import Framed

log = logging.getLogger("blockd.replication")

#: how long :class:`AckReader`'s thread stays away after a waiter read, and its longest wait
IDLE_S = 0.05


class AckReader:
    """The acknowledgements of every plain-text feed on the replication port, read
    by the thread that waits for them.

    A sync step waits for its followers' acknowledgements. Read on a thread of
    their own, each one woke that thread, which then woke the step's: two
    hand-offs of the GIL and of a core, 0.25-0.55 ms a step on the 2-core test
    machines (measured). Here the waiter reads them itself (:meth:`read`, one
    ``select`` over every feed's socket), so the acknowledgement that commits a
    step wakes the thread that answers it.

    One thread reads at a time (``_role``). The reader's own thread takes the
    role only when no waiter has read for ``IDLE_S`` (no steps: acknowledgements
    of heartbeats, an async group), and a waiter that finds it reading pokes it
    out of its ``select`` (a byte on ``_wake``). A waiter that finds another
    waiter reading returns False and waits for the commit point's notice, which
    the reader gives (``on_notice``) as it leaves. ``handle(payload)`` takes
    one message; an exception from it, a frame no message can be, or the end
    of the connection ends that feed (``on_end``, the follower dials again).
    """

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake, self._woken = socket.socketpair()
        self._wake.setblocking(False)
        self._woken.setblocking(False)
        self._selector.register(self._woken, selectors.EVENT_READ, None)
        self._role = threading.Lock()
        self._holder = 0  #: the thread reading (its ident; 0: none)
        self._waited = 0.0  #: when a waiter last asked to read (monotonic)
        self._wanting = False  #: a waiter found the role taken: tell it when it is free
        self._links = 0
        self._links_lock = threading.Lock()
        #: called (from the thread leaving the role) when a waiter that found it taken may read now
        self.on_notice: Callable[[], None] = lambda: None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="repl-acks", daemon=True)
        self._thread.start()

    @property
    def has_links(self) -> bool:
        return self._links > 0 and not self._closed.is_set()

    def add(self, conn: Framed, handle: Callable[[bytes], None],
            on_end: Callable[[BaseException | None], None]) -> None:
        with self._links_lock:
            self._selector.register(conn.socket, selectors.EVENT_READ, _Acks(conn, handle, on_end))
            self._links += 1
        self.interrupt()  # a select in progress has not seen it

    def remove(self, conn: Framed) -> None:
        """Stop reading ``conn`` (before it is closed); nothing once it ended here already."""
        with self._links_lock, contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.socket)
            self._links -= 1

    def read(self, timeout_s: float) -> bool:
        """Read what arrives within ``timeout_s``; False at once when another thread reads."""
        self._waited = time.monotonic()
        if not self._role.acquire(blocking=False):
            self._wanting = True
            # again, now that the holder will see ``_wanting`` when it leaves: one that left
            # between the first try and that flag gave no notice, but left the role free
            if not self._role.acquire(blocking=False):
                if self._holder == self._thread.ident:
                    self._poke()
                return False
        self._serve(timeout_s)
        return True

    def interrupt(self) -> None:
        """Wake a waiter reading (it re-checks what it waits for): the commit point moved
        without it, through an acknowledgement that came another way."""
        holder = self._holder
        if holder and holder != threading.get_ident():
            self._poke()

    def close(self) -> None:
        self._closed.set()
        self._poke()
        self._thread.join(5)

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # a byte there already does the same
            self._wake.send(b"w")

    def _run(self) -> None:
        while not self._closed.is_set():
            if time.monotonic() - self._waited < IDLE_S or not self._role.acquire(timeout=IDLE_S):
                self._closed.wait(IDLE_S)
                continue
            self._serve(IDLE_S)
        with contextlib.suppress(OSError):
            self._selector.close()
            self._wake.close()
            self._woken.close()

    def _serve(self, timeout_s: float) -> None:
        """Under the role (taken): one ``select``, then leave the role."""
        self._holder = threading.get_ident()
        try:
            for key, _ in self._selector.select(timeout_s):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError, OSError):
                        self._woken.recv(4096)
                elif not key.data.pump():
                    self.remove(key.data.conn)
                    key.data.end()
        except (OSError, ValueError) as err:  # closed meanwhile; a waiter goes on waiting for notices
            if not self._closed.is_set():
                log.warning("reading the replication port's acknowledgements failed: %s", err)
        finally:
            self._holder = 0
            self._role.release()
            if self._wanting:
                self._wanting = False
                self.on_notice()


class _Acks:
    """One feed's acknowledgements as they arrive, cut into frames."""

    def __init__(self, conn: Framed, handle: Callable[[bytes], None],
                 on_end: Callable[[BaseException | None], None]) -> None:
        self.conn, self._handle, self._on_end = conn, handle, on_end
        self._error: BaseException | None = None

    def pump(self) -> bool:
        """Handle every whole frame that has arrived; False once the feed must end."""
        try:
            payloads = self.conn.receive_ready()
            if payloads is None:
                return False
            for payload in payloads:
                self._handle(payload)
            return True
        except Exception as err:  # noqa: BLE001 - any failure ends this feed; the follower opens it again
            self._error = err
            return False

    def end(self) -> None:
        self._on_end(self._error)
