"""Where the benchmarks and demos write their run report, and the line that says so.

:func:`write` draws the runs with :func:`client.report.render.write_report`
into ``directory`` and prints the path of ``report.html``; without
matplotlib (the ``report`` extra) it prints how to get it and carries on,
since a benchmark's numbers are worth having without the pictures.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from client.report.series import RunRecord


def write(directory: str, title: str, runs: Sequence[RunRecord], out, notes: Sequence[str] = ()) -> str | None:
    """The report's path, or None when it could not be drawn (said on ``out``)."""
    try:
        import matplotlib  # noqa: F401 - only to say what is missing before drawing anything
    except ImportError:
        print("no run report: matplotlib is not installed (pip install -e '.[report]')", file=out, flush=True)
        return None
    from client.report.render import write_report

    report = write_report(directory, title, runs, notes=notes)
    path = os.path.abspath(report.html_path)
    advice = f"; block-size advisor: {report.advice.recommended.block_size}" if report.advice else ""
    print(f"run report: {path} (open it in a browser; its {len(report.png_paths)} plots are PNGs beside it)"
          f"{advice}", file=out, flush=True)
    return path
