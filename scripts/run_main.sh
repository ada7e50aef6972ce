#!/usr/bin/env bash
# The main job on its embedded default: the MoESD cost-model report for Qwen3-235B-A22B on
# H200 (table on stdout, JSON and plot under results/). Extra arguments go to the command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
mkdir -p results
exec .venv/bin/sgl-ecospec costmodel --model qwen3-235b-a22b --hardware h200 \
  --batch 1,8,32,64 --gamma 1,2,4,8 --accept-rate 0.7 \
  --json results/costmodel.json --plot results/costmodel.png "$@"
