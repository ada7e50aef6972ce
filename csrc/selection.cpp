// Greedy verify-set selection on the CPU; the PyTorch reference is
// sgl_ecospec.selection.select_verify_set_reference, and the two must agree exactly.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "ecospec_ops.h"
#include "selection_core.h"

namespace sgl_ecospec {

namespace {

// Flat views of one batch's inputs. B = requests, N = candidates, LW = L * W words.
struct Tree {
  const double* prob;       // [B, N]
  const int64_t* parents;   // [B, N]
  const uint64_t* experts;  // [B, N, L, W]
  const double* weights;    // [L] or nullptr
  int64_t num_nodes, layers, words;
  Policy policy;
  double eps;
};

// Best frontier node of request b (lowest index on ties), or -1 when none is left.
int64_t pick(const Tree& t, int64_t b, const uint8_t* selected, const uint64_t* buffer) {
  const int64_t n = t.num_nodes;
  const int64_t lw = t.layers * t.words;
  const double* prob = t.prob + b * n;
  const int64_t* parents = t.parents + b * n;
  int64_t best = -1;
  double best_priority = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    if (!is_available(selected, parents, i, n)) continue;
    const double priority = node_priority(t.policy, prob[i], t.experts + (b * n + i) * lw,
                                          buffer, t.layers, t.words, t.weights, t.eps);
    if (is_better(priority, i, best_priority, best)) {
      best = i;
      best_priority = priority;
    }
  }
  return best;
}

void add_to_buffer(uint64_t* buffer, const uint64_t* node, int64_t lw) {
  for (int64_t j = 0; j < lw; ++j) buffer[j] |= node[j];
}

void write_row(const uint8_t* selected, int64_t n, int64_t budget, int64_t* out) {
  int64_t k = 0;
  for (int64_t i = 0; i < n && k < budget; ++i) {
    if (selected[i]) out[k++] = i;
  }
  for (; k < budget; ++k) out[k] = -1;
}

}  // namespace

at::Tensor select_verify_set_cpu(const at::Tensor& scores, const at::Tensor& parents,
                                 const at::Tensor& node_experts, int64_t budget,
                                 const std::optional<at::Tensor>& root_experts,
                                 const std::string& policy, double eps, bool share_buffer,
                                 const std::optional<at::Tensor>& layer_weights) {
  TORCH_CHECK(scores.dim() == 2, "select_verify_set: scores must be [B, N]");
  const int64_t batch = scores.size(0), n = scores.size(1);
  TORCH_CHECK(parents.sizes() == scores.sizes(), "select_verify_set: parents must be [B, N]");
  TORCH_CHECK(node_experts.dim() == 4 && node_experts.size(0) == batch &&
                  node_experts.size(1) == n && node_experts.scalar_type() == at::kLong,
              "select_verify_set: node_experts must be int64 [B, N, L, W]");
  TORCH_CHECK(budget >= 0, "select_verify_set: budget must be >= 0");
  TORCH_CHECK(policy == "confidence" || policy == "ecospec",
              "select_verify_set: unknown policy ", policy);
  TORCH_CHECK(eps > 0, "select_verify_set: eps must be > 0");
  const int64_t layers = node_experts.size(2), words = node_experts.size(3);
  const int64_t lw = layers * words;

  const at::Tensor prob = scores.to(at::kDouble).contiguous();
  const at::Tensor par = parents.to(at::kLong).contiguous();
  const at::Tensor experts = node_experts.contiguous();
  TORCH_CHECK(par.numel() == 0 || (par.min().item<int64_t>() >= -1 && par.max().item<int64_t>() < n),
              "select_verify_set: parents must lie in [-1, N)");
  at::Tensor weights;
  if (layer_weights.has_value()) {
    TORCH_CHECK(layer_weights->dim() == 1 && layer_weights->size(0) == layers,
                "select_verify_set: layer_weights must be [L]");
    weights = layer_weights->to(at::kDouble).contiguous();
  }
  at::Tensor buffers = at::zeros({batch, layers, words}, experts.options());
  if (root_experts.has_value()) {
    TORCH_CHECK(root_experts->dim() == 3 && root_experts->size(0) == batch &&
                    root_experts->size(1) == layers && root_experts->size(2) == words &&
                    root_experts->scalar_type() == at::kLong,
                "select_verify_set: root_experts must be int64 [B, L, W]");
    buffers.copy_(*root_experts);
  }

  const Tree tree{prob.data_ptr<double>(),
                  par.data_ptr<int64_t>(),
                  reinterpret_cast<const uint64_t*>(experts.data_ptr<int64_t>()),
                  weights.defined() ? weights.data_ptr<double>() : nullptr,
                  n,
                  layers,
                  words,
                  policy == "ecospec" ? Policy::kEcoSpec : Policy::kConfidence,
                  eps};
  at::Tensor out = at::empty({batch, budget}, par.options());
  int64_t* out_ptr = out.data_ptr<int64_t>();
  uint64_t* buffer_ptr = reinterpret_cast<uint64_t*>(buffers.data_ptr<int64_t>());

  if (share_buffer) {
    std::vector<uint64_t> shared(lw, 0);
    for (int64_t b = 0; b < batch; ++b) add_to_buffer(shared.data(), buffer_ptr + b * lw, lw);
    std::vector<uint8_t> selected(batch * n, 0);
    for (int64_t step = 0; step < budget; ++step) {
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t best = pick(tree, b, selected.data() + b * n, shared.data());
        if (best < 0) continue;
        selected[b * n + best] = 1;
        if (tree.policy == Policy::kEcoSpec) {
          add_to_buffer(shared.data(), tree.experts + (b * n + best) * lw, lw);
        }
      }
    }
    for (int64_t b = 0; b < batch; ++b) write_row(selected.data() + b * n, n, budget, out_ptr + b * budget);
    return out;
  }

  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> selected(n);
    for (int64_t b = begin; b < end; ++b) {
      std::fill(selected.begin(), selected.end(), 0);
      uint64_t* buffer = buffer_ptr + b * lw;
      for (int64_t step = 0; step < budget; ++step) {
        const int64_t best = pick(tree, b, selected.data(), buffer);
        if (best < 0) break;
        selected[best] = 1;
        if (tree.policy == Policy::kEcoSpec) add_to_buffer(buffer, tree.experts + (b * n + best) * lw, lw);
      }
      write_row(selected.data(), n, budget, out_ptr + b * budget);
    }
  });
  return out;
}

}  // namespace sgl_ecospec
