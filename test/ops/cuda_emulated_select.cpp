// select_verify_set's CUDA kernel (csrc/selection_cuda.cuh) on the CPU emulation of
// cuda_emulator.h, behind a C function for ctypes (test/ops/test_cuda_emulated.py). It plans
// the call and fills the kernel's arguments with the CUDA launcher's own functions
// (csrc/selection_launch.h), with the shared-memory limit and a round_sync grid's co-resident
// blocks as arguments, so that the tests also run the global-memory fallbacks and blocks of
// several requests.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_emulator.h"  // before the kernel: the CUDA keywords its source uses
#include "selection_launch.h"

namespace {
std::string last_error;
}

// The fault the last emu_select call returned -1 for.
extern "C" const char* emu_error() { return last_error.c_str(); }

// The arguments as the launcher has them after its checks: the buffers, the shape, the
// options, and the placement (`rank`: int64 [rank_rows, E] or nullptr without one).
extern "C" int64_t emu_select(const sgl_ecospec::SelectBuffers* io,
                              const sgl_ecospec::SelectShape* shape,
                              const sgl_ecospec::SelectOptions* options, const int64_t* rank,
                              int64_t rank_rows, int64_t num_experts, int64_t shared_limit,
                              int64_t max_blocks) {
  using namespace sgl_ecospec;
  if (shape->batch == 0) return 0;
  const bool ep = rank != nullptr;
  const Placement placement{ep,
                            rank,
                            ep && rank_rows > 1 ? num_experts : 0,
                            ep ? num_experts : 0,
                            ep ? options->num_ranks : 1,
                            ep ? options->total_weight : 0.0};
  const SelectLaunch launch =
      plan_select_call(*shape, *options, placement, shared_limit, max_blocks);
  std::vector<unsigned char> scratch(launch.scratch_bytes() + 16, 0x5A);  // garbage, but
  std::fill_n(scratch.begin() + launch.union_offset(), launch.union_bytes, 0);  // the union
  const SelectArgs args = select_args(*io, scratch.data(), *shape, *options, placement, launch);
  try {
    emu::launch(select_kernel, static_cast<unsigned>(launch.blocks), kSelectThreads,
                launch.layout.shared_bytes, args, launch.rounds);
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
  // Where the workspace went: bit 0 set when something was in shared memory, bit 1 when
  // something was in global memory (the tests check that both paths ran); -1 above: the
  // emulation found a fault (emu_error says which).
  return (launch.layout.shared_bytes > 0 ? 1 : 0) | (launch.layout.global_bytes > 0 ? 2 : 0);
}
