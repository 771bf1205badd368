"""A real Prometheus scraping a real ``blockd serve`` and two worker endpoints.

Starts Debian's Prometheus server (``/usr/bin/prometheus``, package
``prometheus``; the module skips, saying so, when it is missing) on a loopback
port with a temporary config and storage and a 1 s scrape and rule interval,
then:

* runs a workload through the SDK while Prometheus scrapes,
* freezes it and checks that the scraped tail waste, utilisation and block
  counts equal blockd's own stats at that moment,
* runs every Grafana panel query against Prometheus' HTTP API and requires a
  finite value from each,
* checks every alert rule loaded, evaluates and parses, and that alerts fire
  in constructed scenarios: a pool filled past 95%, a worker that vanished.

The alert rules are deploy/prometheus/alerts.yml with every ``for:`` set to
0s, so they fire within the test's seconds; the unit tests in
alerts_test.yml cover the durations. The workers are two real
``blockd-worker`` processes (a tensor-parallel pair, one KV head each) that
follow the pool and run write_kv / attention / copy_blocks for the workload.
Everything binds to 127.0.0.1; every process is stopped in teardown.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from blockd.core.arith import slot_mapping
from blockd.core.types import Allocate, Append, Commit, DecodeAppend, Fork, Free, PoolConfig, PoolStats
from client.sdk import BlockdClient
from client.worker import WorkerClient
from tests.deploy.test_deploy import PROM, concrete, dashboard_queries
from tests.support.procs import Proc, free_port, start_worker

pytest_plugins = ["tests.support.grpc_fixtures"]

PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus")
                                            else None)
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="Prometheus server not found: apt-get install prometheus (Debian) to run")

POOL = "itest"
NUM_BLOCKS = 64
BLOCK_SIZE = 4
HEAD_DIM = 8
WORKLOAD_S = 4.0
RATE_WINDOW = "30s"
#: metric prefixes that exist only once blockd serve wires BlockdMetrics' hooks
INSTRUMENTED = ("blockd_step_", "blockd_rpc_", "blockd_wal_")


def wait_for(what: str, check: Callable[[], object], timeout_s: float, every_s: float = 0.2):
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except OSError as err:  # not listening yet
            last_error = err
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what} (last error: {last_error})")


def http_get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read()


@dataclass
class Stack:
    daemon: Proc  # blockd serve
    client: BlockdClient
    metrics_port: int
    prom_url: str
    workers: dict[str, tuple[Proc, WorkerClient, int]]  # id -> (process, client, metrics port)
    frozen: PoolStats | None = None
    exposition: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)

    def query(self, expr: str) -> dict:
        url = f"{self.prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            return json.loads(http_get(url))
        except urllib.error.HTTPError as err:  # 400 bad_data: the body says why
            return json.loads(err.read())

    def vector(self, expr: str) -> list[dict]:
        answer = self.query(expr)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def alerts(self) -> list[dict]:
        return json.loads(http_get(f"{self.prom_url}/api/v1/alerts"))["data"]["alerts"]


def write_prometheus_config(directory: Path, metrics_port: int, worker_ports: list[int]) -> Path:
    # the shipped rules with every `for:` cut to 0s, so alerts fire within seconds
    fast = re.sub(r"^(\s*)for: \S+$", r"\1for: 0s", (PROM / "alerts.yml").read_text(), flags=re.MULTILINE)
    (directory / "alerts.yml").write_text(fast)
    workers = ", ".join(f'"127.0.0.1:{p}"' for p in worker_ports)
    config = directory / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: 1s
  scrape_timeout: 900ms
  evaluation_interval: 1s
rule_files: [alerts.yml]
scrape_configs:
  - job_name: blockd
    static_configs: [{{targets: ["127.0.0.1:{metrics_port}"]}}]
  - job_name: blockd-worker
    static_configs: [{{targets: [{workers}]}}]
""")
    return config


def start_prometheus(directory: Path, config: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(directory / "prometheus.log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={directory / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
             # hidden flag, default 5s: how long new targets wait before their first scrape
             "--scrape.discovery-reload-interval=500ms"],
            stdout=log, stderr=subprocess.STDOUT, cwd=directory)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited: {(directory / 'prometheus.log').read_text()[-2000:]}")
        return http_get(f"{url}/-/ready", 1.0).startswith(b"Prometheus")

    wait_for("prometheus to be ready", ready, 30)

    def all_targets_up() -> bool:
        query = urllib.parse.urlencode({"query": "sum(up)"})
        result = json.loads(http_get(f"{url}/api/v1/query?{query}"))["data"]["result"]
        return bool(result) and float(result[0]["value"][1]) == 3

    wait_for("a first scrape of blockd and both workers", all_targets_up, 15)
    return proc, url


