"""The allocator core must stay free of gRPC, torch and metrics code."""

import subprocess
import sys

from tests.conftest import ROOT


def test_core_imports_no_grpc_torch_or_prometheus():
    code = (
        "import sys, blockd.core, blockd.core.state;"
        "bad = [m for m in ('grpc', 'torch', 'prometheus_client', 'google.protobuf') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"core pulled in {out.stdout.strip()}"
