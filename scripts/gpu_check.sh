#!/usr/bin/env bash
# The GPU check: on one CUDA GPU with PyTorch, Triton and transformers installed (no network, no
# install: the repository's sources are used in place), in at most 8 minutes on an H100:
#
#     scripts/gpu_check.sh OUTDIR          (or: make gpu-check OUT=OUTDIR)
#
#   1. the CUDA test cases (pytest -m gpu: the fused Triton kernel against the reference, compiled
#      decoding with CUDA graphs, bf16 training, the module's Triton backend), at most 150 s;
#   2. diff-transformer bench gpu (correctness of every backend, the attention and model
#      benchmarks) with a time budget of 180 s, stopped at 300 s.
#
# Writes into OUTDIR: nvidia-smi.txt, versions.txt, pytest.xml (JUnit), pytest.log, bench/
# (gpu_bench.json, gpu_bench.md), bench.log and summary.txt (each step's exit status and
# seconds). Exit status: 0 when every step passed, 1 when one failed or ran out of time, 2 (one
# 'error:' line, nothing written) without CUDA or without an OUTDIR. PYTHON (default python3)
# picks the interpreter.
set -u

PYTHON=${PYTHON:-python3}
TESTS_SECONDS=150       # the whole pytest step
TEST_SECONDS=120        # one test (pytest-timeout, where installed)
BENCH_BUDGET=180        # bench gpu starts no new phase after this
BENCH_SECONDS=300       # the whole bench step

if [ $# -ne 1 ] || [ -z "$1" ]; then
    echo "error: usage: scripts/gpu_check.sh OUTDIR" >&2
    exit 2
fi
out=$1
if [ -e "$out" ] && [ ! -d "$out" ]; then
    echo "error: $out is a file; give a directory for the results" >&2
    exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
problem=$("$PYTHON" -c '
import torch
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees no CUDA device: torch.cuda.is_available() is False")
' 2>&1 | tail -n 1)
if [ -n "$problem" ]; then
    echo "error: the GPU check needs a CUDA GPU ($problem)" >&2
    exit 2
fi

mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
cd "$repo" || exit 2
status=0
: > "$out/summary.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log its status and duration
    local name=$1 limit=$2 start code
    shift 2
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    code=$?
    if [ $code -eq 124 ] || [ $code -eq 137 ]; then
        echo "$name: stopped after ${limit} s (exit $code)" >> "$out/summary.txt"
    else
        echo "$name: exit $code" >> "$out/summary.txt"
    fi
    echo "$name: $(( $(date +%s) - start )) s" >> "$out/summary.txt"
    [ $code -eq 0 ] || status=1
}

timeout 30 nvidia-smi > "$out/nvidia-smi.txt" 2>&1
"$PYTHON" - > "$out/versions.txt" 2>&1 <<'EOF'
import importlib, platform, subprocess
import torch
print("python", platform.python_version())
print("torch", torch.__version__, "CUDA", torch.version.cuda, "device", torch.cuda.get_device_name(0))
for name in ("triton", "transformers", "pytest", "xdist", "pytest_timeout", "safetensors", "tokenizers", "numpy"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "installed"))
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here
        print(name, "missing:", type(exc).__name__, exc)
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
print("commit", commit or "unknown (not a git checkout)")
EOF

pytest_options=(-q -m gpu --junitxml="$out/pytest.xml" --continue-on-collection-errors -p no:cacheprovider)
if "$PYTHON" -c "import xdist" 2>/dev/null; then
    pytest_options+=(-n 4)  # Triton compiles on the CPU cores: four at a time
fi
if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then
    pytest_options+=(--timeout "$TEST_SECONDS")
fi
step pytest "$TESTS_SECONDS" "$PYTHON" -m pytest "${pytest_options[@]}" tests
step bench "$BENCH_SECONDS" "$PYTHON" -m diff_transformer bench gpu --out "$out/bench" --time-budget "$BENCH_BUDGET"

cat "$out/summary.txt"
exit $status