def run_workload(stack: Stack, seconds: float) -> None:
    """Allocations sharing a cached prefix, commits, appends, forks (copy on
    write), decode steps and frees; cached blocks pile up, so some get evicted.
    After each decode step both real workers write the new token's K/V and run
    attention at that version (each on its KV head), so their kernels,
    copy-on-write copies and replicas are what the worker panels show."""
    client, prefix = stack.client, list(range(1, 9))
    live: list[str] = []
    i = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seq = f"s{i}"
        client.step(POOL, [Allocate(seq, [*prefix, 1000 + i, 2000 + i])])
        if i % 3 == 0:  # the child shares a partly filled block: its append copies it
            client.step(POOL, [Fork(seq, f"{seq}c"), Append(f"{seq}c", [5000 + i])])
            live.append(f"{seq}c")
        client.step(POOL, [Commit(seq, 10), Append(seq, [3000 + i, 4000 + i])])
        live.append(seq)
        while len(live) > 8:
            client.step(POOL, [Free(live.pop(0))])
        decoded = client.step(POOL, [DecodeAppend([seq], [6000 + i])])
        # every token's K/V is written: a worker attends only over KV it has written
        table = client.get_tables(POOL, [seq])[1][seq]
        slots = slot_mapping(table, 0, 13, BLOCK_SIZE)
        for _, worker, _ in stack.workers.values():
            kv = torch.randn(2, 13, 1, HEAD_DIM)
            worker.attention(POOL, decoded.version, i % 2, [seq], [13], [13], torch.randn(13, 1, HEAD_DIM),
                             key=kv[0], value=kv[1], slot_mapping=slots, pool_incarnation=decoded.incarnation)
        i += 1
        time.sleep(0.02)


def freeze(stack: Stack) -> None:
    """Stop mutating; wait until Prometheus has scraped the final version."""
    stack.frozen = stack.client.get_pool(POOL)

    def scraped_final() -> bool:
        result = stack.vector(f'blockd_pool_version{{pool="{POOL}"}}')
        return bool(result) and float(result[0]["value"][1]) == stack.frozen.version

    wait_for("a scrape of the frozen pool", scraped_final, 15)
    stack.exposition = http_get(f"http://127.0.0.1:{stack.metrics_port}/metrics").decode()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    # imported here, after pytest has loaded it as a plugin (see pytest_plugins)
    from tests.support.grpc_fixtures import start_daemon

    directory = tmp_path_factory.mktemp("prometheus")
    metrics_port = free_port()
    daemon = start_daemon("--listen", "127.0.0.1:0", "--metrics-port", str(metrics_port),
                          "--data-dir", str(directory / "blockd"), "--fsync", "always")
    client = BlockdClient(daemon.address, timeout_s=10.0)
    workers: dict[str, tuple[Proc, WorkerClient, int]] = {}
    proc = None
    try:
        wait_for("blockd's metrics endpoint", lambda: http_get(f"http://127.0.0.1:{metrics_port}/metrics"), 15)
        client.create_pool(PoolConfig(POOL, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers=2,
                                      num_kv_heads=2, head_dim=HEAD_DIM, dtype="float32"))
        for n in range(2):  # a tensor-parallel pair: one KV head each
            port = free_port()
            worker = start_worker(daemon.address, POOL, "--worker-id", f"w{n}", "--kv-heads", f"{n}:{n + 1}",
                                  "--device", "cpu", "--metrics-port", str(port))
            workers[f"w{n}"] = (worker, WorkerClient(worker.address, timeout_s=10), port)
        config = write_prometheus_config(directory, metrics_port, [port for _, _, port in workers.values()])
        proc, prom_url = start_prometheus(directory, config)
        built = Stack(daemon, client, metrics_port, prom_url, workers, procs=[proc])
        run_workload(built, WORKLOAD_S)
        freeze(built)
        yield built
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for worker, worker_client, _ in workers.values():
            worker_client.close()
            worker.kill()
        client.close()
        daemon.stop()


def single_value(stack: Stack, expr: str) -> float:
    result = stack.vector(expr)
    assert len(result) == 1, (expr, result)
    return float(result[0]["value"][1])


