"""What every ``blockctl`` command shares: output (tables or JSON) and exit status.

Exit status is chosen by failure class so a script can tell "pool missing"
from "daemon down" (:data:`EXIT_CODES`, documented in ``blockctl --help``):

====  ==========================================================================
code  meaning
====  ==========================================================================
0     done (``pools apply``: everything already in place counts)
1     any other failure (INTERNAL: a bug in blockd; the message has its incident id)
2     usage: a bad flag, file or environment variable, or INVALID_ARGUMENT
3     not found (NOT_FOUND: no such pool, sequence, worker or health service)
4     conflict (ALREADY_EXISTS, ABORTED; ``pools apply``: a pool that differs from the file)
5     wrong state (FAILED_PRECONDITION, OUT_OF_RANGE)
6     no room (RESOURCE_EXHAUSTED)
7     not allowed (UNAUTHENTICATED, PERMISSION_DENIED)
69    unavailable: daemon down, not answering within ``--timeout-s``, or not serving
130   interrupted (Ctrl-C)
====  ==========================================================================

69 is ``EX_UNAVAILABLE`` of sysexits(3). Commands raise :class:`CommandFailed`
for failures that are not an RPC status (a pool that differs from a file).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
from collections.abc import Callable, Iterable, Sequence

import grpc


class Exit(enum.IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    NOT_FOUND = 3
    CONFLICT = 4
    PRECONDITION = 5
    EXHAUSTED = 6
    DENIED = 7
    UNAVAILABLE = 69
    INTERRUPTED = 130


_C = grpc.StatusCode
#: exit status of an RPC failure, by gRPC status code; anything else is 1
EXIT_CODES: dict[grpc.StatusCode, Exit] = {
    _C.INTERNAL: Exit.FAILED,
    _C.INVALID_ARGUMENT: Exit.USAGE,
    _C.NOT_FOUND: Exit.NOT_FOUND,
    _C.ALREADY_EXISTS: Exit.CONFLICT,
    _C.ABORTED: Exit.CONFLICT,
    _C.FAILED_PRECONDITION: Exit.PRECONDITION,
    _C.OUT_OF_RANGE: Exit.PRECONDITION,
    _C.RESOURCE_EXHAUSTED: Exit.EXHAUSTED,
    _C.UNAUTHENTICATED: Exit.DENIED,
    _C.PERMISSION_DENIED: Exit.DENIED,
    _C.UNAVAILABLE: Exit.UNAVAILABLE,
    _C.DEADLINE_EXCEEDED: Exit.UNAVAILABLE,
}

EPILOG = """\
exit status:
  0   done (pools apply: everything already in place counts)
  1   other failure (INTERNAL: a bug in blockd; the message names its incident)
  2   usage: bad flag, file or environment variable; INVALID_ARGUMENT
  3   not found: NOT_FOUND (pool, sequence, health service)
  4   conflict: ALREADY_EXISTS, ABORTED; pools apply found a pool unlike the file
  5   wrong state: FAILED_PRECONDITION, OUT_OF_RANGE
  6   no room: RESOURCE_EXHAUSTED
  7   not allowed: UNAUTHENTICATED, PERMISSION_DENIED
  69  unavailable: UNAVAILABLE (daemon down), DEADLINE_EXCEEDED (no answer
      within --timeout-s), health NOT_SERVING
  130 interrupted

environment: every flag has a variable, BLOCKCTL_<FLAG> (--timeout-s ->
BLOCKCTL_TIMEOUT_S), except --target: BLOCKD_TARGET (shared with blockd-worker).
--help of each command names its variables. Flags on the command line win.
"""


class CommandFailed(Exception):
    """A command's failure that is not an RPC status; ``exit_code`` is its class."""

    def __init__(self, message: str, exit_code: Exit) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def jsonable(value):
    """Dataclasses, bytes (hex), lists and dicts as plain JSON values."""
    if dataclasses.is_dataclass(value):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Left-aligned text columns, two spaces apart; numbers right-aligned."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [bool(cells) and all(r[i].lstrip("-").isdigit() for r in cells) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(cells, widths, numeric)).rstrip()

    return "\n".join([line([h.upper() for h in headers]), *(line(r) for r in cells)])


def emit(args: argparse.Namespace, data: object, human: Callable[[], str]) -> None:
    """``data`` as indented JSON under ``--json``, else ``human()``."""
    print(json.dumps(jsonable(data), indent=2) if args.json else human())


__all__ = ["EPILOG", "EXIT_CODES", "CommandFailed", "Exit", "emit", "jsonable", "render_table"]
