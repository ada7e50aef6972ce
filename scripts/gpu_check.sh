#!/usr/bin/env bash
# The device check (GPU machine: torch + Triton in python3, no SGLang, no network): builds
# the extension with its CUDA ops, runs the GPU tests against the references, and times
# the ops and checks them in CUDA graphs (scripts/gpu_bench.py, with gpu_bench_selection.py
# and gpu_graph_check.py). Results go to $OUT (default results/gpu) and, as a table, to
# docs/results/h200.md. Finishes in about 5 minutes on an H200 (budget: 8); each step has a
# timeout, so a hung kernel fails the check instead of holding the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results/gpu}
mkdir -p "$out" docs/results
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"

echo "[gpu_check] building sgl_ecospec._C with CUDA (sm_90)"
SGL_ECOSPEC_CUDA=1 python3 setup.py -q build_ext --inplace 2>&1 | tail -5

echo "[gpu_check] GPU tests against the references"
timeout 270 python3 -m pytest -q -p no:cacheprovider -x test/ops/test_cuda_ops.py \
  test/ops/test_verify_moe.py test/ops/test_bitmaps.py test/ops/test_selection.py \
  test/ops/test_launcher_checks.py test/predictors/test_online_predictor.py \
  -k "not organize_draft_results" 2>&1 | tee "$out/tests.txt" | tail -5

echo "[gpu_check] timings"
timeout 180 python3 scripts/gpu_bench.py --out "$out"
cp "$out/h200.md" docs/results/h200.md
