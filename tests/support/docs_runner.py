"""Run the shell and Python blocks of a Markdown page as a user would, top to bottom.

What runs: every fenced block whose info string is ``sh``, ``bash`` or
``python``, unless the line above its fence (blank lines between allowed) is
``<!-- not run: REASON -->``; a reason is required. Blocks of other kinds
(``json``, ``yaml``, plain fences) are file contents and listings, never run.
``<!-- needs: etcd -->`` above a block means it starts etcd itself: without
an ``etcd`` binary the rest of the page is skipped (a failure with
``BLOCKD_REQUIRE_ETCD=1``, as in :mod:`tests.support.etcd`).

How: the blocks of one page share one fresh directory as their working
directory (with ``.venv`` and ``deploy`` linked to the repository's, so the
paths the docs use resolve) and ``HOME``, in order, as a reader's terminal
would; ``sh`` blocks run under ``bash -e -o pipefail`` (any failing command
fails the block), ``python`` blocks under the venv's interpreter. Each block
is its own session (``setsid``): whatever it leaves in the background (a
``blockd serve &``) is killed, by process group, when the page is done.

Ports: a daemon must never take a port a user's (or another test's) daemon
holds, yet the docs should name the ports a user types. So every port the
page names (``127.0.0.1:P``, ``localhost:P``, ``--...-port P``), and 50051,
blockd's default, is mapped to a port free now, and the text of each block
has those numbers replaced before it runs; ``BLOCKD_LISTEN`` and
``BLOCKD_TARGET`` point the defaults at 50051's stand-in. Inherited
``BLOCKD_*``/``BLOCKCTL_*`` variables are dropped so the page runs as
written.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from blockd.cluster.local import free_port

RUN_KINDS = {"sh": "sh", "bash": "sh", "python": "python"}
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$")
NEEDS = re.compile(r"^<!--\s*needs:\s*([\w, -]+?)\s*-->$")
PORT = re.compile(r"(?:127\.0\.0\.1|localhost):(\d{2,5})\b|--[\w-]*port[= ](\d{2,5})\b")
DEFAULT_PORT = 50051
BLOCK_TIMEOUT_S = 120.0
KILL_GRACE_S = 5.0


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    kind: str  # sh, python, or the info string of a block that never runs
    text: str
    not_run: str | None = None  # the reason, when excluded
    needs: tuple[str, ...] = ()

    @property
    def runs(self) -> bool:
        return self.kind in RUN_KINDS and self.not_run is None

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(text: str, page: str) -> list[Block]:
    """Every fenced block of ``text``, with the marker comment above it read."""
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        start, kind = i, fence.group(1)
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        block = Block(page, start + 1, kind, "\n".join(body) + "\n")
        above = start - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        # the markers stack: read every comment line directly above the fence
        while above >= 0 and lines[above].startswith("<!--"):
            comment = lines[above].strip()
            if (m := NOT_RUN.match(comment)) is not None:
                block.not_run = m.group(1)
            elif (m := NEEDS.match(comment)) is not None:
                block.needs = tuple(n.strip() for n in m.group(1).split(","))
            above -= 1
        found.append(block)
    return found


def page_ports(text: str) -> set[int]:
    """The ports ``text`` names, and blockd's default."""
    ports = {DEFAULT_PORT}
    for m in PORT.finditer(text):
        number = int(m.group(1) or m.group(2))
        if 0 < number <= 65535:
            ports.add(number)
    return ports


def localize(text: str, ports: dict[int, int]) -> str:
    """``text`` with each documented port replaced by its stand-in."""
    if not ports:
        return text
    pattern = re.compile(r"(?<![\w.])(" + "|".join(str(p) for p in sorted(ports)) + r")(?![\w])")
    return pattern.sub(lambda m: str(ports[int(m.group(1))]), text)


class Unavailable(Exception):
    """A block needs something this machine lacks (the rest of the page is skipped)."""