def test_scraped_stats_equal_blockd_stats(stack):
    s = stack.frozen
    sel = f'{{pool="{POOL}"}}'
    assert single_value(stack, f"blockd_pool_tail_waste_slots{sel}") == s.tail_waste_slots
    assert single_value(stack, f"blockd_pool_tail_waste_bytes{sel}") == s.tail_waste_bytes
    assert single_value(stack, f"blockd_pool_utilisation_ratio{sel}") == pytest.approx(s.utilisation_ratio)
    for state, count in (("free", s.num_free_blocks), ("used", s.num_used_blocks),
                         ("evictable", s.num_evictable_blocks)):
        assert single_value(stack, f'blockd_pool_blocks{{pool="{POOL}",state="{state}"}}') == count
    assert single_value(stack, f"blockd_pool_sequences{sel}") == s.num_seqs
    assert single_value(stack, f"blockd_prefix_hit_tokens_total{sel}") == s.prefix_hit_tokens
    assert single_value(stack, f"blockd_evictions_total{sel}") == s.num_evictions
    # the workload did what it claims, so the comparisons above are not all zeros
    assert s.tail_waste_slots > 0 and s.prefix_hit_tokens > 0 and s.num_copies > 0 and s.num_evictions > 0
    assert single_value(stack, f'blockd_workers{{pool="{POOL}",state="up"}}') == 2


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


def _check_panels(stack: Stack, queries: list[tuple[str, str]]) -> None:
    empty = [(title, expr) for title, expr in queries
             if not _finite(stack.vector(concrete(expr, RATE_WINDOW, POOL)))]
    assert not empty, f"panel queries without data: {empty}"


def test_every_state_panel_returns_data(stack):
    queries = [(t, e) for t, e in dashboard_queries() if not any(p in e for p in INSTRUMENTED)]
    assert len(queries) >= 15
    _check_panels(stack, queries)


def test_every_instrumented_panel_returns_data(stack):
    missing = [p for p in ("blockd_step_duration_seconds_count{", "blockd_rpc_duration_seconds_count{",
                           "blockd_wal_sync_duration_seconds_count ") if p not in stack.exposition]
    if missing:
        pytest.skip(f"`blockd serve` does not feed {missing} yet: wire BlockdMetrics.observe_step, "
                    "interceptor() and observe_wal_sync in blockd/cli/serve.py (see blockd/service/metrics.py)")
    _check_panels(stack, [(t, e) for t, e in dashboard_queries() if any(p in e for p in INSTRUMENTED)])


def test_every_alert_rule_loads_evaluates_and_parses(stack):
    def evaluated() -> list[dict]:
        groups = json.loads(http_get(f"{stack.prom_url}/api/v1/rules"))["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return rules if rules and all(r["lastEvaluation"] > "0001" for r in rules) else []

    rules = wait_for("every rule to be evaluated", evaluated, 10)
    assert {r["name"] for r in rules} >= {"BlockdDown", "BlockdPoolNearlyFull", "BlockdTailWasteHigh",
                                          "BlockdWorkerDown", "BlockdWorkerMetricsDown",
                                          "BlockdWorkerReplicaLagging", "BlockdStepLatencyHigh"}
    for rule in rules:
        assert rule["health"] == "ok", rule
        assert stack.query(rule["query"])["status"] == "success", rule["query"]
    assert stack.query("blockd_pool_blocks{")["status"] == "error"  # the check can fail


def _firing(stack: Stack, name: str, **labels: str) -> list[dict]:
    return [a for a in stack.alerts() if a["labels"]["alertname"] == name and a["state"] == "firing"
            and all(a["labels"].get(k) == v for k, v in labels.items())]


def test_pool_nearly_full_fires_when_filled(stack):
    assert not _firing(stack, "BlockdPoolNearlyFull")
    s = stack.client.get_pool(POOL)
    room = s.num_free_blocks + s.num_evictable_blocks
    stack.client.step(POOL, [Allocate("filler", [90000 + t for t in range(room * 4 - 1)])])
    assert stack.client.get_pool(POOL).utilisation_ratio > 0.95
    alerts = wait_for("BlockdPoolNearlyFull to fire", lambda: _firing(stack, "BlockdPoolNearlyFull", pool=POOL), 20)
    assert alerts[0]["labels"]["severity"] == "warning"
    assert not _firing(stack, "BlockdDown")
    assert not _firing(stack, "BlockdWorkerDown")


def test_worker_metrics_down_fires_for_the_vanished_worker(stack):
    worker, _, port = stack.workers["w1"]
    worker.kill()
    alerts = wait_for("BlockdWorkerMetricsDown to fire",
                      lambda: _firing(stack, "BlockdWorkerMetricsDown", instance=f"127.0.0.1:{port}"), 20)
    assert len(alerts) == 1
