"""``blockctl report``: a run report (HTML and PNGs) of a running daemon's pool.

    blockctl report POOL --since 10m --prometheus URL [--every S] [--out DIR]
    blockctl report POOL --for 10m [--every 1s] [--out DIR]

blockd keeps no history of a pool's statistics (its metrics are read at
scrape time), so a report is honest only about what someone recorded:

* ``--since D --prometheus URL``: the last ``D`` as the Prometheus server
  that scrapes blockd's ``/metrics`` kept it (:mod:`client.report.prometheus`;
  one point per ``--every``, default the window / 2000 and at least 1 s).
  The metrics carry no host-tier counts, so only the device tier is drawn.
* ``--for D``: from now on, the pool's statistics (``GetPool``, the O(1)
  counts ``top`` and the metrics endpoint serve) read every ``--every``
  (default 1 s) for ``D``, or until Ctrl-C, with the host tier.

Either way the page (:func:`client.report.render.write_report`) has blocks
by state, utilisation, tail waste against its bound, the prefix hit rate
and misses by reason. TTFT, TPOT and the block-size advisor need requests'
timings and lengths, which only a scheduler sees; the page says so rather
than draw empty axes. The pool's geometry comes from the daemon (``--target``).

Exit status as every command (:mod:`client.cli.common`): a missing pool (at
the daemon, or in Prometheus' window) is 3, bad flags 2 (``--since`` without
``--prometheus`` says why), Prometheus unreachable 69, the report needing
matplotlib (the ``report`` extra) 1 with the install line; Ctrl-C ends
``--for`` early and still writes the report.
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
LIVE_EVERY_S = 1.0


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


def _run_name(pool: str) -> str:
    """The run's name names the PNG files; pool names may hold dots."""
    return re.sub(r"[^\w-]", "_", pool)


def sample(client: BlockdClient, pool: str, seconds: float, every_s: float, *,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
    """The pool's statistics every ``every_s`` for ``seconds`` (Ctrl-C: until then), as a ``RunRecord``."""
    from client.report.series import RunRecorder

    config = client.pool_config(pool)  # NOT_FOUND before any waiting
    num_workers = len(client.list_workers(pool))
    recorder = RunRecorder(_run_name(pool), lambda: client.get_pool(pool), clock=clock)
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


def from_prometheus(client: BlockdClient, pool: str, url: str, since_s: float, every_s: float | None, *,
                    now: Callable[[], float] = time.time):
    """The last ``since_s`` of the pool as Prometheus kept it, as a ``RunRecord``."""
    from client.report.prometheus import PrometheusError, pool_history
    from client.report.series import RunRecord

    config = client.pool_config(pool)
    num_workers = len(client.list_workers(pool))
    end = now()
    try:
        history = pool_history(url, pool, end - since_s, end, every_s, timeout_s=max(10.0, since_s / 60))
    except PrometheusError as err:
        raise CommandFailed(str(err), Exit.UNAVAILABLE if err.unreachable else Exit.FAILED) from None
    except LookupError as err:
        raise CommandFailed(str(err), Exit.NOT_FOUND) from None
    except ValueError as err:
        raise CommandFailed(str(err), Exit.USAGE) from None
    note = (f"blockctl report: the last {since_s:g} s from Prometheus at {url}, one point per {history.step_s:g} s "
            "where blockd was scraped; the host tier is not in the metrics; TTFT, TPOT and the block-size "
            "advisor need a scheduler's run (make demo, bench/serve.py)")
    return RunRecord(_run_name(pool), config, history.times_s, history.stats, ttft_s=(), tpot_s=(), lengths=(),
                     seconds=history.times_s[-1], num_workers=max(1, num_workers), notes=(note,))


def _report(client: BlockdClient, args: argparse.Namespace) -> None:
    if args.since_s is not None and not args.prometheus:
        raise CommandFailed("--since needs --prometheus URL: blockd keeps no history of a pool's statistics, "
                            "the Prometheus that scrapes its /metrics does (or sample from now on with --for)",
                            Exit.USAGE)
    try:
        import matplotlib  # noqa: F401 - say what is missing before sampling for minutes
    except ImportError:
        raise CommandFailed("the report is drawn with matplotlib: pip install 'blockd[report]'", Exit.FAILED) \
            from None
    from client.report.render import write_report

    client.get_pool(args.pool)  # a missing pool fails now, not after --for
    if args.since_s is not None:
        record = from_prometheus(client, args.pool, args.prometheus, args.since_s, args.every)
    else:
        record = sample(client, args.pool, args.for_s, args.every or LIVE_EVERY_S)
    report = write_report(args.out, f"blockctl report {args.pool}", [record])
    print(f"run report: {os.path.abspath(report.html_path)} ({len(record.stats)} samples over "
          f"{record.seconds:.1f} s; its {len(report.png_paths)} plots are PNGs beside it)")


def add_report(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser("report", help="a run report (HTML and PNGs) of a pool: its past from Prometheus "
                                           "(--since) or sampled from now on (--for)")
    report.add_argument("pool")
    window = report.add_mutually_exclusive_group(required=True)
    window.add_argument("--since", dest="since_s", type=duration, metavar="DURATION",
                        help="the last 90s, 10m, 1h, from --prometheus")
    window.add_argument("--for", dest="for_s", type=duration, metavar="DURATION",
                        help="sample the pool from now on for 90s, 10m, 1h (Ctrl-C ends it early)")
    report.add_argument("--prometheus", metavar="URL", help="a Prometheus that scrapes blockd (http://HOST:9090)")
    report.add_argument("--every", type=_every, default=None, metavar="DURATION",
                        help=f"time between points (--for: default {LIVE_EVERY_S:g}s; --since: the window / 2000, "
                             "at least 1s)")
    report.add_argument("--out", default="blockd-report", metavar="DIR",
                        help="directory for report.html and its PNGs (default blockd-report)")
    report.set_defaults(run=_report)
