#!/usr/bin/env bash
# Installs sgl-ecospec (the package, its extension sgl_ecospec._C and the SGLang plugin entry
# point) into a Python environment that already has the pinned sglang, keeping that
# environment's sglang, torch and CUDA toolkit: no dependency is installed or upgraded.
#
# The Dockerfile runs it inside lmsysorg/sglang (system python3, SGL_ECOSPEC_CUDA=1: CUDA
# kernels are required). test/deploy/test_deploy.py runs the same steps outside Docker on a copy of
# the build context, CPU-only and with --target, so CI executes every step of the image build.
#
# Usage: bash scripts/docker_install.sh [--target DIR]
#   --target DIR      install into DIR (pip --target) instead of the interpreter's site-packages
# Environment:
#   PYTHON            interpreter that has sglang (default: python3)
#   SGL_ECOSPEC_CUDA  0, 1 or auto, as in setup.py (default here: 1)
#   MAX_JOBS          parallel compile jobs (ninja)
set -euo pipefail

target=""
while [ $# -gt 0 ]; do
  case "$1" in
    --target)
      [ $# -ge 2 ] || { echo "[docker_install] error: --target needs a directory" >&2; exit 2; }
      target=$(realpath -m "$2")
      shift 2
      ;;
    *)
      echo "[docker_install] error: unknown argument $1 (usage: $0 [--target DIR])" >&2
      exit 2
      ;;
  esac
done

cd "$(dirname "$0")/.."
source_root=$(pwd)
python_bin=${PYTHON:-python3}
export SGL_ECOSPEC_CUDA=${SGL_ECOSPEC_CUDA:-1}
# The image's nvcc may be reached through a wrapper; torch then guesses the wrong CUDA_HOME.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi

# 1. The environment must be the one the project is pinned to: a plugin built against another
#    sglang may hook functions that moved.
pinned_sglang=$(sed -n 's/^sglang==\([^ #]*\).*/\1/p' requirements.txt)
[ -n "$pinned_sglang" ] || { echo "[docker_install] error: no sglang== pin in requirements.txt" >&2; exit 1; }
"$python_bin" - "$pinned_sglang" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

pinned = sys.argv[1]
try:
    found = version("sglang")
except PackageNotFoundError:
    sys.exit(f"[docker_install] error: {sys.executable} has no sglang (need sglang=={pinned})")
if found != pinned:
    sys.exit(f"[docker_install] error: {sys.executable} has sglang {found}, requirements.txt pins {pinned}")
import setuptools  # noqa: F401  (--no-build-isolation builds with the environment's own)
import torch

print(f"[docker_install] {sys.executable}: sglang {found}, torch {torch.__version__} (CUDA {torch.version.cuda})")
EOF

# 2. Build and install. --no-deps and --no-build-isolation keep the environment's sglang and
#    torch (the extension must be compiled against the torch it will load with).
#    PIP_BREAK_SYSTEM_PACKAGES: the image's interpreter is a system Python, which pip refuses
#    to modify where the distribution marks it externally managed (PEP 668); in a venv or with
#    --target the variable has no effect.
pip_args=(install --no-deps --no-build-isolation --no-cache-dir --progress-bar off)
[ -z "$target" ] || pip_args+=(--target "$target")
build_outputs=()
for path in build sgl_ecospec.egg-info; do [ -e "$path" ] || build_outputs+=("$path"); done
echo "[docker_install] building sgl_ecospec._C (SGL_ECOSPEC_CUDA=$SGL_ECOSPEC_CUDA)"
PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore "$python_bin" -m pip "${pip_args[@]}" .
# pip builds in the source tree; these outputs are not needed at run time (image size).
[ ${#build_outputs[@]} -eq 0 ] || rm -rf "${build_outputs[@]}"

# 3. What SGLang's load_plugins() does in every server process: the entry point resolves to
#    sglang_ecospec:register, which registers ECOSPEC; the extension has the kernels the build
#    promised. load_plugins() itself only logs a failing plugin, so the calls are made here.
#    It runs outside the source tree, which would otherwise shadow the installed packages.
export SGL_ECOSPEC_SOURCE_ROOT=$source_root SGL_ECOSPEC_INSTALL_TARGET=$target
[ -z "$target" ] || export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
cd /
"$python_bin" - <<'EOF'
import os
import sys
from importlib.metadata import entry_points

import torch

plugins = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "ecospec"]
if len(plugins) != 1 or plugins[0].value != "sglang_ecospec:register":
    sys.exit(f"[docker_install] error: entry point sglang.srt.plugins:ecospec is {plugins}")
plugins[0].load()()

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

import sgl_ecospec
import sglang_ecospec
from sgl_ecospec.ops.native import NATIVE_ERROR, has_native_kernel

algorithm = SpeculativeAlgorithm.from_string("ECOSPEC")
if not algorithm.is_eagle3():
    sys.exit(f"[docker_install] error: ECOSPEC resolved to {algorithm!r}, not an EAGLE3 variant")
if NATIVE_ERROR is not None:
    sys.exit(f"[docker_install] error: sgl_ecospec._C does not load: {NATIVE_ERROR}")
backends = ["CPU"] + (["CUDA"] if os.environ["SGL_ECOSPEC_CUDA"] == "1" else [])
for backend in backends:
    device = torch.device("cuda" if backend == "CUDA" else "cpu")
    if not has_native_kernel("select_verify_set", device):
        sys.exit(f"[docker_install] error: sgl_ecospec._C has no {backend} kernels")
source_root = os.environ["SGL_ECOSPEC_SOURCE_ROOT"] + os.sep
target = os.environ["SGL_ECOSPEC_INSTALL_TARGET"]
for module in (sgl_ecospec, sglang_ecospec):
    path = module.__file__
    if path.startswith(source_root) or (target and not path.startswith(target + os.sep)):
        sys.exit(f"[docker_install] error: {module.__name__} loaded from {path}, not the install")
print(
    f"[docker_install] ok: plugin ecospec -> {algorithm!r}, sgl_ecospec._C kernels "
    f"{'+'.join(backends)}, from {os.path.dirname(sgl_ecospec.__file__)}"
)
EOF
