"""Names the operating system sees for blockd's own threads.

CPython 3.11 keeps a ``threading.Thread``'s name to itself: every thread of
the daemon shows as ``python`` in ``top -H``, ``/proc/<pid>/task/*/comm``,
``perf`` and ``bench/daemon_cost.py``'s per-thread rows, so the lane's loop
could not be told from the fsync thread or gRPC's. :func:`name_os_thread`
gives the calling thread its name there too (Linux ``prctl(PR_SET_NAME)``,
at most 15 bytes); elsewhere it does nothing. Imports only the standard
library.
"""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15
#: the kernel keeps 15 bytes and a NUL
MAX_NAME_BYTES = 15


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # a libc without prctl: the threads keep their names
        return None


_PRCTL = _prctl()


def name_os_thread(name: str) -> bool:
    """Give the calling thread ``name`` (cut to 15 bytes) where the OS keeps one; whether it did."""
    if _PRCTL is None:
        return False
    # prctl is variadic: each argument passed as the unsigned long it reads
    zero = ctypes.c_ulong(0)
    return _PRCTL(ctypes.c_int(_PR_SET_NAME), ctypes.c_char_p(name.encode()[:MAX_NAME_BYTES]), zero, zero,
                  zero) == 0
