"""blockd.service.metrics and worker.metrics: values, exposition, naming, label bounds.

The collector's values are compared with the engine's own stats after a
workload that exercises every counter (prefix hits, evictions, copy-on-write),
and a real scrape of the HTTP endpoint is checked by ``promtool check
metrics`` (skipped, saying why, when Debian's ``prometheus`` package is not
installed).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import urllib.request
from concurrent import futures

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import blockd.core
from blockd.core.errors import InvalidArgument, NoRoom, NotFound
from blockd.core.types import Allocate, Append, Commit, DecodeAppend, Fork, Free, PoolConfig, WorkerInfo
from blockd.engine.config import EngineConfig
from blockd.engine.machine import Engine
from blockd.service.metrics import BlockdMetrics, EngineCollector, outcome_of, start_metrics_server
from worker.metrics import WorkerMetrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not found: apt-get install prometheus (Debian) to run this check")
ALLOWED_LABELS = {"pool", "state", "kind", "outcome", "method", "code", "kernel", "le", "reason", "result",
                  # the build's, constant for a process: blockd_build_info and the standard python_info
                  "version", "python_version", "core", "implementation", "major", "minor", "patchlevel"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_workload(engine: Engine, pool: str) -> None:
    """Touches every counter: prefix hits, copy-on-write, evictions."""
    prompt = list(range(10))  # 2 full blocks of 4 and a partial one
    engine.step(pool, [Allocate("s1", prompt), Commit("s1", 10)])
    engine.step(pool, [Free("s1")])  # its 2 full blocks become evictable
    engine.step(pool, [Allocate("s2", prompt)])  # hits 8 cached tokens
    engine.step(pool, [Fork("s2", "s3"), Append("s3", [7])])  # shared partial block: copy on write
    engine.step(pool, [DecodeAppend(["s2", "s3"], [1, 2])])
    engine.step(pool, [Free("s2"), Free("s3")])
    # fill the pool with fresh prompts so the cached blocks get evicted
    for i in range(3):
        engine.step(pool, [Allocate(f"fill{i}", [100 + i] * 18)])


def engine_with_workload(clock: FakeClock | None = None) -> Engine:
    clock = clock or FakeClock()
    engine = Engine(EngineConfig(clock=clock, worker_timeout_s=10.0))
    engine.create_pool(PoolConfig("alpha", num_blocks=16, block_size=4, num_layers=2, num_kv_heads=2,
                                  head_dim=8))
    engine.create_pool(PoolConfig("beta", num_blocks=8, block_size=16))
    for worker_id in ("w0", "w1"):  # before any KV exists: a later worker would find it lost
        engine.register_worker(WorkerInfo(worker_id, "alpha", layer_end=2, kv_head_end=2, incarnation=worker_id))
    run_workload(engine, "alpha")
    engine.step("beta", [Allocate("b1", [1, 2, 3])])
    clock.now += 20.0
    engine.heartbeat("w0", 3)  # w1 misses its heartbeats: down
    return engine


def test_collector_values_equal_engine_stats():
    engine = engine_with_workload()
    metrics = BlockdMetrics()
    metrics.attach(engine)
    value = metrics.registry.get_sample_value
    for s in engine.list_pools():
        pool = {"pool": s.name}
        assert value("blockd_pool_blocks", {**pool, "state": "free"}) == s.num_free_blocks
        assert value("blockd_pool_blocks", {**pool, "state": "used"}) == s.num_used_blocks
        assert value("blockd_pool_blocks", {**pool, "state": "evictable"}) == s.num_evictable_blocks
        assert value("blockd_pool_capacity_blocks", pool) == s.num_blocks
        assert value("blockd_pool_block_size_slots", pool) == s.block_size
        assert value("blockd_pool_utilisation_ratio", pool) == pytest.approx(s.utilisation_ratio)
        assert value("blockd_pool_tail_waste_slots", pool) == s.tail_waste_slots
        assert value("blockd_pool_tail_waste_bytes", pool) == s.tail_waste_bytes
        used_slots = s.num_used_blocks * s.block_size
        assert value("blockd_pool_tail_waste_ratio", pool) == pytest.approx(
            s.tail_waste_slots / used_slots if used_slots else 0.0)
        assert value("blockd_pool_sequences", pool) == s.num_seqs
        assert value("blockd_pool_tokens", pool) == s.num_tokens
        assert value("blockd_pool_version", pool) == s.version
        assert value("blockd_prefix_queried_tokens_total", pool) == s.prefix_queried_tokens
        assert value("blockd_prefix_hit_tokens_total", pool) == s.prefix_hit_tokens
        assert value("blockd_evictions_total", pool) == s.num_evictions
        assert value("blockd_cow_copies_total", pool) == s.num_copies
        for reason, count in s.prefix_miss_by_reason.items():
            assert value("blockd_prefix_miss_tokens_total", {**pool, "reason": reason}) == count
    alpha = engine.get_pool("alpha")
    # the workload really exercised every counter, so the equalities above mean something
    assert alpha.prefix_hit_tokens == 8 and alpha.num_evictions > 0 and alpha.num_copies == 1
    assert sum(alpha.prefix_miss_tokens) == alpha.prefix_queried_tokens - alpha.prefix_hit_tokens > 0
    assert alpha.tail_waste_slots > 0 and alpha.tail_waste_bytes == alpha.tail_waste_slots * 2 * 2 * 2 * 8 * 2
    assert value("blockd_workers", {"pool": "alpha", "state": "up"}) == 1
    assert value("blockd_workers", {"pool": "alpha", "state": "down"}) == 1
    assert value("blockd_workers", {"pool": "beta", "state": "up"}) == 0


class CountingEngine:
    """Counts the reads the collector makes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.reads = 0

    def list_pools(self, *, local=False):
        self.reads += 1
        return self.engine.list_pools(local=local)

    def list_workers(self, pool=None, *, local=False):
        return self.engine.list_workers(pool, local=local)


