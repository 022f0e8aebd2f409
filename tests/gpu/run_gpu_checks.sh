#!/usr/bin/env bash
# The GPU checks, in one go, on the lent GPU machine (repo root as the working directory):
#   bash tests/gpu/run_gpu_checks.sh
# Writes env.txt, pytest.txt, junit.xml and bench.txt under $OUT (default /tmp/chassis-gpu).
# Exit status: pytest's.
set -u
OUT="${OUT:-/tmp/chassis-gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"

# `chassis` is the repository root; install it editable, or else expose it by a symlink.
if ! "$PY" -m pip install --no-deps --no-build-isolation -q -e . >"$OUT/install.txt" 2>&1; then
    mkdir -p /tmp/chassis-path && ln -sfn "$PWD" /tmp/chassis-path/chassis
    export PYTHONPATH="/tmp/chassis-path${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'hip', torch.version.hip)"
} >"$OUT/env.txt" 2>&1

timeout 300 "$PY" -m pytest -m gpu tests/gpu -q -rfEs -p no:cacheprovider \
    --junitxml="$OUT/junit.xml" >"$OUT/pytest.txt" 2>&1
rc=$?
tail -n 30 "$OUT/pytest.txt"

timeout 90 "$PY" tests/gpu/bench_triton_attention.py >"$OUT/bench.txt" 2>&1
cat "$OUT/bench.txt"
exit $rc
