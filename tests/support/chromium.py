"""Headless Chromium for tests that check a page as a person sees it.

Debian's ``chromium`` (``apt-get install chromium``; ``.ci/run`` installs
it). Tests that need it skip, saying why, unless ``BLOCKD_REQUIRE_CHROMIUM=1``
(CI sets it, so there they fail instead of skipping). Each call starts a
fresh browser with an empty profile in a temporary directory; the flags keep
it off the network (no background fetches, updates or sync: with nothing to
reach here it would otherwise wait on refused connections) and let it run as
root without a sandbox (a CI container). :func:`data_columns` reads a plot's
pixels for data.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

TIMEOUT_S = 60
#: a colour's channels differ; a grey's (axes, text, grid, reference lines) do not
SATURATION = 60
#: a plot with data colours at least this many pixel columns; a legend's swatches alone colour a few dozen
MIN_DATA_COLUMNS = 100
#: the same for one subplot of several (a third of the width at least); a legend alone colours ~40
MIN_CELL_COLUMNS = 60
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars")


def binary() -> str | None:
    return next((path for name in ("chromium", "chromium-browser") if (path := shutil.which(name))), None)


def require_chromium() -> str:
    """The browser's path; skip (or fail, with ``BLOCKD_REQUIRE_CHROMIUM=1``) without one."""
    path = binary()
    if path is not None:
        return path
    reason = "no chromium on PATH (Debian: apt-get install chromium)"
    if os.environ.get("BLOCKD_REQUIRE_CHROMIUM") == "1":
        pytest.fail(f"BLOCKD_REQUIRE_CHROMIUM=1 but {reason}")
    pytest.skip(reason)


def _run(browser: str, url: str, width: int, height: int, *extra: str) -> str:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        done = subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                               *extra, url], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited with {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def screenshot(browser: str, url: str, path: str, width: int, height: int) -> None:
    """A PNG of the page's first ``width`` x ``height`` pixels."""
    _run(browser, url, width, height, f"--screenshot={path}")
    if not os.path.exists(path):
        raise RuntimeError(f"chromium wrote no screenshot to {path}")


def dump_dom(browser: str, url: str, width: int, height: int) -> str:
    """The page's DOM once it has loaded (its scripts run)."""
    return _run(browser, url, width, height, "--dump-dom")


def data_columns(png: bytes, rows: int = 1, cols: int = 1) -> list[int]:
    """How many pixel columns hold a coloured pixel in each cell of a ``rows`` x
    ``cols`` grid over a PNG (a figure's subplots), row by row: the run report
    draws data in colour and everything else in greys (:mod:`client.report.plots`)."""
    import io

    import numpy as np
    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    coloured = (rgb.max(axis=2) - rgb.min(axis=2)) > SATURATION
    height, width = coloured.shape
    return [int(coloured[r * height // rows:(r + 1) * height // rows,
                         c * width // cols:(c + 1) * width // cols].any(axis=0).sum())
            for r in range(rows) for c in range(cols)]


def has_data(png: bytes, rows: int = 1, cols: int = 1) -> bool:
    """Whether every subplot of a ``rows`` x ``cols`` figure shows data (see :func:`data_columns`)."""
    least = MIN_DATA_COLUMNS if rows * cols == 1 else MIN_CELL_COLUMNS
    return min(data_columns(png, rows, cols)) >= least


def plot_grid(key: str, host_tier: bool) -> tuple[int, int]:
    """The subplot grid of a run report's figure, by its key (:mod:`client.report.plots`)."""
    if key == "comparison":
        return 1, 3
    if key.endswith("_latency"):
        return 1, 2
    if key.endswith("_prefix") or (key.endswith("_blocks") and host_tier):
        return 2, 1
    return 1, 1
