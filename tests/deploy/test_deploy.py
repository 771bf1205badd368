"""deploy/: Prometheus config and alert rules, the Grafana dashboard, compose and Dockerfile.

Checked offline: ``promtool check config``, ``check rules`` and ``test rules``
(Debian package ``prometheus``), every dashboard query parsed by promtool,
the committed dashboard JSON current, every metric the dashboard and alerts
name really exported, and ``docker compose config`` where a compose CLI is
installed. The live checks against a running Prometheus are in
test_prometheus_integration.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from blockd.core.types import Allocate, PoolConfig
from blockd.engine.machine import Engine
from blockd.ha.metrics import ElectionCollector
from blockd.replication.metrics import ReplicationCollector
from blockd.service.metrics import BlockdMetrics
from worker.metrics import KERNELS, WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROM = DEPLOY / "prometheus"
BUILDER = DEPLOY / "grafana" / "build_dashboard.py"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "blockd.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not found: apt-get install prometheus (Debian) to run this check")


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def load_builder():
    spec = importlib.util.spec_from_file_location("build_dashboard", BUILDER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def concrete(expr: str, rate_window: str = "1m", pool: str = ".*") -> str:
    """A dashboard query with Grafana's variables replaced, as Grafana would send it."""
    return expr.replace("$__rate_interval", rate_window).replace("$pool", pool)


def dashboard_queries() -> list[tuple[str, str]]:
    return load_builder().panel_queries(json.loads(DASHBOARD.read_text()))


def alert_names() -> list[str]:
    return re.findall(r"^\s*- alert:\s*(\w+)\s*$", (PROM / "alerts.yml").read_text(), re.MULTILINE)


@needs_promtool
def test_prometheus_config_is_valid():
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_alert_rules_are_valid():
    result = promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(alert_names())} rules found" in result.stdout


@needs_promtool
def test_alert_unit_tests_pass():
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    lines = (PROM / "alerts_test.yml").read_text().splitlines()
    cases: dict[str, set[str]] = {}
    for i, line in enumerate(lines):
        match = re.match(r"\s*alertname:\s*(\w+)\s*$", line)
        if match:
            following = lines[i + 1].strip()
            cases.setdefault(match.group(1), set()).add("quiet" if following == "exp_alerts: []" else "fires")
    expected = {"BlockdDown", "BlockdPoolNearlyFull", "BlockdTailWasteHigh", "BlockdWorkerDown",
                "BlockdWorkerMetricsDown", "BlockdWorkerReplicaLagging", "BlockdStepLatencyHigh",
                "BlockdNoLeader", "BlockdReplicationLagHigh", "BlockdLeaderChangesFrequent"}
    assert set(alert_names()) == expected
    for name in expected:
        assert cases.get(name) == {"quiet", "fires"}, name


def test_dashboard_json_is_current():
    result = subprocess.run([sys.executable, str(BUILDER), "--check"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_dashboard_check_mode_detects_a_stale_file(tmp_path):
    stale = tmp_path / "blockd.json"
    stale.write_text(DASHBOARD.read_text().replace('"title": "blockd"', '"title": "old"'))
    result = subprocess.run([sys.executable, str(BUILDER), "--check", "--output", str(stale)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1 and "stale" in result.stderr


def test_dashboard_shape():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["pool"]["multi"] and variables["pool"]["includeAll"]
    assert variables["datasource"]["type"] == "datasource"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in panels}
    for wanted in ("Utilisation", "Blocks by state", "Tail waste", "Prefix cache hit rate",
                   "Evictions and copies", "Step latency", "Worker kernel time p99", "Worker replica lag"):
        assert wanted in titles, wanted
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
    for title, expr in dashboard_queries():
        # only blockd-wide histograms (RPCs, the WAL) are not per pool
        assert 'pool=~"$pool"' in expr or title in ("RPC latency p99", "WAL fsync latency"), title


def _exported_names() -> set[str]:
    """Every sample name blockd and a worker expose once each metric has a sample."""
    engine = Engine()
    engine.create_pool(PoolConfig("p", num_blocks=4, block_size=4))
    metrics = BlockdMetrics()
    metrics.attach(engine)
    metrics.observe_step("p", [Allocate("a", [1])], "ok", 0.001)
    metrics.observe_wal_sync(0.001)
    metrics.rpc_duration.labels("m", "OK").observe(0.001)
    worker = WorkerMetrics("p", registry=CollectorRegistry())
    worker.observe_kernel(KERNELS[0], 0.001)
    worker.add_tokens(1)
    worker.add_copy_ops(1)
    names = set()
    for registry in (metrics.registry, worker.registry):
        names |= {s.name for family in registry.collect() for s in family.samples}
    # a replica's collectors need a live group to collect; their families name what they export
    # (tests/blockd/replication/test_ha_replication.py and tests/blockd/ha/test_ha_ops.py scrape real ones)
    for family in [*ElectionCollector._families(), *ReplicationCollector._families().values()]:
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_dashboard_and_alerts_only_name_exported_metrics():
    exported = _exported_names()
    texts = [expr for _, expr in dashboard_queries()] + [(PROM / "alerts.yml").read_text()]
    used = {name for text in texts for name in re.findall(r"\b(blockd_[a-z0-9_]+)\b", text)}
    assert used and used <= exported, sorted(used - exported)


@needs_promtool
def test_every_dashboard_query_parses(tmp_path):
    # promtool parses rule expressions, so each query becomes a recording rule
    rules = [{"record": f"dashboard:query_{i}", "expr": concrete(expr)}
             for i, (_, expr) in enumerate(dashboard_queries())]
    path = tmp_path / "dashboard_rules.json"  # JSON is YAML, so promtool reads it as it is
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout


def _compose_command() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        plugin = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30, check=False)
        if plugin.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_file_is_valid():
    command = _compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor docker-compose is installed "
                    "(apt-get install docker-compose to run this offline check)")
    result = subprocess.run([*command, "-f", str(DEPLOY / "docker-compose.yml"), "config", "-q"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_mounts_and_dockerfile_copies_exist():
    compose = (DEPLOY / "docker-compose.yml").read_text()
    for source in re.findall(r"^\s*- \./([\w/.-]+):", compose, re.MULTILINE):
        assert (DEPLOY / source).exists(), source
    for service in ("blockd:", "worker-0:", "worker-1:", "prometheus:", "grafana:"):
        assert f"\n  {service}" in compose, service
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (?!--from=)(.+)$", dockerfile, re.MULTILINE):
        for source in line.split()[:-1]:
            assert (ROOT / source).exists(), source
    targets = re.findall(r'"([\w.-]+:\d+)"', (PROM / "prometheus.yml").read_text())
    assert {t.split(":")[0] for t in targets} == {"blockd", "worker-0", "worker-1"}


def test_grafana_provisioning_points_at_the_dashboards():
    provider = (DEPLOY / "grafana" / "provisioning" / "dashboards" / "blockd.yml").read_text()
    compose = (DEPLOY / "docker-compose.yml").read_text()
    path = re.search(r"path:\s*(\S+)", provider).group(1)
    assert f"./grafana/dashboards:{path}:ro" in compose
    datasource = (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    assert "type: prometheus" in datasource and "http://prometheus:9090" in datasource
