"""``blockctl top``: a live terminal view of every pool, for operators without Grafana.

    blockctl top [--interval 2] [--once] [--json]

Each frame shows, per pool: a utilisation bar (used blocks / capacity),
blocks by state, tail waste (slots and the share of used slots it wastes),
the prefix-cache hit rate (since the previous frame when there is one, else
over the pool's lifetime), sequences, tokens, version and workers up/down;
then a second table of the tiers (cached blocks on the device and in the host
tier, offloads and restores) and the prompt tokens that missed the prefix
cache by reason (:data:`blockd.core.types.MISS_REASONS`), since the pool was made.

One screen: on a terminal a frame fits its size. A pool name longer than
:data:`NAME_WIDTH` is shortened in the middle (the columns stay where they
are), lines are cut at the terminal's width rather than wrapped, and pools
beyond its height are counted on a last line instead of scrolling the title
away. Piped output (and ``--json``) is never cut.

Everything comes from two SDK reads per frame (``list_pools``,
``list_workers``): the same O(1) per-pool stats the metrics endpoint serves,
so running ``top`` costs blockd nothing measurable. ``--once`` prints one
frame and exits (for scripts and tests); otherwise the screen is redrawn
every ``--interval`` seconds until ``q`` (exit 0) or Ctrl-C (130). With
``--json`` every frame is one JSON object on one line. Owns rendering only; the SDK owns
the calls and their errors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO

from blockd import config_env
from blockd.core.types import PoolStats
from client.cli.common import jsonable

BAR_WIDTH = 20
#: ANSI: cursor home, clear screen; only written to a terminal
CLEAR = "\x1b[H\x1b[2J"
HEADERS = ("POOL", "UTILISATION", "USED", "FREE", "EVICT", "TAIL WASTE", "PREFIX HIT", "SEQS", "TOKENS",
           "VERSION", "WORKERS")
#: the second table: cached blocks per tier, then missed prompt tokens by reason (MISS_REASONS' order)
TIER_HEADERS = ("POOL", "DEV CACHED", "HOST CACHED", "OFFLOADS", "RESTORES", "MISS: NEVER STORED",
                "EVICTED DEV", "EVICTED HOST", "PARTIAL", "OTHER KEYS")
#: the widest pool name shown whole; longer ones keep their head and tail around an ellipsis
NAME_WIDTH = 24


def utilisation_bar(ratio: float, width: int = BAR_WIDTH) -> str:
    """``[#####...............]  25.0%``; the bar never overflows its width."""
    ratio = min(max(ratio, 0.0), 1.0)
    filled = round(ratio * width)
    return f"[{'#' * filled}{'.' * (width - filled)}] {ratio * 100:5.1f}%"


def tail_waste_cell(stats: PoolStats) -> str:
    """Wasted slots and their share of the slots in used blocks."""
    used_slots = stats.num_used_blocks * stats.block_size
    share = stats.tail_waste_slots / used_slots if used_slots else 0.0
    return f"{stats.tail_waste_slots} ({share * 100:.1f}%)"


def prefix_hit_cell(stats: PoolStats, previous: PoolStats | None) -> str:
    """Hit rate over the last interval when tokens were queried in it, else lifetime."""
    if previous is not None and stats.prefix_queried_tokens > previous.prefix_queried_tokens:
        queried = stats.prefix_queried_tokens - previous.prefix_queried_tokens
        hit = stats.prefix_hit_tokens - previous.prefix_hit_tokens
        return f"{max(hit, 0) / queried * 100:.1f}%"
    if not stats.prefix_queried_tokens:
        return "-"
    return f"{stats.prefix_hit_ratio * 100:.1f}%"


def short_name(name: str, width: int = NAME_WIDTH) -> str:
    """``name``, or its head and tail around ``…`` in ``width`` characters."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return f"{name[:head]}…{name[len(name) - (width - 1 - head):]}"


def _row(stats: PoolStats, previous: PoolStats | None, workers: tuple[int, int]) -> list[str]:
    up, down = workers
    return [short_name(stats.name), utilisation_bar(stats.utilisation_ratio), str(stats.num_used_blocks),
            str(stats.num_free_blocks), str(stats.num_evictable_blocks), tail_waste_cell(stats),
            prefix_hit_cell(stats, previous), str(stats.num_seqs), str(stats.num_tokens), str(stats.version),
            f"{up} up / {down} down"]


def _tier_row(stats: PoolStats) -> list[str]:
    host = f"{stats.num_host_cached_blocks} / {stats.num_host_blocks}" if stats.num_host_blocks else "-"
    return [short_name(stats.name), str(stats.num_evictable_blocks), host, str(stats.num_offloads),
            str(stats.num_restores), *(str(n) for n in stats.prefix_miss_tokens)]


def _table(rows: Sequence[Sequence[str]], headers: Sequence[str] = HEADERS) -> list[str]:
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(len(headers))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
            for line in (headers, *rows)]


def count_workers(workers: Sequence) -> dict[str, tuple[int, int]]:
    """``{pool: (up, down)}`` from the SDK's ``WorkerStatus`` list."""
    counts: dict[str, list[int]] = {}
    for status in workers:
        counts.setdefault(status.info.pool, [0, 0])[0 if status.is_up else 1] += 1
    return {pool: (up, down) for pool, (up, down) in counts.items()}


def render_frame(pools: Sequence[PoolStats], workers: Sequence, previous: dict[str, PoolStats] | None = None,
                 title: str = "", size: tuple[int, int] | None = None) -> str:
    """One frame as text: a title line, then one row per pool (sorted by name)
    in each table. ``size``: the terminal's ``(columns, lines)``, which the
    frame then fits (module docstring); None: nothing is cut."""
    pools = sorted(pools, key=lambda s: s.name)
    previous = previous or {}
    counts = count_workers(workers)
    lines = [title or f"blockd top  {time.strftime('%H:%M:%S')}  {len(pools)} pools", ""]
    orphans = sorted(set(counts) - {s.name for s in pools})
    tail = ["", "workers of unknown pools: " + ", ".join(orphans)] if orphans else []
    shown = pools
    if size is not None:
        # title, blank, two headers, the blank between the tables, the "more" line; the cursor's last line
        room = max(1, (size[1] - 1 - 6 - len(tail)) // 2)
        shown = pools[:room] if len(pools) > room else pools
    if not pools:
        lines.append("no pools (create one with `blockctl pools create`)")
    else:
        lines.extend(_table([_row(s, previous.get(s.name), counts.get(s.name, (0, 0))) for s in shown]))
        lines.append("")
        lines.extend(_table([_tier_row(s) for s in shown], TIER_HEADERS))
        if len(shown) < len(pools):
            lines.append(f"... {len(pools) - len(shown)} more pools (a taller terminal shows them; --json has all)")
    lines.extend(tail)
    if size is not None:
        lines = [line[: size[0]].rstrip() for line in lines]
    return "\n".join(lines) + "\n"


def json_frame(pools: Sequence[PoolStats], workers: Sequence) -> str:
    """One frame as one JSON object on one line (``--json``): every pool's
    stats and the workers up and down per pool."""
    counts = count_workers(workers)
    return json.dumps({"time": round(time.time(), 3), "pools": [jsonable(p) for p in pools],
                       "workers": {pool: {"up": up, "down": down} for pool, (up, down) in counts.items()}})


@contextlib.contextmanager
def key_reader(stream: TextIO) -> Iterator[Callable[[float], bool]]:
    """``wait(seconds)``, which sleeps and returns True as soon as ``q`` is
    typed on ``stream`` (a terminal, put in cbreak mode meanwhile and restored
    after); on anything else than a terminal it just sleeps."""
    try:
        fd = stream.fileno()
        interactive = os.isatty(fd)
    except (AttributeError, OSError, ValueError):
        interactive = False
    if not interactive:
        def nap(seconds: float) -> bool:
            time.sleep(seconds)
            return False

        yield nap
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def wait(seconds: float) -> bool:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            ready, _, _ = select.select([fd], [], [], left)
            if ready and os.read(fd, 1) in (b"q", b"Q"):
                return True
        return False

    try:
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_top(client, interval: float, once: bool, out: TextIO, *, sleep: Callable[[float], object] = time.sleep,
            max_frames: int | None = None, as_json: bool = False) -> int:
    """Draw frames from ``client`` (a :class:`client.sdk.BlockdClient`) into
    ``out`` every ``interval`` seconds; one frame when ``once``. Returns the
    number of frames drawn. ``max_frames`` bounds the loop for tests;
    ``sleep(seconds)`` returning True (``q`` typed) ends it; ``as_json``
    writes each frame as one JSON line instead of a screen."""
    if not once and not interval > 0:
        raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
    terminal = getattr(out, "isatty", lambda: False)() and not as_json
    clear = CLEAR if terminal else ""
    title_target = getattr(client, "target", "")
    previous: dict[str, PoolStats] = {}
    frames = 0
    while True:
        pools = client.list_pools()
        workers = client.list_workers()
        where = f"  {title_target}" if title_target else ""
        title = f"blockd top{where}  {time.strftime('%H:%M:%S')}  {len(pools)} pools"
        # the terminal's size read every frame: a resized window gets a frame that fits it
        size = (shutil.get_terminal_size().columns, shutil.get_terminal_size().lines) if terminal else None
        out.write(json_frame(pools, workers) + "\n" if as_json else clear + render_frame(pools, workers, previous,
                                                                                          title, size))
        out.flush()
        frames += 1
        if once or (max_frames is not None and frames >= max_frames):
            return frames
        previous = {s.name: s for s in pools}
        if sleep(interval):
            return frames


def _run(client, args: argparse.Namespace) -> None:
    # Ctrl-C leaves through blockctl's main: exit status 130, as documented; q ends it with 0
    with key_reader(sys.stdin) as wait:
        run_top(client, args.interval, args.once, sys.stdout, sleep=wait, as_json=args.json)


def add_top(sub: argparse._SubParsersAction) -> None:
    """Register ``top`` with ``blockctl`` (an entry of ``client.cli.COMMANDS``)."""
    top = sub.add_parser("top", help="live view of pools: utilisation, blocks, tail waste, prefix hits")
    top.add_argument("--interval", type=config_env.positive_float, default=2.0,
                     help="seconds between frames (default 2); q quits")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(run=_run)
