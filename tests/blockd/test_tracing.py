"""Tracing across the three processes (blockd.rpc.tracing, the ``otel`` extra).

The test process is the scheduler: it traces with the OpenTelemetry SDK's
in-memory exporter, and it runs a small OTLP/gRPC collector (opentelemetry-
proto's ``TraceService``) that a real ``blockd serve`` and a real
``blockd-worker --model tiny-llama`` export to, switched on by the standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` variable. One scheduler step's spans must form
one trace: the daemon's step span and each worker's ModelStep under the
scheduler's spans, the kernel parts (write_kv, attention per layer, sampling)
inside ModelStep. Both ways a step reaches blockd are checked: a StepStream
message (the trace context in ``StepRequest.traceparent``) and unary ``Step``
(in the call's metadata).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest

from blockd.cluster.local import ClusterSpec, LocalCluster, child_env
from blockd.rpc import trace_grpc, tracing
from tests.conftest import ROOT

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

SPAN_DEADLINE_S = 20.0


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver: every span exported to it, with its service's name."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                for scope in resource_spans.scope_spans:
                    self.spans += [{"service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                                    "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                    "attributes": {a.key: a.value for a in s.attributes}} for s in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[dict]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.server.stop(0)


@pytest.fixture
def in_memory():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing.use(None)


def local(span) -> dict:
    return {"service": "scheduler", "name": span.name, "trace_id": f"{span.context.trace_id:032x}",
            "span_id": f"{span.context.span_id:016x}",
            "parent": f"{span.parent.span_id:016x}" if span.parent is not None else ""}


def wait_for(collector: Collector, trace_id: str, names: set[str]) -> list[dict]:
    deadline = time.monotonic() + SPAN_DEADLINE_S
    while time.monotonic() < deadline:
        spans = collector.trace(trace_id)
        if names <= {s["name"] for s in spans}:
            return spans
        time.sleep(0.1)
    raise AssertionError(f"spans {names} of trace {trace_id} did not all arrive: {collector.trace(trace_id)}")


def check_step_trace(steps: list[dict], mine: list[dict], collector: Collector, daemon_span: str) -> None:
    """The last scheduler step that ran the model: one trace across the three processes."""
    root = next(s for s in reversed(steps) if any(c["parent"] == s["span_id"] and c["name"].endswith("ModelStep")
                                                 for c in mine))
    assert root["parent"] == "", "the scheduler's step starts the trace"
    trace_id = root["trace_id"]
    model_call = next(s for s in mine if s["parent"] == root["span_id"] and s["name"].endswith("ModelStep"))
    spans = wait_for(collector, trace_id, {daemon_span, "blockd.v1.KVShardService/ModelStep", "model_forward",
                                            "write_kv", "attention", "sampling"})
    by_id = {s["span_id"]: s for s in spans}
    daemon = [s for s in spans if s["name"] == daemon_span]
    assert len(daemon) == 1 and daemon[0]["service"] == "blockd"
    # a streamed step's span hangs under the scheduler's step; a unary one under its CLIENT span
    daemon_parent = root if daemon_span.endswith("StepStream") else next(
        s for s in mine if s["name"] == "blockd.v1.BlockService/Step" and s["parent"] == root["span_id"])
    assert daemon[0]["parent"] == daemon_parent["span_id"]
    served = [s for s in spans if s["name"] == "blockd.v1.KVShardService/ModelStep"]
    assert len(served) == 1 and served[0]["service"] == "blockd-worker"
    assert served[0]["parent"] == model_call["span_id"]
    forward = next(s for s in spans if s["name"] == "model_forward")
    assert forward["parent"] == served[0]["span_id"]
    layers = [s for s in spans if s["name"] in ("write_kv", "attention") and s["parent"] == forward["span_id"]]
    # tiny-llama has 2 layers: K/V written and attended in each (plus the written-slot record's write_kv)
    assert sum(s["name"] == "attention" for s in layers) == 2
    assert sum(s["name"] == "write_kv" for s in layers) >= 2
    sampling = next(s for s in spans if s["name"] == "sampling")
    assert sampling["parent"] == served[0]["span_id"]
    assert all(by_id.get(s["parent"]) is not None or s["parent"] in {x["span_id"] for x in mine}
               for s in spans), "every remote span's parent is a span of this trace"


def test_one_step_is_one_trace_across_scheduler_blockd_and_worker(collector, in_memory, monkeypatch):
    # imported here: the scheduler and the model group need the worker's extras
    from client.model_group import WorkerGroup
    from client.scheduler import Scheduler, SchedulerConfig
    from client.sdk import BlockdClient
    from client.serving import GenerationRequest

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the children export within 0.1 s
    with LocalCluster(ClusterSpec(num_blocks=32, block_size=4)) as cluster, \
            BlockdClient(cluster.blockd_address) as client, WorkerGroup("model", cluster.worker_addresses) as group:
        for stream_steps, daemon_span in ((True, "blockd.v1.BlockService/StepStream"),
                                          (False, "blockd.v1.BlockService/Step")):
            in_memory.clear()
            sched = Scheduler(client, "model", group, SchedulerConfig(64, 8, stream_steps=stream_steps))
            sched.add_request(GenerationRequest(f"r-{stream_steps}", list(range(1, 7)), 3))
            assert [o.request_id for o in sched.run()] == [f"r-{stream_steps}"]
            mine = [local(s) for s in in_memory.get_finished_spans()]
            steps = [s for s in mine if s["name"] == "scheduler.step"]
            assert len(steps) >= 3 and len({s["trace_id"] for s in steps}) == len(steps), "a trace per step"
            check_step_trace(steps, mine, collector, daemon_span)


def test_tracing_is_off_unless_an_exporter_is_asked_for():
    assert tracing.settings_from_env({}) is None
    assert tracing.settings_from_env({"OTEL_SERVICE_NAME": "x"}) is None
    assert tracing.settings_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == ("otlp", "http://c:4317")
    assert tracing.settings_from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://c"}) == ("otlp", "https://c")
    assert tracing.settings_from_env({"OTEL_TRACES_EXPORTER": "otlp"}) == ("otlp", tracing.DEFAULT_OTLP_ENDPOINT)
    assert tracing.settings_from_env({"OTEL_TRACES_EXPORTER": "console"})[0] == "console"
    for off in ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"},
                {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}):
        assert tracing.settings_from_env(off) is None
    for bad, match in (({"OTEL_TRACES_EXPORTER": "zipkin"}, "not one of otlp"),
                       ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}, "not a URL"),
                       ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:port"}, "not a URL"),
                       ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                         "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "over gRPC only")):
        with pytest.raises(tracing.TracingConfigError, match=match):
            tracing.settings_from_env(bad)
    # off: nothing wraps a channel or a server, and the hooks are shared no-ops
    assert tracing.tracer is None
    channel = grpc.insecure_channel("127.0.0.1:1")
    assert trace_grpc.intercept(channel) is channel
    assert trace_grpc.server_interceptors() == []
    assert tracing.span("x") is tracing.server_span("y", "00-ab-cd-01") is tracing._OFF
    assert tracing.traceparent() == ""
    channel.close()


@pytest.mark.parametrize(("args", "code", "says"), [
    (["blockd.cli", "serve", "--listen", "127.0.0.1:0"], 2, "cannot serve: OTLP endpoint"),
    (["worker.main", "--blockd", "127.0.0.1:1", "--pool", "p"], 1, "blockd-worker: OTLP endpoint")])
def test_a_malformed_otlp_endpoint_stops_a_program_with_one_line(args, code, says):
    env = child_env(OTEL_EXPORTER_OTLP_ENDPOINT="collector:4317")
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == code, done.stderr
    assert f"{says} 'collector:4317' is not a URL" in done.stderr
    assert "Traceback" not in done.stderr


def test_asking_for_tracing_without_the_extra_says_what_to_install(monkeypatch):
    monkeypatch.setattr(tracing, "_decided", False)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.resources", None)  # as if not installed
    with pytest.raises(tracing.TracingConfigError, match=r"pip install 'blockd\[otel\]'"):
        tracing.set_up("blockd", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"})
    assert tracing.tracer is None
    assert tracing.set_up("blockd", {}) is False  # nothing asked for: off, and nothing imported
