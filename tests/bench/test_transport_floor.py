"""``bench/rpc.py --part transport_floor``: each transport's echo server in a
child process, the decode step's real bytes both ways, the server's CPU per
message from ``/proc``, and the gRPC rows' ratio against the framed socket."""

from __future__ import annotations

import json
import subprocess
import sys

from bench import transport_floor
from blockd.v1 import blockd_pb2 as pb
from tests.conftest import ROOT


def test_the_payloads_are_the_real_decode_step():
    request, response = transport_floor.step_payloads()
    parsed = pb.StepRequest.FromString(request)
    assert parsed.pool == "decode-0" and len(parsed.ops) == 1
    assert len(pb.StepResponse.FromString(response).results) == 1


def test_every_transport_echoes_and_is_measured():
    out = subprocess.run([sys.executable, "bench/rpc.py", "--part", "transport_floor", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["transport"] for r in rows] == ["socket_frames", "grpc_sync_stream", "grpc_aio_stream"]
    request, response = transport_floor.step_payloads()
    for row in rows:
        assert row["messages"] == transport_floor.MESSAGES // 5
        assert (row["request_bytes"], row["response_bytes"]) == (len(request), len(response))
        assert 0 < row["server_cpu_us_per_message"] < 1e5 and row["wall_us_per_round_trip"] > 0
    assert all(r["ratio_cpu_vs_socket"] > 0 for r in rows[1:])
