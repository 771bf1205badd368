"""``blockctl report``: a pool sampled live (``--for``) and read back from Prometheus (``--since``).

A scheduler (with the stub model) serves a workload on a thread through its
own SDK client while ``blockctl report`` samples the pool over real gRPC
(blockd's server in process on a free port), or while a real Prometheus
(Debian's ``prometheus``; that test skips, saying so, without it) scrapes a
real ``blockd serve --metrics-port``, whose last minute the report then
reads. Every plot of the report must show data; TTFT, TPOT and the advisor
are left out, saying why (the daemon sees no requests' timings or lengths).
Bad input is one line and an exit status, as for every command.
"""

from __future__ import annotations

import html
import io
import json
import random
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the report extra (pip install -e '.[report]') draws the plots")
pytest.importorskip("numpy", reason="the pixel checks read PNGs as arrays")

from bench.sim.model import StubModel
from bench.sim.workload import LengthDist, TraceSpec, request_stream, system_prompts, with_bare
from blockd.core import PoolConfig
from client.report.render import NO_ADVICE
from client.scheduler import Scheduler, SchedulerConfig
from client.sdk import BlockdClient
from tests.support.chromium import has_data, plot_grid
from tests.support.cli import run
from tests.support.procs import free_port

pytest_plugins = ["tests.support.grpc_fixtures"]

POOL = PoolConfig("live.pool", 64, 16, num_layers=2, num_kv_heads=2, head_dim=16, watermark_blocks=2,
                  num_host_blocks=32)


def serve_until(address: str, stop: threading.Event) -> None:
    """Waves of chat-like requests (shared system prompts) until ``stop``."""
    rng = random.Random(0)
    prefixes = with_bare(system_prompts(rng, 3, (20, 50)), 0.8)
    trace = TraceSpec("live", LengthDist(30, 0.6), LengthDist(20, 0.6), max_len=160)
    with BlockdClient(address, timeout_s=10.0) as client:
        sched = Scheduler(client, POOL.name, StubModel(), SchedulerConfig(256, 24))
        wave = 0
        while not stop.is_set():
            wave += 1
            for timed in request_stream(trace, rng, prefixes=prefixes, limit=12, id_prefix=f"w{wave}-"):
                sched.add_request(timed.request)
            while not sched.is_idle and not stop.is_set():
                sched.step()
                sched.take_finished()
                stop.wait(0.01)  # a scheduler's model takes time; the report should see it


def test_report_of_a_live_pool(blockd_server, client, capsys, tmp_path) -> None:
    client.create_pool(POOL)
    stop = threading.Event()
    serving = threading.Thread(target=serve_until, args=(blockd_server.address, stop), daemon=True)
    serving.start()
    try:
        code, out, err = run(capsys, "--target", blockd_server.address, "report", POOL.name, "--for", "2s",
                             "--every", "0.05", "--out", str(tmp_path / "r"))
    finally:
        stop.set()
        serving.join(30)
    assert code == 0, err
    page_path = tmp_path / "r" / "report.html"
    assert out.startswith(f"run report: {page_path} (")
    page = page_path.read_text(encoding="utf-8")
    ids = re.findall(r"<img class='plot' id='plot-(\w+)'", page)
    assert ids == [f"live_pool_{p}" for p in ("blocks", "utilisation", "tail_waste", "prefix")]
    assert NO_ADVICE in page and html.escape("TTFT, TPOT and the block-size advisor need a scheduler's run") in page
    for key in ids:  # with the host tier's blocks below the device's
        assert has_data((tmp_path / "r" / f"{key}.png").read_bytes(), *plot_grid(key, True)), key


