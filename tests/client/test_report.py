"""A run report as a person sees it: rendered by headless Chromium from a real run.

The runs are real and small: the scheduler serving a chat-like workload on
blockd's engine in process (:class:`bench.sim.backend.InProcessBlockd`, a
host tier so blocks move between tiers, a pool small enough to evict) with
the stub model, once with paging and once with max-length reservation, each
recorded by :class:`client.report.series.RunRecorder`. Nothing the plots
show is written by the test.

"Has data" is read from pixels: the plots draw data in colour and everything
else in greys (:mod:`client.report.plots`), so a plot has data when coloured
pixels spread over many columns (a legend's swatches alone cover a few
dozen). Chromium renders the page twice at the same width: once with a probe
script appended to a copy of the page (where each plot's ``<img>`` lies, and
that Chromium decoded it), once as it is for the screenshot, which is then
cut at those places and checked plot by plot.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import re
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the report extra (pip install -e '.[report]') draws the plots")
np = pytest.importorskip("numpy", reason="the pixel checks read PNGs as arrays")
Image = pytest.importorskip("PIL.Image", reason="matplotlib's Pillow reads the PNGs")

from bench.sim.backend import InProcessBlockd  # noqa: E402
from bench.sim.model import StubModel  # noqa: E402
from bench.sim.workload import LengthDist, TraceSpec, request_stream, system_prompts, with_bare  # noqa: E402
from blockd.core import PoolConfig  # noqa: E402
from client.report.render import write_report  # noqa: E402
from client.report.series import RunRecord, RunRecorder, prefix_intervals, totals  # noqa: E402
from client.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from client.serving import ReservationAdmission  # noqa: E402
from tests.support import chromium  # noqa: E402
from tests.support.chromium import has_data, plot_grid  # noqa: E402

WIDTH = 1200
TRACE = TraceSpec("report_test", LengthDist(40, 0.7), LengthDist(40, 0.7), max_len=200)
POOL = PoolConfig("report", 80, 16, num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16",
                  watermark_blocks=2, num_host_blocks=48)
PROBE = """<script>
window.addEventListener("load", () => {
  const plots = [...document.querySelectorAll("img.plot")].map(img => {
    const r = img.getBoundingClientRect();
    return {id: img.id, decoded: img.complete && img.naturalWidth > 0, x: r.left + scrollX, y: r.top + scrollY,
            width: r.width, height: r.height};
  });
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify({height: document.documentElement.scrollHeight, plots});
  document.body.appendChild(pre);
});
</script>"""


def record_run(name: str, admission=None, seed: int = 0) -> RunRecord:
    rng = random.Random(seed)
    blockd = InProcessBlockd()
    blockd.create_pool(POOL)
    prefixes = with_bare(system_prompts(rng, 3, (20, 60)), 0.8)
    pending = list(request_stream(TRACE, rng, prefixes=prefixes, n_choices=((1, 0.7), (2, 0.3)), rate=0.5,
                                  limit=60))
    sched = Scheduler(blockd, POOL.name, StubModel(), SchedulerConfig(256, 32), admission=admission)
    recorder = RunRecorder(name, lambda: blockd.get_pool(POOL.name))
    tick = 0
    while pending or not sched.is_idle:
        if sched.is_idle:
            tick = max(tick, pending[0].arrival)
        while pending and pending[0].arrival <= tick:
            sched.add_request(pending.pop(0).request)
        sched.step()
        tick += 1
        recorder.add_outputs(sched.take_finished())
        recorder.sample()
    return recorder.record(POOL, notes=[f"in-process engine, stub model, {name}"])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    runs = [record_run("paging"),
            record_run("max_reservation", ReservationAdmission(POOL.num_blocks, POOL.block_size, TRACE.max_len,
                                                               POOL.watermark_blocks))]
    directory = tmp_path_factory.mktemp("report")
    return write_report(str(directory), "report test", runs, notes=["recorded in tests/client/test_report.py"]), runs


EXPECTED = ["comparison", *(f"{run}_{plot}" for run in ("paging", "max_reservation")
                            for plot in ("blocks", "utilisation", "tail_waste", "prefix", "latency")), "advisor"]


def test_the_runs_exercise_what_the_report_shows(report) -> None:
    _, runs = report
    paging = runs[0]
    assert totals(paging)["evictions"] > 0 and totals(paging)["prefix_hit_rate"] > 0
    assert any(s.num_host_cached_blocks for s in paging.stats), "no block reached the host tier"
    assert sum(sum(v) for v in prefix_intervals(paging).missed.values()) > 0
    assert max(s.num_seqs for s in paging.stats) > max(s.num_seqs for s in runs[1].stats)


def test_the_page_is_self_contained_and_its_pngs_are_beside_it(report) -> None:
    result, _ = report
    page = Path(result.html_path).read_text(encoding="utf-8")
    assert "<script" not in page and "<link" not in page and "url(" not in page
    sources = re.findall(r"src='([^']*)'", page)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    ids = re.findall(r"<img class='plot' id='plot-([\w]+)'", page)
    assert ids == EXPECTED
    for key, src in zip(ids, sources):
        beside = os.path.join(os.path.dirname(result.html_path), f"{key}.png")
        assert Path(beside).read_bytes() == base64.b64decode(src.split(",", 1)[1])
        assert has_data(Path(beside).read_bytes(), *plot_grid(key, True)), f"{key} has a subplot without data"
    assert f"Recommended: block size {result.advice.recommended.block_size}" in page


def test_an_empty_axis_does_not_count_as_data() -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3), dpi=100)
    ax = fig.subplots()
    for colour in ("tab:blue", "tab:orange", "tab:green"):
        ax.plot([], [], color=colour, linewidth=8, label=f"a legend entry in {colour}")
    ax.axhline(0.5, color="0.4", linestyle=":")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert not has_data(buf.getvalue())


def test_chromium_shows_every_plot_with_data(report, tmp_path) -> None:
    browser = chromium.require_chromium()
    result, _ = report
    probe_page = tmp_path / "probe.html"
    probe_page.write_text(Path(result.html_path).read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"))
    dom = chromium.dump_dom(browser, probe_page.as_uri(), WIDTH, 900)
    probe = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1))
    assert [p["id"] for p in probe["plots"]] == [f"plot-{key}" for key in EXPECTED]
    assert all(p["decoded"] for p in probe["plots"]), probe["plots"]
    shot = tmp_path / "screenshot.png"
    chromium.screenshot(browser, f"file://{result.html_path}", str(shot), WIDTH, int(probe["height"]))
    image = Image.open(shot).convert("RGB")
    assert image.size == (WIDTH, int(probe["height"]))
    grey = np.asarray(image.convert("L"))
    assert (grey < 250).mean() > 0.05, "the screenshot is (nearly) blank"
    for plot in probe["plots"]:
        box = (round(plot["x"]), round(plot["y"]), round(plot["x"] + plot["width"]), round(plot["y"] + plot["height"]))
        assert plot["width"] >= 600 and plot["height"] >= 200, f"{plot['id']} is drawn too small: {plot}"
        buf = io.BytesIO()
        image.crop(box).save(buf, format="PNG")
        key = plot["id"].removeprefix("plot-")
        assert has_data(buf.getvalue(), *plot_grid(key, True)), f"{key} shows no data (in a subplot) in the screenshot"
    if os.environ.get("BLOCKD_REPORT_SCREENSHOT"):  # to look at it: a path to copy it to
        image.save(os.environ["BLOCKD_REPORT_SCREENSHOT"])


def test_without_chromium_the_test_skips_saying_why(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("BLOCKD_REQUIRE_CHROMIUM", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no chromium on PATH"):
        chromium.require_chromium()
    monkeypatch.setenv("BLOCKD_REQUIRE_CHROMIUM", "1")
    with pytest.raises(pytest.fail.Exception, match="BLOCKD_REQUIRE_CHROMIUM=1 but no chromium"):
        chromium.require_chromium()


def test_bad_runs_are_refused_with_a_message(report, tmp_path) -> None:
    _, runs = report
    with pytest.raises(ValueError, match="distinct"):
        write_report(str(tmp_path), "twice", [runs[0], runs[0]])
    with pytest.raises(ValueError, match="two samples"):
        write_report(str(tmp_path), "empty", [])
