"""One daemon per data directory: an exclusive lock held for the daemon's life.

Two writers on one log would interleave records and each recover a history
the other never wrote -- e.g. a rolling update that starts the new daemon
before the old one has stopped, or a second ``blockd serve`` pointed at the
same directory by mistake. :class:`DataDirLock` takes ``fcntl.flock``
(exclusive, non-blocking) on ``blockd.lock`` in the data directory before
anything in it is read, and keeps the file open until :meth:`release`.

Why ``flock`` and not a pid file: the kernel drops the lock when its holder
dies, SIGKILL and OOM kill included, so a crash never leaves a stale lock
to clear by hand; a pid file's pid may meanwhile belong to someone else.
The holder writes its pid, host and start time into the file, so the
refusal names who holds it. The lock belongs to one open file
description: a second lock in the same process is refused too.

:class:`DirLock` is the same kind of lock on another file of the
directory, for work that waits its turn (a compaction: ``compact.lock``).

Where it does not help: file systems that do not enforce ``flock`` between
hosts (some network file systems). A Kubernetes ``ReadWriteOnce`` volume is
attached to one node at a time, which covers the cross-host case there.
Standard library only.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
import time

from blockd.core.errors import WrongState

LOCK_NAME = "blockd.lock"
#: a daemon SIGKILLed a moment ago holds the lock until the kernel has torn
#: the process down; a restart right after waits this long for it
DEFAULT_WAIT_S = 2.0


class DataDirLocked(WrongState):
    """Another process holds the data directory's lock."""


class DataDirLock:
    """Held from construction until :meth:`release` (or the process ends)."""

    def __init__(self, data_dir: str, wait_s: float = DEFAULT_WAIT_S) -> None:
        self._fd: int | None = None
        os.makedirs(data_dir, exist_ok=True)
        self.path = os.path.join(data_dir, LOCK_NAME)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                os.close(fd)
            raise DataDirLocked(
                f"data dir {data_dir!r} is in use by another blockd ({self._holder()}); stop that daemon "
                "first, or give this one another --data-dir") from None
        self._fd = fd
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        holder = f"pid={os.getpid()} host={socket.gethostname()} started={started}\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)

    def _holder(self) -> str:
        """Who holds the lock, as its holder wrote it (best effort: it may be
        mid-write, or from an older blockd that wrote nothing)."""
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                text = f.read(512).strip()
        except OSError:
            text = ""
        return text or "holder unknown"

    @property
    def is_held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlock and close; idempotent. The file stays (another daemon truncates it)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor drops the flock

    def __del__(self) -> None:  # an engine dropped without close() must not keep the dir
        self.release()


class DirLock:
    """An advisory ``flock`` on a file in the data directory (released when the
    holder closes it or dies, so a SIGKILLed holder never leaves it held)."""

    def __init__(self, data_dir: str, name: str) -> None:
        self.path = os.path.join(data_dir, name)
        self._fd: int | None = None

    def acquire(self, timeout_s: float | None = None) -> bool:
        """Take it, waiting up to ``timeout_s`` (None: as long as it takes)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if deadline is not None else 0))
                self._fd = fd
                return True
            except BlockingIOError:
                if deadline is None or time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.05)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


__all__ = ["LOCK_NAME", "DataDirLock", "DataDirLocked", "DirLock"]
