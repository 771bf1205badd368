"""The allocator core must stay free of gRPC, torch and metrics code, and its
modules must import one another in one direction only."""

import ast
import subprocess
import sys
from pathlib import Path

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


def test_a_block_hashes_the_same_where_array_is_not_a_little_endian_uint32(monkeypatch):
    """hash_block packs token ids with array("I") where that is a little-endian
    uint32 and with struct elsewhere: both give the same hashes (the served
    spec's vectors check the array path against an independent struct one)."""
    from blockd.core import hashing

    tokens, extra = list(range(2**32 - 16, 2**32)), hashing.ExtraKeys(model_id="m").digest()
    fast = [hashing.hash_block(parent, tokens, extra) for parent in (None, b"p" * 16)]
    monkeypatch.setattr(hashing, "_ARRAY_IS_LE_U32", False)
    assert [hashing.hash_block(parent, tokens, extra) for parent in (None, b"p" * 16)] == fast


#: the core's modules, lowest first; a module imports only from layers below its own
CORE_LAYERS = [
    {"errors", "arith", "lru", "terms"},
    {"hashing", "incarnations"},
    {"types"},
    {"validate", "sequence"},
    {"blocks"},
    {"batch"},
    {"decode"},
    {"ops"},
    {"pool"},
    {"invariants", "state"},
    {"__init__"},
]


def _core_imports(path: Path) -> set[str]:
    """Every blockd.core module ``path`` imports, wherever the import sits
    (``TYPE_CHECKING`` blocks and function bodies count too)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            if name.startswith("blockd.core."):
                found.add(name.split(".")[2])
            elif name == "blockd.core" and isinstance(node, ast.ImportFrom):
                found.update(a.name for a in node.names)
    return found


def test_core_modules_import_one_way():
    """The core's imports run downward (types/errors/arith -> blocks/sequence ->
    batch -> decode/ops -> pool), so no two modules import each other."""
    core = Path(ROOT) / "blockd" / "core"
    rank = {name: i for i, layer in enumerate(CORE_LAYERS) for name in layer}
    assert set(rank) == {p.stem for p in core.glob("*.py")}, "add the new module to CORE_LAYERS"
    upward = [f"{path.stem} imports {name}" for path in sorted(core.glob("*.py"))
              for name in sorted(_core_imports(path)) if rank[name] >= rank[path.stem]]
    assert upward == []
