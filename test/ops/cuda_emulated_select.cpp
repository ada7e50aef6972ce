// select_verify_set's CUDA kernel (csrc/selection_cuda.cuh) on the CPU emulation of
// cuda_emulator.h, behind a C function for ctypes (test/ops/test_cuda_emulated.py). It plans
// the call as the CUDA launcher does (plan_select), with the shared-memory limit as an
// argument, so that the tests also run the global-memory fallbacks.
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_emulator.h"  // before the kernel: the CUDA keywords its source uses
#include "selection_cuda.cuh"

namespace {
std::string last_error;
}

// The fault the last emu_select call returned -1 for.
extern "C" const char* emu_error() { return last_error.c_str(); }

extern "C" int64_t emu_select(const double* prob, const int64_t* parents, const int64_t* experts,
                              const int64_t* roots, const double* weights, const int64_t* rank,
                              int64_t rank_rows, int64_t* out, int64_t batch, int64_t num_nodes,
                              int64_t layers, int64_t words, int64_t budget, int policy,
                              double eps, bool share_buffer, int64_t num_experts,
                              int64_t num_ranks, double total_weight, double step_tokens,
                              double step_cost, double candidate_cost, double candidate_decay,
                              double min_score, int64_t shared_limit) {
  using namespace sgl_ecospec;
  if (batch == 0) return 0;
  const bool ep = rank != nullptr;
  const SelectLaunch launch =
      plan_select(batch, num_nodes, layers, words, static_cast<Policy>(policy), share_buffer, ep,
                  rank_rows, ep ? num_experts : 0, ep ? num_ranks : 1, shared_limit);
  std::vector<unsigned char> scratch(launch.blocks * launch.layout.global_bytes + 16, 0x5A);
  SelectArgs args{};
  args.prob = prob;
  args.parents = parents;
  args.experts = reinterpret_cast<const uint64_t*>(experts);
  args.roots = reinterpret_cast<const uint64_t*>(roots);
  args.weights = weights;
  args.rank = rank;
  args.scratch = launch.layout.global_bytes > 0 ? scratch.data() : nullptr;
  args.out = out;
  args.batch = batch;
  args.num_nodes = num_nodes;
  args.layers = layers;
  args.words = words;
  args.budget = budget;
  args.requests_per_block = launch.group;
  args.policy = static_cast<Policy>(policy);
  args.eps = eps;
  args.step_tokens = step_tokens;
  args.step_cost = step_cost;
  args.min_score = min_score;
  args.candidate_cost = candidate_cost;
  args.candidate_decay = candidate_decay;
  args.ep = ep;
  args.rank_layer_stride = ep && rank_rows > 1 ? num_experts : 0;
  args.num_experts = ep ? num_experts : 0;
  args.num_ranks = ep ? num_ranks : 1;
  args.total_weight = ep ? total_weight : 0.0;
  args.layout = launch.layout;
  try {
    emu::launch(select_kernel, static_cast<unsigned>(launch.blocks), kSelectThreads,
                launch.layout.shared_bytes, args);
  } catch (const std::exception& e) {
    last_error = e.what();
    return -1;
  }
  // Where the workspace went: bit 0 set when something was in shared memory, bit 1 when
  // something was in global memory (the tests check that both paths ran); -1 above: the
  // emulation found a fault (emu_error says which).
  return (launch.layout.shared_bytes > 0 ? 1 : 0) | (launch.layout.global_bytes > 0 ? 2 : 0);
}
