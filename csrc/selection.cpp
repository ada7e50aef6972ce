// Greedy verify-set selection on the CPU; the PyTorch reference is
// sgl_ecospec.ops.selection.select_verify_set_reference, and the two must agree exactly.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "checks.h"
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
  SelectOptions options;
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

// Best frontier node of request b (lowest index on ties); `eps`: what its next candidate
// costs beyond DeltaCost.
Choice pick(const Tree& t, int64_t b, const uint8_t* selected, const Buffer& buffer, double eps) {
  const int64_t n = t.num_nodes;
  const int64_t lw = t.layers * t.words;
  const double* prob = t.prob + b * n;
  const int64_t* parents = t.parents + b * n;
  Choice best{-1, 0.0, 0.0};
  for (int64_t i = 0; i < n; ++i) {
    if (!can_take(selected, parents, prob, i, n, t.options.min_score)) continue;
    const double delta = t.options.policy == Policy::kConfidence
                             ? 0.0
                             : delta_cost(t.experts + (b * n + i) * lw, buffer.experts, t.layers,
                                          t.words, t.weights, t.placement, buffer.loads,
                                          buffer.peaks);
    const double priority = node_priority(t.options.policy, prob[i], delta, eps);
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

// Request b's choice in a turn: its best node, or index -1 when it has none or the adaptive
// policy finds that it would lower the step's tokens per cost (tested against `account`).
// `price`: the scheduled cost of request b's next candidate (candidate_eps).
Choice choose(const Tree& t, int64_t b, const uint8_t* selected, const Buffer& buffer,
              const Account& account, double price) {
  const double eps = candidate_eps(t.options.eps, price);
  Choice c = pick(t, b, selected, buffer, eps);
  if (c.index >= 0 && t.options.policy == Policy::kAdaptive &&
      !raises_throughput(c.priority, account.tokens, account.cost)) {
    c.index = -1;
  }
  return c;
}

// Takes request b's choice `c` (index >= 0): the account, the price, the flag, the buffer.
void take(const Tree& t, int64_t b, const Choice& c, uint8_t* selected, const Buffer& buffer,
          Account& account, double& price) {
  if (t.options.policy == Policy::kAdaptive) {
    account.tokens += t.prob[b * t.num_nodes + c.index];
    account.cost += c.delta + candidate_eps(t.options.eps, price);
  }
  price = mul_rn(price, t.options.candidate_decay);
  selected[c.index] = 1;
  if (t.options.policy != Policy::kConfidence) {
    add_to_buffer(t, buffer, t.experts + (b * t.num_nodes + c.index) * t.layers * t.words);
  }
}

// One turn of request b: chooses and takes. False when nothing was taken.
bool take_turn(const Tree& t, int64_t b, uint8_t* selected, const Buffer& buffer,
               Account& account, double& price) {
  const Choice c = choose(t, b, selected, buffer, account, price);
  if (c.index < 0) return false;
  take(t, b, c, selected, buffer, account, price);
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

}  // namespace

at::Tensor select_verify_set_cpu(const SelectCall& call) {
  // Like the CUDA launcher, this one reads no values of the checked call: out-of-range
  // parents and EP ranks are handled by selection_core.h's rules.
  const SelectInputs inputs(call);
  const SelectOptions& options = call.options;
  const int64_t batch = call.shape.batch, n = call.shape.num_nodes, budget = call.shape.budget;
  const int64_t layers = call.shape.layers, words = call.shape.words;
  const int64_t lw = layers * words;
  at::Tensor roots = inputs.roots;
  if (!roots.defined()) roots = at::zeros({batch, layers, words}, inputs.experts.options());

  at::Tensor out = at::empty({batch, budget}, inputs.parents.options());
  const SelectBuffers io = inputs.buffers(out);
  const Tree tree{io.prob, io.parents, io.experts, io.weights, n,
                  layers,  words,      options,    inputs.placement};
  int64_t* out_ptr = io.out;
  const uint64_t* root_ptr = reinterpret_cast<const uint64_t*>(roots.data_ptr<int64_t>());

  if (options.share_buffer) {
    // One buffer seeded with every request's root; one account for the whole step.
    std::vector<uint64_t> all_roots(lw, 0);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t j = 0; j < lw; ++j) all_roots[j] |= root_ptr[b * lw + j];
    }
    BufferStorage storage(tree);
    const Buffer buffer = storage.view();
    seed_buffer(tree, buffer, all_roots.data());
    const double requests = static_cast<double>(batch);
    Account account{options.step_tokens * requests, options.step_cost * requests};
    std::vector<uint8_t> selected(batch * n, 0);
    std::vector<double> prices(batch, options.candidate_cost);
    std::vector<Choice> round(options.round_sync ? batch : 0);
    for (int64_t step = 0; step < budget; ++step) {
      if (!options.round_sync) {
        for (int64_t b = 0; b < batch; ++b) {
          take_turn(tree, b, selected.data() + b * n, buffer, account, prices[b]);
        }
        continue;
      }
      // Every request chooses against the round's start; the choices then enter in order.
      for (int64_t b = 0; b < batch; ++b) {
        round[b] = choose(tree, b, selected.data() + b * n, buffer, account, prices[b]);
      }
      for (int64_t b = 0; b < batch; ++b) {
        if (round[b].index >= 0) {
          take(tree, b, round[b], selected.data() + b * n, buffer, account, prices[b]);
        }
      }
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
      Account account{options.step_tokens, options.step_cost};
      double price = options.candidate_cost;
      // A request that takes nothing this turn never will: its state did not change.
      for (int64_t step = 0; step < budget; ++step) {
        if (!take_turn(tree, b, selected.data(), buffer, account, price)) break;
      }
      write_row(selected.data(), n, budget, out_ptr + b * budget);
    }
  });
  return out;
}

}  // namespace sgl_ecospec
