// Selection rules shared by the CPU op (selection.cpp) and the CUDA kernel
// (ops_cuda.cu): one definition of a node's priority and of the tie rule, so that both
// choose exactly the same nodes as the PyTorch reference.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SGL_HD __host__ __device__ __forceinline__
#else
#define SGL_HD inline
#endif

namespace sgl_ecospec {

enum class Policy : int { kConfidence = 0, kEcoSpec = 1 };

SGL_HD int popcount64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __popcll(x);
#else
  return __builtin_popcountll(x);
#endif
}

// Predicted experts of `node` ([layers * words]) missing from `buffer`, summed over layers;
// with `weights` ([layers]) each layer's count is weighted and the sum runs in layer order
// (the reference sums with cumsum, which adds in the same order).
SGL_HD double missing_experts(const uint64_t* node, const uint64_t* buffer, int64_t layers,
                              int64_t words, const double* weights) {
  if (weights == nullptr) {
    int64_t count = 0;
    for (int64_t j = 0; j < layers * words; ++j) count += popcount64(node[j] & ~buffer[j]);
    return static_cast<double>(count);
  }
  double total = 0.0;
  for (int64_t l = 0; l < layers; ++l) {
    int64_t count = 0;
    for (int64_t w = 0; w < words; ++w) {
      count += popcount64(node[l * words + w] & ~buffer[l * words + w]);
    }
    total += weights[l] * static_cast<double>(count);
  }
  return total;
}

SGL_HD double node_priority(Policy policy, double prob, const uint64_t* node,
                            const uint64_t* buffer, int64_t layers, int64_t words,
                            const double* weights, double eps) {
  if (policy == Policy::kConfidence) return prob;
  return prob / (missing_experts(node, buffer, layers, words, weights) + eps);
}

// True when (priority, index) should replace the current best: higher priority wins, ties
// go to the lower index, and index -1 means "no node".
SGL_HD bool is_better(double priority, int64_t index, double best_priority, int64_t best_index) {
  if (index < 0) return false;
  if (best_index < 0) return true;
  return priority > best_priority || (priority == best_priority && index < best_index);
}

// A node can be chosen when it is not chosen yet and its parent is the root or chosen.
// Parents outside [-1, num_nodes) make a node unreachable (the Python API rejects them).
SGL_HD bool is_available(const uint8_t* selected, const int64_t* parents, int64_t i,
                         int64_t num_nodes) {
  const int64_t p = parents[i];
  if (selected[i] || p < -1 || p >= num_nodes) return false;
  return p < 0 || selected[p];
}

}  // namespace sgl_ecospec
