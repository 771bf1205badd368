"""A background fdatasync whose completions arrive on a pipe (for a loop that polls).

:class:`Fsyncer` runs one thread that, when asked (:meth:`Fsyncer.request`:
a file descriptor and the LSN its sync will cover), fdatasyncs the file and
then writes ``(lsn, errno, seconds)`` where :meth:`Fsyncer.done` reads it;
:meth:`Fsyncer.fileno` is the pipe to poll. A request made while a sync runs
replaces any other still waiting, so each sync covers everything asked for
before it started (group commit), and completions come in LSN order.

Why a pipe and not a condition: the step lane's loop
(:mod:`blockd.service.lane_loop`) already waits on epoll for its connections,
and a completion then wakes it like a connection does. Why C where it can
(``_fsyncer.c``, built by ``setup.py``): that thread never takes the GIL, so
the loop never waits for it to hand the GIL back (see the C file). Where it
was not compiled, or was compiled from another source than the one beside it
(an edit since the last ``make setup``), a Python thread does the same, with
the GIL handovers: slower, never different. :data:`BUILD` says which this
process runs. Imports only the standard library.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
import time
from pathlib import Path
from typing import Any

from blockd.threads import name_os_thread

log = logging.getLogger("blockd.storage")

#: a completion: the LSN the sync covered, its errno (0: it succeeded), its nanoseconds
RECORD = struct.Struct("=qqq")


class _PythonFsyncer:
    """The fallback: the same protocol from a Python thread."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        self._cv = threading.Condition()
        self._next: tuple[int, int] | None = None  # (a dup of the fd, lsn)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="blockd-fsyncer", daemon=True)
        self._thread.start()

    def request(self, fd: int, lsn: int) -> None:
        if self._stop:
            raise ValueError("the Fsyncer is closed")
        copy = os.dup(fd)
        with self._cv:
            older, self._next = self._next, (copy, lsn)
            self._cv.notify()
        if older is not None:
            os.close(older[0])

    def fileno(self) -> int:
        if self._stop:
            raise ValueError("the Fsyncer is closed")
        return self._read

    def _run(self) -> None:
        name_os_thread("blockd-fsync-py")
        while True:
            with self._cv:
                while self._next is None and not self._stop:
                    self._cv.wait()
                if self._stop or self._next is None:
                    return
                (fd, lsn), self._next = self._next, None
            began, err = time.monotonic_ns(), 0
            try:
                os.fdatasync(fd)
            except OSError as e:
                err = e.errno or 5  # EIO when the OS says no number
            finally:
                os.close(fd)
            with contextlib.suppress(OSError):  # the read end is gone: nobody waits any more
                os.write(self._write, RECORD.pack(lsn, err, time.monotonic_ns() - began))

    def close(self) -> None:
        if self._stop:
            return
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()
        if self._next is not None:
            os.close(self._next[0])
            self._next = None
        os.close(self._read)
        os.close(self._write)


def _native() -> tuple[Any, str]:
    """The compiled Fsyncer type, and "" or why it is not used."""
    if os.environ.get("BLOCKD_PURE_PYTHON") == "1":
        return None, "BLOCKD_PURE_PYTHON=1"
    try:
        from blockd.storage import _fsyncer  # type: ignore[attr-defined]
    except ImportError:
        return None, "not compiled"
    source = Path(__file__).with_name("_fsyncer.c")
    with contextlib.suppress(OSError):
        if hashlib.sha256(source.read_bytes()).hexdigest() != _fsyncer.SOURCE_SHA256:
            why = "_fsyncer.c changed since it was compiled; `make setup` compiles it again"
            log.warning("the compiled fsyncer is stale (%s): a Python thread syncs instead", why)
            return None, why
    return _fsyncer.Fsyncer, ""


_NATIVE, _WHY = _native()
#: which fsyncer this process runs: ``compiled`` or ``python (why)``
BUILD = "compiled" if _NATIVE is not None else f"python ({_WHY})"


class Fsyncer:
    """One background sync thread (see the module docstring); ``python``: the
    fallback even where the compiled one is there (the tests run both)."""

    def __init__(self, python: bool = False) -> None:
        self._impl = _PythonFsyncer() if python or _NATIVE is None else _NATIVE()
        self.build = "python" if isinstance(self._impl, _PythonFsyncer) else "compiled"
        self._rest = b""

    def request(self, fd: int, lsn: int) -> None:
        """Sync ``fd``'s file (a dup of ``fd`` taken now), then say ``lsn`` is
        done; replaces a request that has not started. OSError: ``fd`` is not open."""
        self._impl.request(fd, lsn)

    def fileno(self) -> int:
        """The pipe to poll: readable once a sync has ended."""
        return self._impl.fileno()

    def done(self) -> list[tuple[int, int, float]]:
        """The syncs ended since the last call, in order: ``(lsn, errno, seconds)`` (errno 0: durable)."""
        try:
            data = self._rest + os.read(self._impl.fileno(), 64 * RECORD.size)
        except BlockingIOError:
            return []
        whole = len(data) - len(data) % RECORD.size
        self._rest = data[whole:]  # never in practice (records are written whole), but never lost
        return [(lsn, err, ns / 1e9) for lsn, err, ns in RECORD.iter_unpack(data[:whole])]

    def close(self) -> None:
        """End the thread once its sync under way is done; what it did not say is lost."""
        self._impl.close()
