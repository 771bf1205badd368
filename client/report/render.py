"""A run report as one self-contained HTML file, with its PNGs beside it.

``write_report(directory, title, runs)`` draws the figures of
:mod:`client.report.plots` for every run (blocks by state, utilisation,
tail waste against its bound, the prefix cache with misses by reason,
TTFT and TPOT), one comparing the runs when there are several, and the
block-size advisor (:mod:`client.report.advisor`) over all runs' observed
lengths; it writes ``report.html`` and ``<plot>.png`` for each figure into
``directory``. A run with no finished requests (``blockctl report``: the
daemon's statistics alone) has no TTFT/TPOT figure, and without any
sequence lengths the advisor is left out, saying why. The page fetches nothing: every PNG is in it as a ``data:``
URI, the style sheet is inline and there is no script, so it opens from a
mail attachment or a CI artefact as it is. Every plot is an
``<img class="plot" id="plot-KEY">``, which the screenshot test finds.
"""

from __future__ import annotations

import base64
import html
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from client.report import plots
from client.report.advisor import CANDIDATES, Advice, advise, table_bytes_per_block
from client.report.series import RunRecord, totals
from client.serving import percentile

STYLE = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1100px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 14px; }
td, th { border: 1px solid #bbb; padding: 3px 8px; text-align: right; }
th { background: #eee; } td:first-child, th:first-child { text-align: left; }
tr.recommended { font-weight: bold; background: #eef6ee; }
figure { margin: 16px 0; } figcaption { font-size: 13px; color: #444; max-width: 1000px; }
.note { font-size: 13px; color: #444; }
"""


NO_ADVICE = ("<p class='note'>No advice: it needs the lengths of finished sequences, which a scheduler's run "
             "records (make demo, bench/serve.py); the daemon's statistics hold only their sum.</p>")


@dataclass(frozen=True)
class Section:
    """A heading, HTML before its figures (``intro``) and after them (``after``)."""

    heading: str
    figures: list[plots.Plot]
    intro: str = ""
    after: str = ""


@dataclass(frozen=True)
class Report:
    html_path: str
    png_paths: tuple[str, ...]
    #: None without sequence lengths
    advice: Advice | None


def write_report(directory: str, title: str, runs: Sequence[RunRecord], *, notes: Sequence[str] = ()) -> Report:
    """Draw ``runs`` into ``directory``/report.html and its PNGs (see the module docstring)."""
    if not runs or any(len(run.stats) < 2 for run in runs):
        raise ValueError("a report needs at least one run with two samples of its pool")
    names = [run.name for run in runs]
    if len(set(names)) != len(names) or not all(re.fullmatch(r"[\w-]+", name) for name in names):
        raise ValueError(f"run names name the PNG files: distinct, letters, digits, _ and - only, not {names}")
    lengths = [p + o for run in runs for p, o in run.lengths]
    # the runs of one report share a model (the benchmarks' schemes and tier sizes): the first one's prices the KV
    first = runs[0]
    # the run's own block size is always a row, so the table says what changing it would save
    candidates = sorted({*CANDIDATES, first.pool.block_size})
    advice = advise(lengths, first.pool.bytes_per_slot, table_bytes_per_block(first.num_workers), candidates) \
        if lengths else None
    sections: list[Section] = []
    if len(runs) > 1 and all(run.ttft_s for run in runs):
        sections.append(Section("Side by side", [plots.comparison(list(runs))]))
    sections += [Section(f"Run: {run.name}", plots.run_plots(run), intro=_run_notes(run)) for run in runs]
    if advice is not None:
        sections.append(Section("Block-size advisor", [plots.advisor(advice)],
                                after=_advice_table(advice, first.pool.block_size)))
    else:
        sections.append(Section("Block-size advisor", [], after=NO_ADVICE))
    os.makedirs(directory, exist_ok=True)
    pngs = []
    for section in sections:
        for plot in section.figures:
            path = os.path.join(directory, f"{plot.key}.png")
            with open(path, "wb") as f:
                f.write(plot.png)
            pngs.append(path)
    page = _page(title, runs, sections, notes)
    html_path = os.path.join(directory, "report.html")
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(page)
    return Report(html_path, tuple(pngs), advice)


def _page(title: str, runs: Sequence[RunRecord], sections: list[Section], notes: Sequence[str]) -> str:
    parts = [(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
              f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>")]
    parts += [f"<p class='note'>{html.escape(n)}</p>" for n in notes]
    parts.append(_summary(runs))
    for section in sections:
        parts += [f"<h2>{html.escape(section.heading)}</h2>", section.intro]
        for plot in section.figures:
            data = base64.b64encode(plot.png).decode()
            parts.append(f"<figure><img class='plot' id='plot-{plot.key}' alt='{html.escape(plot.title)}' "
                         f"src='data:image/png;base64,{data}'><figcaption><b>{html.escape(plot.title)}.</b> "
                         f"{html.escape(plot.caption)}</figcaption></figure>")
        parts.append(section.after)
    parts.append("</body></html>")
    return "\n".join(parts)


def _summary(runs: Sequence[RunRecord]) -> str:
    head = ("run", "requests", "sequences", "seconds", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
            "TPOT p50 ms", "TPOT p99 ms", "mean utilisation", "tail waste / seq", "prefix hit rate", "evictions")
    rows = []
    for run in runs:
        t = totals(run)
        ttft, tpot = [v * 1e3 for v in run.ttft_s], [v * 1e3 for v in run.tpot_s]
        served = bool(run.ttft_s)  # a report from the daemon's statistics alone saw no requests
        cells = (run.name, t["requests"] if served else "-", t["sequences"] if served else "-", f"{t['seconds']:.2f}",
                 f"{t['output_tokens_per_s']:.0f}" if served else "-",
                 *(f"{percentile(ms, q):.1f}" if ms else "-" for ms in (ttft, tpot) for q in (50, 99)),
                 f"{t['mean_utilisation']:.3f}",
                 f"{t['mean_tail_waste_per_seq']:.2f}", f"{t['prefix_hit_rate']:.3f}", t["evictions"])
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"
            "<p class='note'>Utilisation and tail waste per sequence are means over the samples with sequences "
            "in the pool; the hit rate is over the run's allocated prompt tokens.</p>")


def _run_notes(run: RunRecord) -> str:
    p = run.pool
    lines = [(f"pool {p.name}: {p.num_blocks} blocks of {p.block_size} slots ({p.bytes_per_block} B each: "
              f"{p.num_layers} layers x 2 x {p.num_kv_heads} KV heads x {p.head_dim} x {p.dtype}), "
              f"host tier {p.num_host_blocks} blocks; {len(run.stats)} samples over {run.seconds:.2f} s"),
             *run.notes]
    return "".join(f"<p class='note'>{html.escape(line)}</p>" for line in lines)


def _advice_table(advice: Advice, current: int) -> str:
    head = ("block size", "blocks / seq", "tail waste slots / seq", "tail waste / seq", "KV / seq",
            "table / seq", "total / seq", "vs recommended")
    rows = []
    best = advice.recommended.total_bytes
    for c in advice.costs:
        mark = " (this run)" if c.block_size == current else ""
        cells = (f"{c.block_size}{mark}", f"{c.blocks:.2f}", f"{c.tail_waste_slots:.2f}",
                 f"{c.tail_waste_bytes / 1024:.1f} KiB", f"{c.kv_bytes / 1024:.1f} KiB", f"{c.table_bytes:.0f} B",
                 f"{c.total_bytes / 1024:.1f} KiB", f"{c.total_bytes / best - 1:+.1%}")
        cls = " class='recommended'" if c is advice.recommended else ""
        rows.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in cells) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"
            f"<p><b>Recommended: {html.escape(advice.reason)}</b></p>"
            "<p class='note'>Cost per sequence = ceil(T/b)*b slots of KV + ceil(T/b) block-table entries, averaged "
            "over the observed lengths T (prompt + output of each sample). Not modelled: attention kernel speed "
            "per block size, and prefix sharing (only full blocks are shared, which also favours smaller "
            "blocks).</p>")