def test_engine_is_read_only_at_scrape_time():
    engine = CountingEngine(engine_with_workload())
    metrics = BlockdMetrics()
    metrics.attach(engine)
    assert engine.reads == 0  # registering reads describe(), not the engine
    for _ in range(5):
        metrics.observe_step("alpha", [Free("x")], "ok", 0.001)
    assert engine.reads == 0  # the step path never walks the engine
    list(metrics.registry.collect())
    list(metrics.registry.collect())
    assert engine.reads == 2


def test_observe_step_counts_each_op_kind():
    metrics = BlockdMetrics()
    ops = [Allocate("a", [1]), Append("a", [2]), Commit("a", 2), Fork("a", "b"), Free("b"),
           DecodeAppend(["a", "c", "d"], [1, 2, 3]), Allocate("e", [3])]
    metrics.observe_step("p", ops, "ok", 0.002)
    metrics.observe_step("p", [Append("a", [1])], "resource_exhausted", 0.001)
    value = metrics.registry.get_sample_value
    expected = {"allocate": 2, "append": 1, "commit": 1, "fork": 1, "free": 1, "decode_append": 1}
    for kind, n in expected.items():
        assert value("blockd_step_operations_total", {"pool": "p", "kind": kind, "outcome": "ok"}) == n
    assert value("blockd_step_operations_total",
                 {"pool": "p", "kind": "append", "outcome": "resource_exhausted"}) == 1
    assert value("blockd_step_duration_seconds_count", {"pool": "p"}) == 2
    assert value("blockd_step_duration_seconds_sum", {"pool": "p"}) == pytest.approx(0.003)


def test_failing_steps_cannot_mint_pool_labels():
    engine = Engine()
    engine.create_pool(PoolConfig("real", num_blocks=4, block_size=4))
    metrics = BlockdMetrics()
    metrics.attach(engine)
    for i in range(50):
        metrics.observe_step(f"bogus-{i}", [Free("x")], "not_found", 0.001)
    metrics.observe_step("real", [Free("x")], "not_found", 0.001)  # known pool, unknown sequence
    value = metrics.registry.get_sample_value
    assert value("blockd_step_duration_seconds_count", {"pool": "_unknown_"}) == 50
    assert value("blockd_step_duration_seconds_count", {"pool": "real"}) == 1
    pools = {s.labels["pool"] for f in metrics.registry.collect() if f.name == "blockd_step_duration_seconds"
             for s in f.samples}
    assert pools == {"_unknown_", "real"}


def test_outcome_is_ok_or_the_lowercase_status_name():
    assert outcome_of(None) == "ok"
    assert outcome_of(NoRoom("full")) == "resource_exhausted"
    assert outcome_of(NotFound("x")) == "not_found"
    assert outcome_of(InvalidArgument("x")) == "invalid_argument"
    assert outcome_of(RuntimeError("bug")) == "internal"


