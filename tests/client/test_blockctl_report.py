"""``blockctl report POOL --for D``: a live pool sampled over real gRPC while a scheduler serves on it.

The daemon is blockd's server in process on a free port; the scheduler (with
the stub model) serves a workload on a thread through its own SDK client, and
``blockctl report`` samples the pool meanwhile. Every plot of the report must
show data; TTFT, TPOT and the advisor are left out, saying why (the daemon
sees no requests' timings or lengths). Bad input is one line and an exit
status, as for every command.
"""

from __future__ import annotations

import html
import random
import re
import threading
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
from tests.support.chromium import MIN_DATA_COLUMNS, data_columns
from tests.support.cli import run

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
    for key in ids:
        assert data_columns((tmp_path / "r" / f"{key}.png").read_bytes()) >= MIN_DATA_COLUMNS, key


@pytest.mark.parametrize(("args", "status", "message"), [
    (["report", "nope", "--for", "1s"], 3, "nope"),
    (["report", "p", "--for", "10x"], 2, "'10x' is not a duration > 0"),
    (["report", "p", "--for", "0s"], 2, "is not a duration > 0"),
    (["report", "p", "--for", "5s", "--every", "0.001"], 2, "--every must be at least"),
    (["report", "p"], 2, "--for"),
])
def test_bad_input_is_one_line_and_an_exit_status(blockd_server, capsys, tmp_path, args, status, message) -> None:
    try:
        code, _, err = run(capsys, "--target", blockd_server.address, *args, "--out", str(tmp_path / "r"))
    except SystemExit as usage:  # argparse's usage errors exit 2 from within main
        code, err = usage.code, capsys.readouterr().err
    assert code == status and message in err and "Traceback" not in err, err
    assert not Path(tmp_path / "r").exists()
