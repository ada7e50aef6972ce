// One select_verify_set call after its checks, as plain values: the C++ side of
// sgl_ecospec.ops.options.SelectionOptions and the call's sizes and buffers. checks.cpp fills
// the options once per call from the op's schema arguments; the CPU launcher, the CUDA
// launcher and the tests' CPU emulation of the CUDA kernel all read them. No ATen and no
// device code here, so that the emulation (test/ops/cuda_emulated_select.cpp) includes it.
#pragma once

#include <cstdint>

#include "selection_core.h"

namespace sgl_ecospec {

// The checked scalar options (ranges as in sgl_ecospec/ops/options.py).
struct SelectOptions {
  Policy policy;
  double eps;
  bool share_buffer;
  int64_t num_ranks;    // R of the EP placement; 1 without one
  double total_weight;  // weight of the experts off the busiest rank; 0 without a placement
  double step_tokens;
  double step_cost;  // read by "adaptive" only, which requires it; 0 for the other policies
  double candidate_cost, candidate_decay;  // a request's k-th candidate adds cost x decay^k
  double min_score;                        // nodes scoring below it are never taken
  bool round_sync;  // share_buffer only: a round's requests all pick against its start
};

// The sizes of a call: B requests, N candidates, L layers, W words per layer bitmap, and the
// candidates to choose per request.
struct SelectShape {
  int64_t batch, num_nodes, layers, words, budget;
};

// A call's inputs and output in the launchers' types, contiguous (B, N, L, W as above).
struct SelectBuffers {
  const double* prob;       // [B, N]
  const int64_t* parents;   // [B, N]
  const uint64_t* experts;  // [B, N, L, W]
  const uint64_t* roots;    // [B, L, W] or nullptr
  const double* weights;    // [L] or nullptr
  int64_t* out;             // [B, budget]
};

}  // namespace sgl_ecospec
