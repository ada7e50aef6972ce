#!/usr/bin/env bash
# Creates or updates the project environment at .venv/ (pins: requirements.txt) and builds
# the extension sgl_ecospec._C. Idempotent: a second run only checks two hashes.
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin=${PYTHON:-python3.11}
command -v "$python_bin" >/dev/null || python_bin=python3
if ! "$python_bin" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "[setup] error: need Python 3.11 (sglang==0.5.23 wheels); $python_bin is $("$python_bin" --version)." >&2
  echo "[setup] set PYTHON=/path/to/python3.11 and run again." >&2
  exit 1
fi
[ -x .venv/bin/python ] || { echo "[setup] creating .venv"; "$python_bin" -m venv .venv; }

requirements_hash=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat .venv/.requirements.sha256 2>/dev/null)" != "$requirements_hash" ]; then
  # pip fails half-way with a bare "No space left on device" otherwise.
  free_gb=$(($(df -Pk . | awk 'NR == 2 {print $4}') / 1024 / 1024))
  if [ "$free_gb" -lt 12 ]; then
    echo "[setup] error: installing needs about 12 GB free on the disk of $PWD; it has ${free_gb} GB." >&2
    echo "[setup] free some space (old clones' .venv/, ~/.cache/pip) and run again." >&2
    exit 1
  fi
  echo "[setup] installing requirements.txt (first run: about 4 minutes and 11 GB)"
  .venv/bin/python -m pip install --quiet --upgrade pip
  grep -v -- '# no-deps' requirements.txt >.venv/requirements-deps.txt
  grep -- '# no-deps' requirements.txt | sed 's/#.*//' >.venv/requirements-nodeps.txt
  .venv/bin/python -m pip install --quiet --progress-bar off -r .venv/requirements-deps.txt
  .venv/bin/python -m pip install --quiet --progress-bar off --no-deps -r .venv/requirements-nodeps.txt
  echo "$requirements_hash" >.venv/.requirements.sha256
fi

# nvcc on PATH may be a wrapper outside the toolkit; torch then guesses the wrong CUDA_HOME.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
build_hash=$(cat setup.py pyproject.toml requirements.txt csrc/* | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/.build.sha256 2>/dev/null)" != "$build_hash" ] \
  || ! .venv/bin/python -c 'import torch, sgl_ecospec._C' 2>/dev/null; then
  echo "[setup] building sgl_ecospec._C (about 2 minutes with CUDA sources)"
  .venv/bin/python -m pip install --quiet --no-build-isolation --no-deps -e .
  echo "$build_hash" >.venv/.build.sha256
fi
# The CPU development mode of the SGLang server (docs/sglang.md); a no-op on a GPU machine.
bash scripts/build_cpu_dev.sh
echo "[setup] .venv ready: $(.venv/bin/python -c 'import torch, sgl_ecospec as s; print("torch", torch.__version__, "| sgl_ecospec._C:", s.has_native())')"
