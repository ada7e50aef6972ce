#!/usr/bin/env bash
# Serving benchmark: a server per algorithm (none, EAGLE3, ECOSPEC), sglang.bench_serving
# against each at several concurrencies, one table (docs/sglang.md, "Serving benchmark").
#
#   bash scripts/bench_serving.sh [--model-path M --draft-model-path D] [--concurrency 1,4]
#                                 [--algorithms none,eagle3,ecospec-confidence,ecospec] ...
#
# Without a GPU the servers run in the CPU development mode on the small testbed. Uses the
# project's .venv when present (bash scripts/setup_env.sh), else `python` on PATH (e.g. the
# Docker image).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=python
[ -x "$root/.venv/bin/python" ] && python=$root/.venv/bin/python
exec "$python" -m sgl_ecospec.lab.serving.bench_serving "$@"
