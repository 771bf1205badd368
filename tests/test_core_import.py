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


def test_block_hashes_are_stable_across_processes():
    """No Python hash() or per-process salt: another interpreter (with a different
    PYTHONHASHSEED) computes the same chained hashes, so restarts and routers agree."""
    from blockd.core import ExtraKeys, hash_full_blocks

    extra = ExtraKeys(model_id="m", model_revision="r1", adapter_name="a", adapter_id=7, cache_salt="t",
                      mm_hashes=("img0",))
    here = [h.hex() for h in hash_full_blocks(list(range(40)), 16, extra.digest())]
    code = (
        "from blockd.core import ExtraKeys, hash_full_blocks;"
        "e = ExtraKeys(model_id='m', model_revision='r1', adapter_name='a', adapter_id=7, cache_salt='t',"
        " mm_hashes=('img0',));"
        "print(' '.join(h.hex() for h in hash_full_blocks(list(range(40)), 16, e.digest())))"
    )
    for seed in ("1", "12345"):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": ""})
        assert out.stdout.split() == here
    assert len(here) == 2 and len(set(here)) == 2