@pytest.mark.parametrize(("args", "status", "message"), [
    (["report", "nope", "--for", "1s"], 3, "nope"),
    (["report", "p", "--for", "10x"], 2, "'10x' is not a duration > 0"),
    (["report", "p", "--for", "0s"], 2, "is not a duration > 0"),
    (["report", "p", "--for", "5s", "--every", "0.001"], 2, "--every must be at least"),
    (["report", "p"], 2, "--for"),
    (["report", "p", "--since", "10m"], 2, "--since needs --prometheus URL: blockd keeps no history"),
    (["report", "p", "--since", "10m", "--for", "1m"], 2, "not allowed with argument"),
])
def test_bad_input_is_one_line_and_an_exit_status(blockd_server, capsys, tmp_path, args, status, message) -> None:
    try:
        code, _, err = run(capsys, "--target", blockd_server.address, *args, "--out", str(tmp_path / "r"))
    except SystemExit as usage:  # argparse's usage errors exit 2 from within main
        code, err = usage.code, capsys.readouterr().err
    assert code == status and message in err and "Traceback" not in err, err
    assert not Path(tmp_path / "r").exists()


def test_prometheus_that_is_not_there_is_unavailable(blockd_server, client, capsys, tmp_path) -> None:
    client.create_pool(POOL)
    code, _, err = run(capsys, "--target", blockd_server.address, "report", POOL.name, "--since", "5m",
                       "--prometheus", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "r"))
    assert code == 69 and "cannot query Prometheus at http://127.0.0.1:" in err and "Traceback" not in err, err


PROMETHEUS = shutil.which("prometheus")


def _ask(url: str, expr: str) -> list:
    with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=5) as r:
        return json.loads(r.read())["data"]["result"]


def _until(what: str, check, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:  # not listening yet
            pass
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


@pytest.mark.skipif(PROMETHEUS is None, reason="Prometheus server not found: apt-get install prometheus (Debian)")
def test_report_of_the_last_minute_from_prometheus(daemon, capsys, tmp_path) -> None:
    metrics_port, prom_port = free_port(), free_port()
    blockd = daemon("--metrics-port", str(metrics_port))
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: 1s
  scrape_timeout: 900ms
scrape_configs:
  - job_name: blockd
    static_configs: [{{targets: ["127.0.0.1:{metrics_port}"]}}]
""")
    url = f"http://127.0.0.1:{prom_port}"
    with open(tmp_path / "prometheus.log", "w") as log:
        prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path}/tsdb",
                                       f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn",
                                       "--scrape.discovery-reload-interval=500ms"],
                                      stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    stop = threading.Event()
    try:
        address = blockd.address
        with BlockdClient(address) as client:
            client.create_pool(POOL)
        _until("a first scrape of blockd", lambda: _ask(url, f'blockd_pool_version{{pool="{POOL.name}"}}'), 30)
        serving = threading.Thread(target=serve_until, args=(address, stop), daemon=True)
        serving.start()
        time.sleep(5)  # five scrapes of a pool in use
        stop.set()
        serving.join(30)
        time.sleep(1.5)  # and one of the pool at rest
        code, _, err = run(capsys, "--target", address, "report", POOL.name, "--since", "1m", "--prometheus",
                             url, "--out", str(tmp_path / "r"))
    finally:
        stop.set()
        prometheus.terminate()
        prometheus.wait(10)
    assert code == 0, err
    page = (tmp_path / "r" / "report.html").read_text(encoding="utf-8")
    assert f"from Prometheus at {url}" in page and NO_ADVICE in page
    ids = re.findall(r"<img class='plot' id='plot-(\w+)'", page)
    assert ids == [f"live_pool_{p}" for p in ("blocks", "utilisation", "tail_waste", "prefix")]
    for key in ids:  # the metrics hold no host-tier counts: no host-tier subplot, rather than an empty one
        png = (tmp_path / "r" / f"{key}.png").read_bytes()
        assert has_data(png, *plot_grid(key, False)), key
    from PIL import Image  # matplotlib's Pillow

    assert Image.open(io.BytesIO((tmp_path / "r" / "live_pool_blocks.png").read_bytes())).height == 300