def test_wal_sync_is_observed_through_the_engine_hook(tmp_path):
    metrics = BlockdMetrics()
    engine = Engine(EngineConfig(data_dir=str(tmp_path), fsync="always", observe_wal_sync=metrics.observe_wal_sync))
    try:
        engine.create_pool(PoolConfig("p", num_blocks=4, block_size=4))
        engine.step("p", [Allocate("a", [1, 2])])
    finally:
        engine.close()
    assert metrics.registry.get_sample_value("blockd_wal_sync_duration_seconds_count") >= 2


def _serve_with_interceptor(metrics: BlockdMetrics):
    def ok(request, context):
        return request

    def not_found(request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, "no such pool")

    def stream(request, context):
        yield request
        yield request

    handlers = {
        "Ok": grpc.unary_unary_rpc_method_handler(ok),
        "Missing": grpc.unary_unary_rpc_method_handler(not_found),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[metrics.interceptor()])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Svc", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_rpc_interceptor_times_unary_calls_by_method_and_code():
    metrics = BlockdMetrics()
    server, port = _serve_with_interceptor(metrics)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for _ in range(3):
                assert channel.unary_unary("/test.Svc/Ok")(b"x", timeout=5) == b"x"
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary("/test.Svc/Missing")(b"x", timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert list(channel.unary_stream("/test.Svc/Stream")(b"x", timeout=5)) == [b"x", b"x"]
            with pytest.raises(grpc.RpcError):
                channel.unary_unary("/test.Svc/NoSuchMethod")(b"x", timeout=5)
    finally:
        server.stop(0)
    value = metrics.registry.get_sample_value
    assert value("blockd_rpc_duration_seconds_count", {"method": "test.Svc/Ok", "code": "OK"}) == 3
    assert value("blockd_rpc_duration_seconds_count", {"method": "test.Svc/Missing", "code": "NOT_FOUND"}) == 1
    methods = {s.labels["method"] for f in metrics.registry.collect() if f.name == "blockd_rpc_duration_seconds"
               for s in f.samples}
    assert methods == {"test.Svc/Ok", "test.Svc/Missing"}  # streams and unknown methods are not timed


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


@pytest.fixture
def scraped_blockd():
    """A real scrape of the endpoint after a workload with step, RPC and WAL samples."""
    engine = engine_with_workload()
    metrics, server = start_metrics_server(engine, 0)
    metrics.observe_step("alpha", [Allocate("x", [1])], "ok", 0.0004)
    metrics.observe_wal_sync(0.002)
    metrics.rpc_duration.labels("blockd.v1.BlockService/Step", "OK").observe(0.001)
    try:
        assert server.addr == "127.0.0.1"  # loopback unless asked otherwise
        yield engine, _scrape(server.port)
    finally:
        server.close()


def test_exposition_parses_and_names_follow_conventions(scraped_blockd):
    _, text = scraped_blockd
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("blockd_pool_blocks", "blockd_pool_utilisation_ratio", "blockd_pool_tail_waste_bytes",
                 "blockd_step_duration_seconds", "blockd_rpc_duration_seconds",
                 "blockd_wal_sync_duration_seconds", "blockd_workers"):
        assert name in families, name
    for name in ("blockd_prefix_queried_tokens", "blockd_prefix_hit_tokens", "blockd_prefix_miss_tokens",
                 "blockd_evictions", "blockd_cow_copies", "blockd_step_operations"):
        assert families[name].type == "counter", name
    for family in families.values():
        if family.type != "counter":
            assert not family.name.endswith("_total"), family.name
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, sample
    ratio = families["blockd_pool_utilisation_ratio"]
    assert all(0.0 <= s.value <= 1.0 for s in ratio.samples)


@needs_promtool
def test_promtool_check_metrics_is_clean_on_a_real_scrape(scraped_blockd):
    _, text = scraped_blockd
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), result


def test_two_metrics_servers_in_one_process_do_not_collide():
    first, second = Engine(), Engine()
    first.create_pool(PoolConfig("one", num_blocks=4, block_size=4))
    second.create_pool(PoolConfig("two", num_blocks=4, block_size=4))
    _, server_a = start_metrics_server(first, 0)
    _, server_b = start_metrics_server(second, 0)
    try:
        assert 'pool="one"' in _scrape(server_a.port) and 'pool="two"' not in _scrape(server_a.port)
        assert 'pool="two"' in _scrape(server_b.port)
    finally:
        server_a.close()
        server_b.close()
    metrics = BlockdMetrics()
    metrics.attach(first)
    with pytest.raises(ValueError, match="already attached"):
        metrics.attach(second)
    with pytest.raises(ValueError, match="metrics port"):
        start_metrics_server(first, -1)


