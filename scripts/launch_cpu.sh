#!/usr/bin/env bash
# CPU development mode: runs the real SGLang server on a machine without a GPU.
#
#   bash scripts/launch_cpu.sh --model-path M [SGLang server args...]
#
# Sets up what sglang 0.5.23's CUDA wheels need to serve on the CPU (docs/sglang.md, "CPU
# development mode"), then execs `python -m sglang.launch_server --device cpu ARGS...` from
# the project's .venv (override with ECOSPEC_CPU_VENV):
#   - SGLANG_USE_CPU_ENGINE=1: SGLang's own CPU switch;
#   - LD_LIBRARY_PATH gets the stub libcuda.so.1 (built here by scripts/build_cpu_dev.sh
#     when missing) so `import sgl_kernel` works;
#   - TRITON_INTERPRET=1: Triton kernels (the triton attention backend) run on the CPU;
#   - the sglang_ecospec plugin (an installed entry point) registers the missing sgl_kernel
#     CPU ops, the tree-mask fix and PyTorch versions of the triton backend's attention
#     kernels (with them interpreted, speculative decoding was 10-20x slower) in every
#     server process, only because the device is the CPU and no GPU is present.
# Speculative decoding on the CPU needs `--attention-backend triton`: added when a
# --speculative-algorithm is given without an --attention-backend, refused with another one.
# No CUDA graphs: `--disable-decode-cuda-graph` is added unless the decode graph is already
# off (SGLang's default decode backend is `full` on the CPU too: a speculative server stops in
# its capture with "Found no NVIDIA driver on your system", a plain one captures nothing;
# the prefill graph is off on the CPU by default); a flag that asks for a graph or tunes its
# capture is refused.
# Pass small --max-total-tokens and --mem-fraction-static values (the CPU "memory pool" is
# host RAM).
# Threads: ECOSPEC_CPU_THREADS (default 1) OpenMP threads per server process.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${ECOSPEC_CPU_VENV:-$root/.venv}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[launch_cpu] error: this machine has an NVIDIA GPU; the CPU development mode is for" \
    "machines without one. Run: python -m sglang.launch_server ARGS..." >&2
  exit 2
fi
# SGLang's CPU default, torch_native, stops a speculative server deep in its startup ("EAGLE
# is not supported in decode attention backend torch_native"): decide here, before any build.
spec_algo='' attn_backend='' decode_graph_off='' graph_flag=''
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --speculative-algorithm) spec_algo=${args[i + 1]:-} ;;
    --speculative-algorithm=*) spec_algo=${args[i]#*=} ;;
    --attention-backend) attn_backend=${args[i + 1]:-} ;;
    --attention-backend=*) attn_backend=${args[i]#*=} ;;
    --disable-cuda-graph | --disable-decode-cuda-graph) decode_graph_off=1 ;;
    # sglang 0.5.23's per-phase backends: only `disabled` agrees with the CPU.
    --cuda-graph-backend-decode | --cuda-graph-backend-prefill)
      if [ "${args[i + 1]:-}" = disabled ]; then
        [ "${args[i]}" = --cuda-graph-backend-prefill ] || decode_graph_off=1
      else
        graph_flag="${args[i]} ${args[i + 1]:-}"
      fi ;;
    --cuda-graph-backend-decode=disabled) decode_graph_off=1 ;;
    --cuda-graph-backend-prefill=disabled) ;;
    # Every other flag that configures a graph's capture (its backend, batch sizes, JSON
    # config, profiling, debugging) asks for something the CPU does not do.
    --cuda-graph-* | --enable-profile-cuda-graph | --debug-cuda-graph | --enable-cudagraph-gc)
      graph_flag=${args[i]} ;;
  esac
done
if [ -n "$graph_flag" ]; then
  echo "[launch_cpu] error: $graph_flag asks for CUDA graphs, which the CPU development mode" \
    "does not capture: drop it (the launcher disables the decode graph itself)" >&2
  exit 2
fi
if [ -n "$spec_algo" ]; then
  if [ -z "$attn_backend" ]; then
    echo "[launch_cpu] adding --attention-backend triton: speculative decoding ($spec_algo)" \
      "on the CPU runs only on it (the default, torch_native, has no EAGLE support)" >&2
    set -- "$@" --attention-backend triton
  elif [ "$attn_backend" != triton ]; then
    echo "[launch_cpu] error: speculative decoding ($spec_algo) on the CPU runs only on the" \
      "triton attention backend, not $attn_backend: pass --attention-backend triton" >&2
    exit 2
  fi
fi
if [ -z "$decode_graph_off" ]; then
  echo "[launch_cpu] adding --disable-decode-cuda-graph: no CUDA graphs on the CPU (SGLang's" \
    "decode graph capture stops a speculative server with \"Found no NVIDIA driver\")" >&2
  set -- "$@" --disable-decode-cuda-graph
fi
[ -x "$venv/bin/python" ] || {
  echo "[launch_cpu] error: no Python environment at $venv (run bash scripts/setup_env.sh)" >&2
  exit 1
}
stub_dir=$venv/lib/sgl_ecospec_stub
[ -f "$stub_dir/libcuda.so.1" ] || bash "$root/scripts/build_cpu_dev.sh" "$venv" >&2

export SGLANG_USE_CPU_ENGINE=1
export TRITON_INTERPRET=1
export LD_LIBRARY_PATH=$stub_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
threads=${ECOSPEC_CPU_THREADS:-1}
export OMP_NUM_THREADS=$threads
# SGLang binds each CPU rank's OpenMP threads to these cores (default: a whole NUMA node).
export SGLANG_CPU_OMP_THREADS_BIND=${SGLANG_CPU_OMP_THREADS_BIND:-0-$((threads - 1))}
exec "$venv/bin/python" -m sglang.launch_server --device cpu "$@"
