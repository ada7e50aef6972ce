// Selection rules shared by the CPU op (selection.cpp) and the CUDA kernel
// (selection_cuda.cuh): one definition of a node's cost and priority, of the tie rule and
// of the adaptive stop test, so that both choose exactly the same nodes as the PyTorch
// reference (sgl_ecospec.ops.selection.select_verify_set_reference).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SGL_HD __host__ __device__ __forceinline__
#else
#define SGL_HD inline
#endif

namespace sgl_ecospec {

enum class Policy : int { kConfidence = 0, kEcoSpec = 1, kAdaptive = 2 };

constexpr int64_t kBitsPerWord = 64;

SGL_HD int popcount64(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __popcll(x);
#else
  return __builtin_popcountll(x);
#endif
}

// Index of the lowest set bit of a non-zero word.
SGL_HD int lowest_bit(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return __ffsll(static_cast<long long>(x)) - 1;
#else
  return __builtin_ctzll(x);
#endif
}

// a * b and a + b, each rounded on its own. nvcc contracts a * b + c into one fused
// multiply-add by default, which rounds once and would make the GPU's sums differ from
// the reference's in the last bit; the intrinsics are never contracted.
SGL_HD double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

SGL_HD double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
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
    total = add_rn(total, mul_rn(weights[l], static_cast<double>(count)));
  }
  return total;
}

// Where the experts live under expert parallelism: the EP rank of each (layer, expert).
// `enabled` is false when the caller gave no placement (the plain EcoSpec cost).
struct Placement {
  bool enabled;
  const int64_t* rank;   // [L, E], or [E] for every layer (layer_stride 0)
  int64_t layer_stride;  // E, or 0
  int64_t num_experts;   // E
  int64_t num_ranks;     // R
  double total_weight;   // weight of the experts off the busiest rank, in [0, 1]
};

// EP rank of expert `e` of `layer`, or -1 for bits at or above E and ranks outside
// [0, R) (the Python API rejects those; here they simply never count).
SGL_HD int64_t rank_of(const Placement& p, int64_t layer, int64_t e) {
  if (e >= p.num_experts) return -1;
  const int64_t r = p.rank[layer * p.layer_stride + e];
  return r >= 0 && r < p.num_ranks ? r : -1;
}

// The ranks of one layer's experts under a placement: rank_of(p, layer, e) as a function of
// e alone. The rules below take any such function, so the CUDA kernel can read a copy of
// the rank table in shared memory (with the same -1 for "no rank") and stay the same rules.
struct PlacementLayer {
  Placement p;
  int64_t layer;
  SGL_HD int64_t operator()(int64_t e) const { return rank_of(p, layer, e); }
};

// Experts of one layer of `node` missing from `buffer` that live on rank `r` (`ranks`: the
// layer's rank function, -1 for none).
template <typename LayerRanks>
SGL_HD int64_t fresh_on_rank(const LayerRanks& ranks, const uint64_t* node,
                             const uint64_t* buffer, int64_t words, int64_t r) {
  int64_t count = 0;
  for (int64_t w = 0; w < words; ++w) {
    for (uint64_t fresh = node[w] & ~buffer[w]; fresh != 0; fresh &= fresh - 1) {
      count += ranks(w * kBitsPerWord + lowest_bit(fresh)) == r;
    }
  }
  return count;
}

// Ranks a node's fresh experts of one layer are tallied on before falling back to
// recounting per expert: top-K routing with K <= 16 never needs more.
constexpr int kRankTally = 16;

