// The CUDA selection kernel's launch plan and arguments, made from a checked call. The CUDA
// launcher (ops_cuda.cu) and the tests' CPU emulation of the kernel
// (test/ops/cuda_emulated_select.cpp) both use these two functions, so the emulation runs
// the kernel on exactly the arguments the launcher gives it.
#pragma once

#include <cstdint>

#include "selection_call.h"
#include "selection_core.h"
#include "selection_cuda.cuh"

namespace sgl_ecospec {

// How a call runs (blocks, requests per block, workspace), with at most `shared_limit` bytes
// of dynamic shared memory per block and, for round_sync, at most `max_blocks` co-resident
// blocks.
inline SelectLaunch plan_select_call(const SelectShape& shape, const SelectOptions& options,
                                     const Placement& placement, int64_t shared_limit,
                                     int64_t max_blocks) {
  const int64_t rank_rows = placement.layer_stride == 0 ? 1 : shape.layers;
  return plan_select(shape.batch, shape.num_nodes, shape.layers, shape.words, options.policy,
                     options.share_buffer, options.round_sync, placement.enabled, rank_rows,
                     placement.num_experts, placement.num_ranks, shared_limit, max_blocks);
}

// select_kernel's arguments. `scratch`: launch.scratch_bytes() bytes, or nullptr when that
// is 0, with its union_bytes at union_offset() zeroed.
inline SelectArgs select_args(const SelectBuffers& io, unsigned char* scratch,
                              const SelectShape& shape, const SelectOptions& options,
                              const Placement& placement, const SelectLaunch& launch) {
  uint64_t* picked = nullptr;
  RoundPick* picks = nullptr;
  if (launch.rounds) {
    picked = reinterpret_cast<uint64_t*>(scratch + launch.union_offset());
    picks = reinterpret_cast<RoundPick*>(scratch + launch.union_offset() + launch.union_bytes);
  }
  return SelectArgs{io,
                    shape,
                    options,
                    placement,
                    launch.layout.global_bytes > 0 ? scratch : nullptr,
                    launch.group,
                    launch.layout,
                    picked,
                    picks};
}

}  // namespace sgl_ecospec