def test_tail_waste_ratio_is_the_unused_share_of_the_used_blocks():
    engine = Engine()
    engine.create_pool(PoolConfig("w", num_blocks=8, block_size=4))
    metrics = BlockdMetrics()
    metrics.attach(engine)
    ratio = lambda: metrics.registry.get_sample_value("blockd_pool_tail_waste_ratio", {"pool": "w"})  # noqa: E731
    assert ratio() == 0.0  # no used block: 0, not a division by zero
    engine.step("w", [Allocate("a", [1, 2, 3, 4, 5])])  # 2 blocks, 8 slots, 3 unused
    assert ratio() == pytest.approx(3 / 8)
    engine.step("w", [Allocate("b", [9, 9, 9, 9])])  # a full block: 3 of 12
    assert ratio() == pytest.approx(3 / 12)


def _standard_metrics(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("program", ["blockd", "blockd-worker"])
def test_build_info_and_the_standard_process_metrics(program):
    """Each program's own registry has what the process-global one would: process_*,
    python_info, and blockd_build_info (value 1, the version and Python in its labels)."""
    if program == "blockd":
        engine = Engine()
        _, server = start_metrics_server(engine, 0)
        try:
            families = _standard_metrics(_scrape(server.port))
        finally:
            server.close()
    else:
        families = _standard_metrics(worker_scrape(WorkerMetrics("alpha")))
    (info,) = families["blockd_build_info"].samples
    assert info.value == 1
    assert info.labels == {"version": importlib.metadata.version("blockd"),
                           "python_version": platform.python_version(),
                           "core": "compiled" if blockd.core.BUILD == "compiled" else "python"}
    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds",
                 "process_start_time_seconds", "python_info"):
        assert name in families, name
    assert families["process_resident_memory_bytes"].samples[0].value > 0


def test_collector_handles_no_pools():
    families = list(EngineCollector(Engine()).collect())
    assert all(not f.samples for f in families)


def worker_scrape(metrics: WorkerMetrics) -> str:
    server = metrics.start_http(0)
    try:
        return _scrape(server.port)
    finally:
        server.close()


def test_worker_metrics_output():
    metrics = WorkerMetrics("alpha", registry=CollectorRegistry())
    metrics.observe_kernel("write_kv", 0.0002)
    metrics.observe_kernel("decode_attention", 0.003)
    metrics.observe_kernel("decode_attention", 0.001)
    metrics.add_tokens(64)
    metrics.add_tokens(16)
    metrics.add_copy_ops(3)
    metrics.set_replica_lag(2)
    metrics.set_applied_version(41)
    metrics.set_pool_bytes(1 << 20)
    value = metrics.registry.get_sample_value
    pool = {"pool": "alpha"}
    assert value("blockd_worker_kernel_duration_seconds_count", {**pool, "kernel": "decode_attention"}) == 2
    assert value("blockd_worker_kernel_duration_seconds_sum", {**pool, "kernel": "decode_attention"}) == \
        pytest.approx(0.004)
    assert value("blockd_worker_tokens_processed_total", pool) == 80
    assert value("blockd_worker_copy_ops_total", pool) == 3
    assert value("blockd_worker_replica_lag_versions", pool) == 2
    assert value("blockd_worker_applied_version", pool) == 41
    assert value("blockd_worker_pool_bytes", pool) == 1 << 20
    metrics.add_transfer_blocks("fetched", 2)
    assert value("blockd_worker_transfer_blocks_total", {**pool, "result": "fetched"}) == 2
    assert value("blockd_worker_transfer_blocks_total", {**pool, "result": "failed"}) == 0
    with pytest.raises(ValueError, match="unknown kernel"):
        metrics.observe_kernel("flash_attention_9000", 0.1)
    with pytest.raises(ValueError, match="pool must be"):
        WorkerMetrics("")
    text = worker_scrape(metrics)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, sample
    if PROMTOOL:
        result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                                timeout=30, check=False)
        assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result


def test_worker_metrics_module_imports_no_torch():
    code = "import sys, worker.metrics; print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
