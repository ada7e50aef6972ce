// Greedy verify-set selection on the CPU; the PyTorch reference is
// sgl_ecospec.ops.selection.select_verify_set_reference, and the two must agree exactly.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "ecospec_ops.h"
#include "selection_core.h"

namespace sgl_ecospec {

namespace {

// Flat views of one batch's inputs. B = requests, N = candidates, LW = L * W words,
// R = EP ranks.
struct Tree {
  const double* prob;       // [B, N]
  const int64_t* parents;   // [B, N]
  const uint64_t* experts;  // [B, N, L, W]
  const double* weights;    // [L] or nullptr
  int64_t num_nodes, layers, words;
  Policy policy;
  double eps;
  Placement placement;
};

// What the verify pass already loads for one request (or for the batch): the expert
// bitmaps and, with a placement, how many of them each rank holds.
struct Buffer {
  uint64_t* experts;  // [L, W]
  int32_t* loads;     // [L, R]
  int32_t* peaks;     // [L]: max over ranks of loads
};

// The adaptive policy's account of the step: expected tokens and predicted cost so far.
struct Account {
  double tokens, cost;
};

struct Choice {
  int64_t index;  // -1: no node left
  double priority, delta;
};

// Best frontier node of request b (lowest index on ties).
Choice pick(const Tree& t, int64_t b, const uint8_t* selected, const Buffer& buffer) {
  const int64_t n = t.num_nodes;
  const int64_t lw = t.layers * t.words;
  const double* prob = t.prob + b * n;
  const int64_t* parents = t.parents + b * n;
  Choice best{-1, 0.0, 0.0};
  for (int64_t i = 0; i < n; ++i) {
    if (!is_available(selected, parents, i, n)) continue;
    const double delta = t.policy == Policy::kConfidence
                             ? 0.0
                             : delta_cost(t.experts + (b * n + i) * lw, buffer.experts, t.layers,
                                          t.words, t.weights, t.placement, buffer.loads,
                                          buffer.peaks);
    const double priority = node_priority(t.policy, prob[i], delta, t.eps);
    if (is_better(priority, i, best.priority, best.index)) best = Choice{i, priority, delta};
  }
  return best;
}

// Adds `node`'s experts to the buffer (and their ranks' loads).
void add_to_buffer(const Tree& t, const Buffer& buffer, const uint64_t* node) {
  const Placement& p = t.placement;
  for (int64_t l = 0; l < t.layers; ++l) {
    for (int64_t w = 0; w < t.words; ++w) {
      uint64_t& word = buffer.experts[l * t.words + w];
      for (uint64_t fresh = node[l * t.words + w] & ~word; p.enabled && fresh != 0;
           fresh &= fresh - 1) {
        const int64_t r = rank_of(p, l, w * kBitsPerWord + lowest_bit(fresh));
        if (r < 0) continue;
        const int32_t load = ++buffer.loads[l * p.num_ranks + r];
        buffer.peaks[l] = std::max(buffer.peaks[l], load);
      }
      word |= node[l * t.words + w];
    }
  }
}

// Starts a buffer holding `roots` ([L, W]): copies the bits and counts the loads.
void seed_buffer(const Tree& t, const Buffer& buffer, const uint64_t* roots) {
  const int64_t lw = t.layers * t.words;
  std::fill(buffer.experts, buffer.experts + lw, 0);
  if (t.placement.enabled) {
    std::fill(buffer.loads, buffer.loads + t.layers * t.placement.num_ranks, 0);
    std::fill(buffer.peaks, buffer.peaks + t.layers, 0);
  }
  add_to_buffer(t, buffer, roots);
}

// One turn of request b: picks its best node and takes it unless the adaptive policy
// finds that it would lower the step's tokens per cost. False when nothing was taken.
bool take_turn(const Tree& t, int64_t b, uint8_t* selected, const Buffer& buffer,
               Account& account) {
  const Choice c = pick(t, b, selected, buffer);
  if (c.index < 0) return false;
  if (t.policy == Policy::kAdaptive) {
    if (!raises_throughput(c.priority, account.tokens, account.cost)) return false;
    account.tokens += t.prob[b * t.num_nodes + c.index];
    account.cost += c.delta + t.eps;
  }
  selected[c.index] = 1;
  if (t.policy != Policy::kConfidence) {
    add_to_buffer(t, buffer, t.experts + (b * t.num_nodes + c.index) * t.layers * t.words);
  }
  return true;
}

void write_row(const uint8_t* selected, int64_t n, int64_t budget, int64_t* out) {
  int64_t k = 0;
  for (int64_t i = 0; i < n && k < budget; ++i) {
    if (selected[i]) out[k++] = i;
  }
  for (; k < budget; ++k) out[k] = -1;
}

// Scratch for one buffer: bitmaps [L, W], loads [L, R], peaks [L].
struct BufferStorage {
  std::vector<uint64_t> experts;
  std::vector<int32_t> loads, peaks;
  explicit BufferStorage(const Tree& t)
      : experts(t.layers * t.words),
        loads(t.placement.enabled ? t.layers * t.placement.num_ranks : 0),
        peaks(t.placement.enabled ? t.layers : 0) {}
  Buffer view() { return Buffer{experts.data(), loads.data(), peaks.data()}; }
};

Placement make_placement(const std::optional<at::Tensor>& expert_rank, at::Tensor& storage,
                         int64_t layers, int64_t words, int64_t num_ranks, double total_weight) {
  if (!expert_rank.has_value()) return Placement{false, nullptr, 0, 0, 1, 0.0};
  TORCH_CHECK(expert_rank->dim() == 1 || (expert_rank->dim() == 2 && expert_rank->size(0) == layers),
              "select_verify_set: expert_rank must be [E] or [L, E]");
  TORCH_CHECK(expert_rank->scalar_type() == at::kInt || expert_rank->scalar_type() == at::kLong,
              "select_verify_set: expert_rank must be int32 or int64");
  const int64_t num_experts = expert_rank->size(-1);
  TORCH_CHECK((num_experts + kBitsPerWord - 1) / kBitsPerWord == words,
              "select_verify_set: expert_rank has E = ", num_experts,
              " experts, so node_experts needs ceil(E / 64) words per layer, got ", words);
  TORCH_CHECK(num_ranks >= 1, "select_verify_set: num_ranks must be >= 1");
  TORCH_CHECK(total_weight >= 0 && total_weight <= 1,
              "select_verify_set: total_weight must lie in [0, 1]");
  storage = expert_rank->to(at::kLong).contiguous();
  TORCH_CHECK(storage.numel() == 0 || (storage.min().item<int64_t>() >= 0 &&
                                       storage.max().item<int64_t>() < num_ranks),
              "select_verify_set: expert_rank values must lie in [0, num_ranks)");
  return Placement{true, storage.data_ptr<int64_t>(), storage.dim() == 2 ? num_experts : 0,
                   num_experts, num_ranks, total_weight};
}

}  // namespace

at::Tensor select_verify_set_cpu(const at::Tensor& scores, const at::Tensor& parents,
                                 const at::Tensor& node_experts, int64_t budget,
                                 const std::optional<at::Tensor>& root_experts,
                                 const std::string& policy, double eps, bool share_buffer,
                                 const std::optional<at::Tensor>& layer_weights,
                                 const std::optional<at::Tensor>& expert_rank, int64_t num_ranks,
                                 double total_weight, double step_tokens, double step_cost) {
  TORCH_CHECK(scores.dim() == 2, "select_verify_set: scores must be [B, N]");
  const int64_t batch = scores.size(0), n = scores.size(1);
  TORCH_CHECK(parents.sizes() == scores.sizes(), "select_verify_set: parents must be [B, N]");
  TORCH_CHECK(node_experts.dim() == 4 && node_experts.size(0) == batch &&
                  node_experts.size(1) == n && node_experts.scalar_type() == at::kLong,
              "select_verify_set: node_experts must be int64 [B, N, L, W]");
  TORCH_CHECK(budget >= 0, "select_verify_set: budget must be >= 0");
  TORCH_CHECK(policy == "confidence" || policy == "ecospec" || policy == "adaptive",
              "select_verify_set: unknown policy ", policy);
  TORCH_CHECK(eps > 0, "select_verify_set: eps must be > 0");
  TORCH_CHECK(step_tokens >= 0 && step_cost > 0,
              "select_verify_set: need step_tokens >= 0 and step_cost > 0");
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
  at::Tensor roots = at::zeros({batch, layers, words}, experts.options());
  if (root_experts.has_value()) {
    TORCH_CHECK(root_experts->dim() == 3 && root_experts->size(0) == batch &&
                    root_experts->size(1) == layers && root_experts->size(2) == words &&
                    root_experts->scalar_type() == at::kLong,
                "select_verify_set: root_experts must be int64 [B, L, W]");
    roots.copy_(*root_experts);
  }
  at::Tensor ranks;
  const Placement placement =
      make_placement(expert_rank, ranks, layers, words, num_ranks, total_weight);

  const Policy kind = policy == "confidence" ? Policy::kConfidence
                      : policy == "ecospec"  ? Policy::kEcoSpec
                                             : Policy::kAdaptive;
  const Tree tree{prob.data_ptr<double>(),
                  par.data_ptr<int64_t>(),
                  reinterpret_cast<const uint64_t*>(experts.data_ptr<int64_t>()),
                  weights.defined() ? weights.data_ptr<double>() : nullptr,
                  n,
                  layers,
                  words,
                  kind,
                  eps,
                  placement};
  at::Tensor out = at::empty({batch, budget}, par.options());
  int64_t* out_ptr = out.data_ptr<int64_t>();
  const uint64_t* root_ptr = reinterpret_cast<const uint64_t*>(roots.data_ptr<int64_t>());

  if (share_buffer) {
    // One buffer seeded with every request's root; one account for the whole step.
    std::vector<uint64_t> all_roots(lw, 0);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t j = 0; j < lw; ++j) all_roots[j] |= root_ptr[b * lw + j];
    }
    BufferStorage storage(tree);
    const Buffer buffer = storage.view();
    seed_buffer(tree, buffer, all_roots.data());
    const double requests = static_cast<double>(batch);
    Account account{step_tokens * requests, step_cost * requests};
    std::vector<uint8_t> selected(batch * n, 0);
    for (int64_t step = 0; step < budget; ++step) {
      for (int64_t b = 0; b < batch; ++b) take_turn(tree, b, selected.data() + b * n, buffer, account);
    }
    for (int64_t b = 0; b < batch; ++b) write_row(selected.data() + b * n, n, budget, out_ptr + b * budget);
    return out;
  }

  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> selected(n);
    BufferStorage storage(tree);
    const Buffer buffer = storage.view();
    for (int64_t b = begin; b < end; ++b) {
      std::fill(selected.begin(), selected.end(), 0);
      seed_buffer(tree, buffer, root_ptr + b * lw);
      Account account{step_tokens, step_cost};
      // A request that takes nothing this turn never will: its state did not change.
      for (int64_t step = 0; step < budget; ++step) {
        if (!take_turn(tree, b, selected.data(), buffer, account)) break;
      }
      write_row(selected.data(), n, budget, out_ptr + b * budget);
    }
  });
  return out;
}

}  // namespace sgl_ecospec
