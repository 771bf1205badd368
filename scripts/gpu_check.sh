#!/usr/bin/env bash
# The CUDA path's check, for a machine with an NVIDIA GPU: installs what it
# needs (flashinfer-python, pytest, ninja; a CUDA build of torch must already
# be there, or pip's default Linux wheel is taken), runs every CUDA test
# (the "cuda" device and "flashinfer" backend cases of tests/worker/: the kernels
# and FlashInfer against the dense reference, the pinned host tier's offload and
# restore, the CUDA IPC pool, the model runner on the GPU against transformers)
# and the GPU benchmarks (paged vs
# contiguous attention, achieved HBM bandwidth), and prints one JSON object per
# line for each result. Each step has its own time limit; the whole run stays
# under 10 minutes. Exit status: 0 when every test passed.
#
#   scripts/gpu_check.sh                 # python3 from PATH
#   PYTHON=/path/to/python scripts/gpu_check.sh
#   WHEELS=DIR scripts/gpu_check.sh      # no network: install DIR/*.whl (--no-deps) into a
#                                        # private folder put first on PYTHONPATH instead
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

line() {  # line key=value ... -> one JSON object
    "$PY" -c 'import json, sys; print(json.dumps(dict(a.split("=", 1) for a in sys.argv[1:])))' "$@"
}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >"$OUT/gpus" 2>&1; then
    line name=gpu_check step=gpu ok=false "error=no NVIDIA GPU (nvidia-smi failed)"
    exit 1
fi
line name=gpu_check step=gpu ok=true "gpu=$(head -1 "$OUT/gpus")"

# Install (bounded): what is already installed is kept. With WHEELS, from that folder only
# (a machine with no network: the project's own dependencies at the versions it needs).
if [ -n "${WHEELS:-}" ]; then
    # kept after the run, not under $OUT: FlashInfer's JIT cache (~/.cache/flashinfer) records
    # the include paths of the install it compiled against, and a later run whose install was
    # removed fails to rebuild there ("tvm/ffi/container/array.h: No such file")
    SITE="${GPU_CHECK_SITE:-$HOME/.cache/blockd-gpu-check/site}"
    install=("$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl)
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    install=("$PY" -m pip install -q flashinfer-python pytest pytest-timeout ninja)
fi
if timeout 240 "${install[@]}" >"$OUT/pip" 2>&1; then
    line name=gpu_check step=install ok=true
else
    line name=gpu_check step=install ok=false "error=$(tail -c 400 "$OUT/pip" | tr '\n' ' ')"
fi
"$PY" - <<'EOF'
import json
import torch
info = {"name": "gpu_check", "step": "versions", "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
try:
    import flashinfer
    info["flashinfer"] = getattr(flashinfer, "__version__", "?")
except Exception as err:  # noqa: BLE001
    info["flashinfer_error"] = f"{type(err).__name__}: {err}"[:300]
print(json.dumps(info))
EOF

# Every CUDA test: one JSON line per test from pytest's JUnit report.
timeout 300 "$PY" -m pytest tests/worker/test_kernels.py tests/worker/test_host_tier.py tests/worker/test_ipc.py \
    tests/worker/test_model_runner.py -k "cuda or flashinfer" -o addopts="" -q -p no:cacheprovider \
    --junitxml="$OUT/junit.xml" >"$OUT/pytest" 2>&1
status=$?
"$PY" - "$OUT/junit.xml" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
try:
    cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
except (OSError, ET.ParseError) as err:
    print(json.dumps({"name": "test", "outcome": "error", "message": f"no JUnit report: {err}"}))
    sys.exit(0)
for case in cases:
    outcome, message = "passed", ""
    for kind in ("failure", "error", "skipped"):
        node = case.find(kind)
        if node is not None:
            outcome, message = ("skipped" if kind == "skipped" else "failed"), (node.get("message") or "")[:300]
    print(json.dumps({"name": "test", "test": case.get("name"), "outcome": outcome, "message": message}))
EOF
line name=gpu_check step=tests "pytest_exit=$status" "summary=$(tail -1 "$OUT/pytest")"
[ "$status" = 0 ] || grep -E "^(E |FAILED|ERROR)" "$OUT/pytest" | head -60

# GPU benchmarks: HBM bandwidth probe, paged (FlashInfer) vs contiguous SDPA and vs the torch kernels.
# On a machine whose FlashInfer JIT cache is cold, compiling the prefill kernels takes most of
# this limit (exit 124: the rows printed before it stand).
timeout 240 "$PY" bench/attention.py --device cuda --rounds 5 2>"$OUT/bench"
bench=$?
[ "$bench" = 0 ] || line name=gpu_check step=bench ok=false "exit=$bench" "error=$(tail -c 400 "$OUT/bench" | tr '\n' ' ')"
exit "$status"
