#!/usr/bin/env bash
# Builds the CPU development mode's stub libcuda.so.1 into .venv/lib/sgl_ecospec_stub/ from
# python/sglang_ecospec_cpu/stub_libcuda.c (see docs/sglang.md, "CPU development mode").
# Idempotent: rebuilds only when the source changed. Skipped on a machine with an NVIDIA GPU,
# where the real driver must be used. Usage: bash scripts/build_cpu_dev.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${1:-.venv}
src=python/sglang_ecospec_cpu/stub_libcuda.c
out_dir=$venv/lib/sgl_ecospec_stub
out=$out_dir/libcuda.so.1

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[build_cpu_dev] a GPU is present: no stub libcuda (the real driver is used)"
  exit 0
fi
[ -d "$venv" ] || { echo "[build_cpu_dev] error: no virtual environment at $venv" >&2; exit 1; }
cc=${CC:-gcc}
command -v "$cc" >/dev/null || { echo "[build_cpu_dev] error: need a C compiler ($cc)" >&2; exit 1; }

src_hash=$(sha256sum "$src" | cut -d' ' -f1)
if [ -f "$out" ] && [ "$(cat "$out_dir/.source.sha256" 2>/dev/null)" = "$src_hash" ]; then
  echo "[build_cpu_dev] $out is up to date"
  exit 0
fi
mkdir -p "$out_dir"
"$cc" -shared -fPIC -O2 -Wall -Wl,-soname,libcuda.so.1 -o "$out.tmp" "$src"
mv "$out.tmp" "$out"
ln -sf libcuda.so.1 "$out_dir/libcuda.so"
echo "$src_hash" >"$out_dir/.source.sha256"
echo "[build_cpu_dev] built $out"
