"""``blockctl report POOL --for DURATION``: a run report of a live pool, sampled from now on.

    blockctl report POOL --for 10m [--every 1] [--out DIR]

blockd keeps no history of a pool's statistics (its metrics are read at
scrape time), so a report of a running daemon is honest only about what it
watched: this command reads the pool's statistics (``GetPool``, the O(1)
counts ``top`` and the metrics endpoint serve) every ``--every`` seconds for
``--for``, or until Ctrl-C, and then writes the report
(:func:`client.report.render.write_report`: blocks by state in the device
and host tiers, utilisation, tail waste against its bound, prefix hit rate
and misses by reason). TTFT, TPOT and the block-size advisor need requests'
timings and lengths, which only a scheduler sees; the page says so rather
than draw empty axes. A past window (``--since``) needs a metrics history
this command does not read: Prometheus keeps one (Grafana's dashboard,
``deploy/grafana``).

Exit status as every command (:mod:`client.cli.common`): a missing pool is
3, a bad ``--for`` or ``--every`` 2 (argparse), the report needing
matplotlib (the ``report`` extra) 1 with the install line; Ctrl-C ends the
sampling early and still writes the report.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Callable

from client.cli.common import CommandFailed, Exit
from client.sdk import BlockdClient

DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smh]?)$")
UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
#: a sample more often than this only measures the RPC
MIN_EVERY_S = 0.05


def duration(text: str) -> float:
    """A flag type: ``90``, ``90s``, ``10m`` or ``1.5h``, in seconds (> 0)."""
    match = DURATION.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration > 0 such as 90s, 10m or 1h")
    return float(match.group(1)) * UNITS[match.group(2)]


def _every(text: str) -> float:
    seconds = duration(text)
    if seconds < MIN_EVERY_S:
        raise argparse.ArgumentTypeError(f"--every must be at least {MIN_EVERY_S} s, not {text!r}")
    return seconds


def sample(client: BlockdClient, pool: str, seconds: float, every_s: float, *,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
    """The pool's statistics every ``every_s`` for ``seconds`` (Ctrl-C: until then), as a ``RunRecord``."""
    from client.report.series import RunRecorder

    config = client.pool_config(pool)  # NOT_FOUND before any waiting
    num_workers = len(client.list_workers(pool))
    # the run's name names the PNG files; pool names may hold dots
    recorder = RunRecorder(re.sub(r"[^\w-]", "_", pool), lambda: client.get_pool(pool), clock=clock)
    recorder.sample()
    deadline = clock() + seconds
    interrupted = False
    try:
        while (left := deadline - clock()) > 0:
            sleep(min(every_s, left))
            recorder.sample(force=True)
    except KeyboardInterrupt:
        interrupted = True
    how = "until Ctrl-C" if interrupted else f"for {seconds:g} s"
    note = (f"blockctl report: GetPool every {every_s:g} s {how}; TTFT, TPOT and the block-size advisor need a "
            "scheduler's run (make demo, bench/serve.py)")
    return recorder.record(config, num_workers=max(1, num_workers), notes=[note])


def _report(client: BlockdClient, args: argparse.Namespace) -> None:
    try:
        import matplotlib  # noqa: F401 - say what is missing before sampling for minutes
    except ImportError:
        raise CommandFailed("the report is drawn with matplotlib: pip install 'blockd[report]'", Exit.FAILED) \
            from None
    from client.report.render import write_report

    client.get_pool(args.pool)  # a missing pool fails now, not after --for
    record = sample(client, args.pool, args.for_s, args.every)
    report = write_report(args.out, f"blockctl report {args.pool}", [record])
    print(f"run report: {os.path.abspath(report.html_path)} ({len(record.stats)} samples over "
          f"{record.seconds:.1f} s; its {len(report.png_paths)} plots are PNGs beside it)")


def add_report(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser("report", help="sample a pool for a while and write a run report (HTML and PNGs)")
    report.add_argument("pool")
    report.add_argument("--for", dest="for_s", type=duration, required=True, metavar="DURATION",
                        help="how long to sample from now: 90s, 10m, 1h (Ctrl-C ends it early)")
    report.add_argument("--every", type=_every, default=1.0, metavar="DURATION",
                        help="time between samples (default 1s)")
    report.add_argument("--out", default="blockd-report", metavar="DIR",
                        help="directory for report.html and its PNGs (default blockd-report)")
    report.set_defaults(run=_report)