// Expert-parallel cost of adding one layer of `node` to `buffer`: with loads[r] the
// buffer's experts on rank r and peak = max_r loads[r], the busiest rank rises by
// rise = max_r (loads[r] + fresh[r]) - peak, and the cost is
// rise + total_weight x (fresh experts - rise) = (1 - tw) rise + tw x fresh experts.
// `ranks`: the layer's rank function (PlacementLayer or the CUDA kernel's table).
template <typename LayerRanks>
SGL_HD double ep_layer_cost(const LayerRanks& ranks, double total_weight, const uint64_t* node,
                            const uint64_t* buffer, int64_t words, const int32_t* loads,
                            int32_t peak) {
  // Tally the fresh experts per rank in a small table (distinct ranks <= fresh experts).
  int64_t tally_rank[kRankTally];
  int32_t tally_count[kRankTally];
  int distinct = 0;
  bool overflow = false;
  int64_t added = 0;
  for (int64_t w = 0; w < words; ++w) {
    for (uint64_t fresh = node[w] & ~buffer[w]; fresh != 0; fresh &= fresh - 1) {
      const int64_t r = ranks(w * kBitsPerWord + lowest_bit(fresh));
      if (r < 0) continue;
      ++added;
      int k = 0;
      while (k < distinct && tally_rank[k] != r) ++k;
      if (k == distinct) {
        if (distinct == kRankTally) {
          overflow = true;
          continue;
        }
        tally_rank[distinct] = r;
        tally_count[distinct++] = 0;
      }
      ++tally_count[k];
    }
  }
  int64_t new_peak = peak;
  if (!overflow) {
    for (int k = 0; k < distinct; ++k) {
      const int64_t on_rank = loads[tally_rank[k]] + tally_count[k];
      if (on_rank > new_peak) new_peak = on_rank;
    }
  } else {
    // More distinct ranks than the table holds: count each fresh expert's rank anew.
    for (int64_t w = 0; w < words; ++w) {
      for (uint64_t fresh = node[w] & ~buffer[w]; fresh != 0; fresh &= fresh - 1) {
        const int64_t r = ranks(w * kBitsPerWord + lowest_bit(fresh));
        if (r < 0) continue;
        const int64_t on_rank = loads[r] + fresh_on_rank(ranks, node, buffer, words, r);
        if (on_rank > new_peak) new_peak = on_rank;
      }
    }
  }
  const double rise = static_cast<double>(new_peak - peak);
  return add_rn(rise, mul_rn(total_weight, static_cast<double>(added) - rise));
}

// DeltaCost of `node` against `buffer`: missing experts, or with a placement the
// expert-parallel cost of every layer (`loads` [L, R], `peaks` [L] describe the buffer);
// layers are weighted by `weights` ([L] or nullptr) and summed in layer order.
SGL_HD double delta_cost(const uint64_t* node, const uint64_t* buffer, int64_t layers,
                         int64_t words, const double* weights, const Placement& p,
                         const int32_t* loads, const int32_t* peaks) {
  if (!p.enabled) return missing_experts(node, buffer, layers, words, weights);
  double total = 0.0;
  for (int64_t l = 0; l < layers; ++l) {
    const double cost = ep_layer_cost(PlacementLayer{p, l}, p.total_weight, node + l * words,
                                      buffer + l * words, words, loads + l * p.num_ranks, peaks[l]);
    total = add_rn(total, weights == nullptr ? cost : mul_rn(weights[l], cost));
  }
  return total;
}

// What a request's next candidate costs beyond its DeltaCost: eps plus its scheduled cost
// `price` = candidate_cost x candidate_decay^k for its k-th candidate (each backend keeps
// `price` per request and multiplies it by the decay, mul_rn, after each take).
SGL_HD double candidate_eps(double eps, double price) { return add_rn(eps, price); }

SGL_HD double node_priority(Policy policy, double prob, double delta, double eps) {
  if (policy == Policy::kConfidence) return prob;
  return prob / (delta + eps);
}

// The adaptive stop test: a node is worth verifying while its acceptance gain per cost,
// P / (DeltaCost + eps) = its priority, is at least the step's tokens per cost so far.
SGL_HD bool raises_throughput(double priority, double tokens, double cost) {
  return priority >= tokens / cost;
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

// is_available, and the node's score (draft probability) is at least `min_score`: a node
// below the floor is never verified, whatever the budget left.
SGL_HD bool can_take(const uint8_t* selected, const int64_t* parents, const double* prob,
                     int64_t i, int64_t num_nodes, double min_score) {
  return is_available(selected, parents, i, num_nodes) && prob[i] >= min_score;
}

}  // namespace sgl_ecospec
