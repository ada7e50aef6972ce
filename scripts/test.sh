#!/usr/bin/env bash
# The test command: sets up .venv, then lint (ruff, hadolint) and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
echo "[test] ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "[test] hadolint"
.venv/bin/hadolint Dockerfile
echo "[test] pytest"
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
