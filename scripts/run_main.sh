#!/usr/bin/env bash
# The main job on its embedded default: builds the testbed (MoE target + EAGLE-3 draft,
# cached under ~/.cache/sgl-ecospec) and benchmarks EAGLE-3 confidence selection against
# EcoSpec on MT-Bench and HumanEval prompts at batch 1 (the EcoSpec paper's setting),
# lossless-checked against greedy decoding. --reproducible pins the CPU float numerics, so
# the table is bit-identical to docs/RESULTS.md's on any x86-64 machine with AVX2.
# Table on stdout; JSON and plot under results/. Extra arguments go to `sgl-ecospec bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
mkdir -p results
exec .venv/bin/sgl-ecospec bench --dataset mt-bench,humaneval --num-prompts 4 \
  --max-new-tokens 48 --batch-size 1 --topk 4 --steps 3 --budget 4 --budgets 1,2,4 \
  --policy confidence,ecospec --check-lossless \
  --profile qwen3-235b-a22b --hardware h200 \
  --reproducible --json results/bench.json --plot results/bench_experts.png "$@"
