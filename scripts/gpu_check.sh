#!/usr/bin/env bash
# The device check, one prepared run of at most 9 minutes on the lent GPU (torch + Triton in
# python3, nvcc, compute-sanitizer; no SGLang, no network). Stages, in order, each under its
# own timeout (together 540 s), none stopping the others, each writing its JSON to the
# output folder as it goes; summary.md is rewritten after every stage:
#   env          the machine, versions, tools                     -> env.json
#   build        the extension with CUDA, -lineinfo -Xptxas -v    -> build.log
#   correctness  GPU ops against the C++ CPU op, each call twice  -> correctness.json
#   sanitizer    compute-sanitizer memcheck, racecheck, synccheck -> sanitizer.json
#   selection    select_verify_set at B = 1..128, eager and graph -> selection.json
#   moe          verify_moe by graph replay at serving shapes     -> moe.json
#   probe        verify_moe past 2^31 weight elements             -> probe.json
# Usage:
#   OUT=DIR bash scripts/gpu_check.sh                 on the GPU machine (default results/gpu)
#   STAGES="moe probe" bash scripts/gpu_check.sh      rerun a part
#   bash scripts/gpu_check.sh --cpu-dry-run DIR       every stage at tiny shapes on the CPU
#                                                     (CUDA emulation, Triton interpreter)
# Exits 0 when every stage run passed.
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0
if [ "${1:-}" = "--cpu-dry-run" ]; then
  dry=1
  out=${2:?usage: bash scripts/gpu_check.sh --cpu-dry-run DIR}
  export TRITON_INTERPRET=1
  python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
elif [ $# -gt 0 ]; then
  echo "usage: [OUT=DIR] [STAGES=...] bash scripts/gpu_check.sh [--cpu-dry-run DIR]" >&2
  exit 2
else
  out=${OUT:-results/gpu}
  python=${PYTHON:-python3}
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
declare -A limit=([env]=15 [build]=150 [correctness]=100 [sanitizer]=100 [selection]=70 [moe]=75 [probe]=30)
all="env build correctness sanitizer selection moe probe"
stages=${STAGES:-$all}
for stage in $stages; do
  [ -n "${limit[$stage]:-}" ] || { echo "unknown stage $stage; stages: $all" >&2; exit 2; }
done
flag=$([ $dry = 1 ] && echo --dry-run || true)

build() {
  if [ $dry = 1 ]; then
    # The whole extension takes minutes on 2 cores: ptxas's report of the selection kernel
    # alone, and the CPU build that setup_env.sh made.
    if command -v nvcc >/dev/null; then
      nvcc -c -std=c++20 -O3 -gencode=arch=compute_90,code=sm_90 -Xptxas -v -Icsrc \
        scripts/gpu_check/kernel_probe.cu -o "$work/kernel_probe.o" || return 1
    else
      echo "nvcc not found: no ptxas report"
    fi
    "$python" -c 'import sgl_ecospec; assert sgl_ecospec.has_native(), "no sgl_ecospec._C"'
  else
    SGL_ECOSPEC_CUDA=1 SGL_ECOSPEC_NVCC_FLAGS="-lineinfo -Xptxas -v" MAX_JOBS=$(nproc) \
      "$python" setup.py build_ext --inplace
  fi
}

failed=0
for stage in $all; do
  case " $stages " in *" $stage "*) ;; *) continue ;; esac
  echo "[gpu_check] $stage (limit ${limit[$stage]} s)"
  start=$(date +%s)
  log=$work/$stage.log
  if [ "$stage" = build ]; then
    export -f build
    export dry work python
    timeout -k 5 "${limit[build]}" bash -c build 2>&1 | tee "$out/build.log"
  else
    script=scripts/gpu_check/$stage.py
    [ "$stage" = selection ] && script=scripts/gpu_check/selection_timing.py
    [ "$stage" = moe ] && script=scripts/gpu_check/moe_timing.py
    GPU_CHECK_STAGE_SECONDS=${limit[$stage]} timeout -k 5 "${limit[$stage]}" \
      "$python" "$script" --out "$out" $flag 2>&1 | tee "$log"
  fi
  rc=${PIPESTATUS[0]}
  [ "$stage" = build ] && cp "$out/build.log" "$log"
  case $rc in
    0) status=passed ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  [ $rc = 0 ] || failed=1
  echo "$stage $status $(($(date +%s) - start)) ${limit[$stage]}" >>"$work/status.tsv"
  "$python" scripts/gpu_check/summary.py --out "$out" --status "$work/status.tsv" --logs "$work" \
    || echo "[gpu_check] could not write summary.md"
  echo "[gpu_check] $stage: $status"
done
echo "[gpu_check] summary: $out/summary.md"
exit $failed