@dataclass
class Failure(Exception):
    block: Block
    status: int | None  # None: timed out
    output: str

    def __str__(self) -> str:
        how = f"timed out after {BLOCK_TIMEOUT_S:.0f} s" if self.status is None else f"exit status {self.status}"
        return (f"{self.block.where()}: the {self.block.kind} block failed ({how}).\n"
                f"--- block ---\n{self.block.text}--- output ---\n{self.output[-6000:]}")


@dataclass
class PageRun:
    """The blocks of one page run in one directory; :meth:`close` kills what they left running."""

    root: str  # the repository
    workdir: Path
    ports: dict[int, int] = field(default_factory=dict)
    sessions: list[int] = field(default_factory=list)
    ran: list[Block] = field(default_factory=list)

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BLOCKD_", "BLOCKCTL_"))}
        for keep in ("BLOCKD_REQUIRE_ETCD",):
            if keep in os.environ:
                env[keep] = os.environ[keep]
        address = f"127.0.0.1:{self.ports[DEFAULT_PORT]}"
        env.update(PATH=f"{self.root}/.venv/bin:{env.get('PATH', '/usr/bin:/bin')}", HOME=str(self.workdir),
                   BLOCKD_LISTEN=address, BLOCKD_TARGET=address, PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        return env

    def prepare(self, text: str) -> None:
        for name in (".venv", "deploy"):
            link = self.workdir / name
            if not link.exists():
                link.symlink_to(Path(self.root) / name)
        taken: set[int] = set()
        for port in sorted(page_ports(text)):
            while (stand_in := free_port()) in taken:
                pass
            taken.add(stand_in)
            self.ports[port] = stand_in

    def run(self, block: Block) -> str:
        """Run one block; its output, or :class:`Failure` / :class:`Unavailable`."""
        if "etcd" in block.needs and shutil.which("etcd") is None:
            raise Unavailable("no etcd binary on PATH (Debian: apt-get install etcd-server)")
        n = len(self.ran) + 1
        source = localize(block.text, self.ports)
        if RUN_KINDS[block.kind] == "sh":
            script = self.workdir / f".block-{n}.sh"
            script.write_text("set -eo pipefail\n" + source)
            argv = ["bash", str(script)]
        else:
            script = self.workdir / f".block-{n}.py"
            script.write_text(source)
            argv = [f"{self.root}/.venv/bin/python", str(script)]
        log = self.workdir / f".block-{n}.out"
        with open(log, "wb") as out:
            popen = subprocess.Popen(argv, cwd=self.workdir, env=self.environ(), stdin=subprocess.DEVNULL,
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.sessions.append(popen.pid)
        self.ran.append(block)
        try:
            status: int | None = popen.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            status = None
        output = log.read_text(errors="replace")
        if status != 0:
            raise Failure(block, status, output + self._log_tails())
        return output

    def _log_tails(self) -> str:
        """The ends of the logs the page's daemons write (``> blockd.log``): why one did not come up."""
        tails = []
        for path in sorted(self.workdir.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-15:]
            tails.append(f"--- {path.name} (last lines) ---\n" + "\n".join(lines) + "\n")
        return "".join(tails)

    def close(self) -> None:
        """SIGTERM every block's process group (a graceful stop for daemons), then SIGKILL what is left."""
        for pgid in self.sessions:
            _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < deadline and any(_group_alive(g) for g in self.sessions):
            time.sleep(0.1)
        for pgid in self.sessions:
            _signal_group(pgid, signal.SIGKILL)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def run_page(root: str, page: Path, workdir: Path) -> PageRun:
    """Run every runnable block of ``page`` in order; raises at the first that fails."""
    text = page.read_text()
    run = PageRun(root, workdir)
    run.prepare(text)
    try:
        name = page.relative_to(root).as_posix() if page.is_relative_to(root) else page.name
        for block in blocks(text, name):
            if block.runs:
                run.run(block)
    finally:
        run.close()
    return run
