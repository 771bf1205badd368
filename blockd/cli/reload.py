"""``blockd reload --pid-file FILE``: make a serving daemon re-read its files, and say whether it did.

SIGHUP alone is fire-and-forget: ``kill -HUP`` returns before the daemon has
re-read anything, so the next command may still meet the old identities, and
a broken edit is only visible in the daemon's log. This command sends the
signal and waits for the daemon's answer, which ``blockd serve --pid-file
FILE`` writes after each reload to ``FILE.reload`` (one JSON object,
replaced atomically: the daemon's pid, when the reload began on the
system's monotonic clock, whether everything took effect, and what
happened in words). The command accepts only an answer that began after
its own signal, so an earlier reload (another operator's, or one that read
the file before the edit) never passes for this one.

Exit status: 0 when everything reloaded; 1 when the daemon kept a previous
version of something (the message says what and why), when there is no such
daemon, or when it did not answer within ``--timeout-s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

from blockd import config_env

#: what :func:`status_path` appends to the pid file's name
SUFFIX = ".reload"


def status_path(pid_file: str) -> str:
    """Where the daemon with this pid file writes its reload answers."""
    return pid_file + SUFFIX


def write_status(pid_file: str, began_ns: int, ok: bool, messages: list[str]) -> None:
    """The daemon's side: record one reload's outcome (atomically, like the pid file)."""
    path = status_path(pid_file)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "began_ns": began_ns, "ok": ok, "messages": messages}, f)
        f.write("\n")
    os.replace(tmp, path)


def remove_status(pid_file: str) -> None:
    """The daemon's side, at exit: no answer outlives the process that gave it."""
    with contextlib.suppress(OSError):
        os.remove(status_path(pid_file))


def _read_status(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            status = json.load(f)
    except (OSError, ValueError):  # not written yet (or being replaced: the rename is atomic)
        return None
    return status if isinstance(status, dict) else None


def _read_pid(pid_file: str) -> int:
    try:
        with open(pid_file, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as err:
        raise ValueError(f"cannot read the pid file {pid_file} ({err.strerror}): is blockd serving "
                         f"with --pid-file {pid_file}?") from None
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(f"the pid file {pid_file} does not hold a process id (it reads {text[:40]!r})")
    return int(text)


def reload(pid_file: str, timeout_s: float, out=sys.stdout) -> int:
    """Signal the daemon named by ``pid_file`` and wait for its answer (module docstring)."""
    try:
        pid = _read_pid(pid_file)
    except ValueError as err:
        print(f"blockd reload: {err}", file=sys.stderr)
        return 1
    began_after = time.monotonic_ns()
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        print(f"blockd reload: no process {pid} (the pid file {pid_file} is stale: blockd is not running)",
              file=sys.stderr)
        return 1
    except PermissionError:
        print(f"blockd reload: not allowed to signal process {pid}: run this as the daemon's user",
              file=sys.stderr)
        return 1
    path = status_path(pid_file)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = _read_status(path)
        if status is not None and status.get("pid") == pid and status.get("began_ns", -1) >= began_after:
            for message in status.get("messages", []):
                print(message, file=out)
            return 0 if status.get("ok") else 1
        time.sleep(0.02)
    print(f"blockd reload: process {pid} did not confirm a reload within {timeout_s:g}s (is it a "
          f"blockd serve with --pid-file {pid_file}? its log says what it did)", file=sys.stderr)
    return 1


def add_command(sub) -> None:
    """Register ``reload`` on the ``blockd`` parser's subcommands."""
    cmd = sub.add_parser("reload", help="re-read a serving daemon's identities and metrics files and wait "
                                        "for its answer (SIGHUP, confirmed)")
    cmd.add_argument("--pid-file", required=True, help="the daemon's --pid-file")
    cmd.add_argument("--timeout-s", type=config_env.positive_float, default=10.0,
                     help="how long to wait for the daemon's answer")
    cmd.set_defaults(run=lambda args: reload(args.pid_file, args.timeout_s))


__all__ = ["SUFFIX", "add_command", "reload", "remove_status", "status_path", "write_status"]
