// The CUDA kernel of select_verify_set (device code; the launcher is in ops_cuda.cu).
//
// One kernel for the three modes. A block runs a group of requests on one expert buffer: one
// block per request (per-request buffers), one block for the whole batch (share_buffer,
// whose turns are sequential by definition: request b's pick depends on every pick before
// it), or with round_sync a cooperative grid (one block per request up to the co-resident
// limit) in which every block holds a copy of the batch's buffer: in a round each block
// picks for its requests against its copy, publishes the picks, waits for the grid, and
// merges every request's pick into its copy and account in request order, so all copies
// stay equal. Budget rounds are then the only dependent steps, not B x budget turns. The
// work inside a turn is spread over the block:
//
// - the turn's frontier (available candidates of its request) is a list in the workspace,
//   built during the previous turn (off its critical path when the request changes);
// - one warp per frontier candidate computes its DeltaCost against the buffer, the lanes
//   over the layers (or words), and keeps its best candidate (is_better, the shared tie rule);
// - after one __syncthreads every warp reduces the per-warp bests to the same winner (the
//   same slots in the same order, so all threads agree) and applies the adaptive test;
// - the winner's experts enter the buffer (one thread per layer, no atomics) while warp 0
//   marks it selected; a second __syncthreads ends the turn.
//
// Idle warps (fewer frontier candidates than warps) prefetch the next request's frontier
// bitmaps into L1, so the next turn's reads hit L1 instead of L2/HBM.
//
// A turn is a chain of dependent steps, so its time is latencies, not bandwidth (measured on
// an H200: about 3-4 us a turn when every step read global memory). Hence the scores are
// staged in the workspace at setup, a warp first copies its candidate's bitmaps into its own
// workspace slot with every load in flight at once (one global latency instead of one per
// word), and each request's count of taken candidates is kept rather than recounted.
//
// The workspace (buffer bitmaps, scores, rank loads and peaks, the rank table as int32,
// parents, selected flags, taken counts, frontier lists, the warps' candidate slots) lives in
// shared memory where it fits and in a global scratch tensor otherwise (plan_select, used by
// the launcher). Candidate bitmaps are read from global memory.
//
// Exactness (equal to the reference bit for bit): the rules come from selection_core.h
// (is_available, node_priority, is_better, raises_throughput, ep_layer_cost); plain counts
// are integers; float sums over layers run in layer order, one term after another, skipping
// only terms equal to zero (x + 0.0 == x, and the running total is never -0.0), with every
// multiply and add rounded on its own (mul_rn / add_rn: no FMA contraction).
#pragma once

#include <cstdint>

#include "selection_core.h"
#include "selection_cuda_state.cuh"

namespace sgl_ecospec {

// One warp lists the available candidates of request k of the block (ascending) in
// `frontier`, and their count in `count`.
__device__ void list_frontier(const SelectArgs& a, const Workspace& ws, int64_t first, int64_t k,
                              int64_t* frontier, int64_t* count) {
  const int lane = threadIdx.x % 32;
  const int64_t n = a.shape.num_nodes;
  const double* prob = ws.prob + k * n;
  const uint8_t* selected = ws.selected + k * n;
  const int64_t* parents = ws.parents + k * n;
  int64_t seen = 0;
  for (int64_t base = 0; base < n; base += 32) {
    const int64_t i = base + lane;
    const bool available = i < n && can_take(selected, parents, prob, i, n, a.options.min_score);
    const unsigned mask = __ballot_sync(kFullMask, available);
    if (available) frontier[seen + __popc(mask & ((1u << lane) - 1))] = i;
    seen += __popc(mask);
  }
  if (lane == 0) *count = seen;
}

// Sets up the block's buffer (the union of its requests' roots, or with round_sync of the
// batch's; with EP the loads and peaks), parents, selected flags and the first frontier
// (list 0). Ends synchronised.
__device__ void setup(const SelectArgs& a, const Workspace& ws, int64_t first, int64_t group,
                      int64_t* counts) {
  const int64_t n = a.shape.num_nodes;
  const int64_t seed_first = a.picks != nullptr ? 0 : first;
  const int64_t seeds = a.picks != nullptr ? a.shape.batch : group;
  const int64_t layers = a.shape.layers, words = a.shape.words, lw = layers * words;
  for (int64_t j = threadIdx.x; j < group * n; j += blockDim.x) {
    ws.parents[j] = a.io.parents[first * n + j];
    ws.prob[j] = a.io.prob[first * n + j];
    ws.selected[j] = 0;
  }
  for (int64_t k = threadIdx.x; k < group; k += blockDim.x) ws.taken[k] = 0;
  if (needs_buffer(a)) {
    for (int64_t j = threadIdx.x; j < lw; j += blockDim.x) {
      uint64_t word = 0;
      for (int64_t k = 0; a.io.roots != nullptr && k < seeds; ++k) {
        word |= a.io.roots[(seed_first + k) * lw + j];
      }
      ws.bitmaps[j] = word;
    }
  }
  if (needs_buffer(a) && a.placement.enabled) {
    const int64_t table = (a.placement.layer_stride == 0 ? 1 : layers) * a.placement.num_experts;
    for (int64_t j = threadIdx.x; j < table; j += blockDim.x) {
      const int64_t r = a.placement.rank[j];  // rank_of's rule: ranks outside [0, R) count nowhere
      ws.ranks[j] = r >= 0 && r < a.placement.num_ranks ? static_cast<int32_t>(r) : -1;
    }
    const int64_t num_ranks = a.placement.num_ranks;
    for (int64_t j = threadIdx.x; j < layers * num_ranks; j += blockDim.x) ws.loads[j] = 0;
  }
  __syncthreads();
  if (threadIdx.x < 32) list_frontier(a, ws, first, 0, ws.frontier, counts);
  if (needs_buffer(a) && a.placement.enabled) {
    // The loads of the seeded buffer: each of its experts counted once on its rank.
    for (int64_t j = threadIdx.x; j < lw; j += blockDim.x) {
      const int64_t layer = j / words;
      const TableLayer ranks = table_layer(a, ws, layer);
      for (uint64_t bits = ws.bitmaps[j]; bits != 0; bits &= bits - 1) {
        const int64_t r = ranks((j % words) * kBitsPerWord + lowest_bit(bits));
        if (r >= 0) atomicAdd(ws.loads + layer * a.placement.num_ranks + r, 1);
      }
    }
    __syncthreads();
    const int64_t num_ranks = a.placement.num_ranks;
    for (int64_t l = threadIdx.x; l < layers; l += blockDim.x) {
      int32_t peak = 0;
      for (int64_t r = 0; r < num_ranks; ++r) peak = max(peak, ws.loads[l * num_ranks + r]);
      ws.peaks[l] = peak;
    }
  }
  __syncthreads();
}

// Sum of one value per lane, exact for values below 2^32 (each lane counts the bits of at
// most L * W / 32 words), in every lane.
__device__ __forceinline__ uint64_t warp_count(uint64_t mine) {
  const unsigned low = __reduce_add_sync(kFullMask, static_cast<unsigned>(mine & 0xffff));
  const unsigned high = __reduce_add_sync(kFullMask, static_cast<unsigned>(mine >> 16));
  return static_cast<uint64_t>(low) + (static_cast<uint64_t>(high) << 16);
}

// DeltaCost term of one layer of `node`: missing experts, or the EP cost, times the layer's
// weight when there are weights (as delta_cost and missing_experts in selection_core.h).
__device__ double layer_term(const SelectArgs& a, const Workspace& ws, const uint64_t* node,
                             int64_t l) {
  const int64_t words = a.shape.words;
  double cost;
  if (a.placement.enabled) {
    cost = ep_layer_cost(table_layer(a, ws, l), a.placement.total_weight, node + l * words,
                         ws.bitmaps + l * words, words, ws.loads + l * a.placement.num_ranks,
                         ws.peaks[l]);
  } else {
    int64_t count = 0;
    for (int64_t w = 0; w < words; ++w) {
      count += popcount64(node[l * words + w] & ~ws.bitmaps[l * words + w]);
    }
    cost = static_cast<double>(count);
  }
  return a.io.weights == nullptr ? cost : mul_rn(a.io.weights[l], cost);
}

// Words each lane loads before it stores any, when a warp stages a candidate: all of a
// candidate's L x W words (up to 32 x 8 = 256, Qwen3-235B's 94 x 2 and DeepSeek-V3's 58 x 4
// included) cost one memory latency.
constexpr int kStageLoads = 8;

// Copies `node` ([L, W], global memory) into the calling warp's slot of the workspace and
// returns the slot; every lane of the warp calls it.
__device__ const uint64_t* stage_candidate(const SelectArgs& a, const Workspace& ws,
                                           const uint64_t* node) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t lw = a.shape.layers * a.shape.words;
  uint64_t* slot = ws.staged + warp * lw;
  __syncwarp();  // the slot's previous candidate is read by every lane before it is replaced
  for (int64_t base = 0; base < lw; base += 32 * kStageLoads) {
    uint64_t words[kStageLoads];
#pragma unroll
    for (int u = 0; u < kStageLoads; ++u) {
      const int64_t j = base + u * 32 + lane;
      words[u] = j < lw ? node[j] : 0;
    }
#pragma unroll
    for (int u = 0; u < kStageLoads; ++u) {
      const int64_t j = base + u * 32 + lane;
      if (j < lw) slot[j] = words[u];
    }
  }
  __syncwarp();
  return slot;
}

// DeltaCost of `node` ([L, W], global memory) against the buffer, computed by one warp;
// every lane returns it. Equal to selection_core.h's delta_cost.
__device__ double warp_delta(const SelectArgs& a, const Workspace& ws,
                             const uint64_t* global_node) {
  const int lane = threadIdx.x % 32;
  const uint64_t* node = stage_candidate(a, ws, global_node);
  if (!a.placement.enabled && a.io.weights == nullptr) {
    // An integer count: any order gives the same sum.
    uint64_t count = 0;
    for (int64_t j = lane; j < a.shape.layers * a.shape.words; j += 32) {
      count += popcount64(node[j] & ~ws.bitmaps[j]);
    }
    return static_cast<double>(warp_count(count));
  }
  // Float terms, summed in layer order: lane l % 32 computes layer l, and lane after lane
  // the non-zero terms join the running total (the same in every lane).
  double total = 0.0;
  for (int64_t base = 0; base < a.shape.layers; base += 32) {
    const int64_t l = base + lane;
    const double term = l < a.shape.layers ? layer_term(a, ws, node, l) : 0.0;
    for (unsigned nonzero = __ballot_sync(kFullMask, term != 0.0); nonzero != 0;
         nonzero &= nonzero - 1) {
      total = add_rn(total, __shfl_sync(kFullMask, term, __ffs(nonzero) - 1));
    }
  }
  return total;
}

__device__ __forceinline__ void prefetch_l1(uintptr_t address) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L1 [%0];" ::"l"(address));
#else
  (void)address;  // the CPU emulation of the tests (test/ops/cuda_emulator.h)
#endif
}

// Hints the L1 cache to fetch the bitmaps of request k's available candidates (idle warps:
// warp `helper` of `helpers`); no effect on results.
__device__ void prefetch_frontier(const SelectArgs& a, const Workspace& ws, int64_t first,
                                  int64_t k, int64_t helper, int64_t helpers) {
  const int lane = threadIdx.x % 32;
  const int64_t n = a.shape.num_nodes, lw = a.shape.layers * a.shape.words, bytes = lw * 8;
  for (int64_t i = helper; i < n; i += helpers) {
    if (!can_take(ws.selected + k * n, ws.parents + k * n, ws.prob + k * n, i, n,
                  a.options.min_score)) {
      continue;
    }
    const uintptr_t start =
        reinterpret_cast<uintptr_t>(a.io.experts + ((first + k) * n + i) * lw);
    const uintptr_t end = start + bytes;
    for (uintptr_t line = (start & ~uintptr_t{127}) + lane * 128; line < end; line += 32 * 128) {
      prefetch_l1(line);
    }
  }
}

// One turn of request k of the block (global index first + k); `next` is the block's
// request of the following turn. The turn reads frontier list `parity` (ws.frontier + parity
// N, its count counts[parity]) and writes the next request's into the other one: in phase 1
// by the last warp when the next request is another (its flags cannot change in this turn),
// in phase 2 by warp 0 when it is the same. Every thread returns the same answer: whether a
// node was taken. `tokens`, `cost`: the adaptive account (the same in every thread).
// ws.taken[k]: request k's candidates taken so far, which set its next one's scheduled cost.
// `round` (round_sync: the round's [B] picks): the pick is published there, and neither the
// buffer nor the account changes until merge_round.
__device__ bool take_turn(const SelectArgs& a, const Workspace& ws, int64_t first, int64_t k,
                          int64_t next, int parity, double* tokens, double* cost,
                          RoundPick* round) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t n = a.shape.num_nodes, lw = a.shape.layers * a.shape.words, b = first + k;
  int64_t* counts = ws.turn->frontier_counts;
  Best* slots = ws.turn->slots;
  const int64_t* list = ws.frontier + parity * n;
  int64_t* next_list = ws.frontier + (1 - parity) * n;
  const int64_t frontier = counts[parity];
  // The same multiplications, in the same order, as the CPU op's running price.
  double price = a.options.candidate_cost;
  for (int64_t j = 0; j < ws.taken[k]; ++j) price = mul_rn(price, a.options.candidate_decay);
  const double eps = candidate_eps(a.options.eps, price);
  // Phase 1: one warp per frontier candidate.
  Best mine{0.0, -1, 0.0};
  for (int64_t j = warp; j < frontier; j += kSelectWarps) {
    const int64_t i = list[j];
    const double delta =
        needs_buffer(a) ? warp_delta(a, ws, a.io.experts + (b * n + i) * lw) : 0.0;
    const double priority = node_priority(a.options.policy, ws.prob[k * n + i], delta, eps);
    mine = better_of(mine, Best{priority, i, delta});
  }
  if (lane == 0) slots[warp] = mine;
  if (next != k && warp == kSelectWarps - 1) {
    list_frontier(a, ws, first, next, next_list, counts + 1 - parity);
  }
  if (warp >= frontier && next != k && needs_buffer(a)) {
    prefetch_frontier(a, ws, first, next, warp - frontier, kSelectWarps - frontier);
  }
  __syncthreads();
  // Phase 2: every warp reduces the slots alike, so every thread knows the winner.
  Best best = lane < kSelectWarps ? slots[lane] : Best{0.0, -1, 0.0};
  for (int offset = kSelectWarps / 2; offset > 0; offset /= 2) {
    best = better_of(best, Best{__shfl_down_sync(kFullMask, best.priority, offset),
                                __shfl_down_sync(kFullMask, best.index, offset),
                                __shfl_down_sync(kFullMask, best.delta, offset)});
  }
  best = Best{__shfl_sync(kFullMask, best.priority, 0), __shfl_sync(kFullMask, best.index, 0),
              __shfl_sync(kFullMask, best.delta, 0)};
  bool take = best.index >= 0;
  if (take && a.options.policy == Policy::kAdaptive) {
    take = raises_throughput(best.priority, *tokens, *cost);
    if (take && round == nullptr) {
      *tokens = add_rn(*tokens, ws.prob[k * n + best.index]);
      *cost = add_rn(*cost, add_rn(best.delta, eps));
    }
  }
  if (round != nullptr && threadIdx.x == 0) {
    round[b] = take ? RoundPick{best.index, ws.prob[k * n + best.index], add_rn(best.delta, eps)}
                    : RoundPick{-1, 0.0, 0.0};
  }
  if (warp == 0) {
    if (take && lane == 0) {
      ws.selected[k * n + best.index] = 1;
      ++ws.taken[k];
    }
    __syncwarp();
    if (next == k) list_frontier(a, ws, first, next, next_list, counts + 1 - parity);
  } else if (take && needs_buffer(a)) {
    const uint64_t* node = a.io.experts + (b * n + best.index) * lw;
    const int64_t thread = static_cast<int64_t>(threadIdx.x) - 32, threads = blockDim.x - 32;
    if (round == nullptr) {
      add_to_buffer(a, ws, node, thread, threads);
    } else {
      publish_pick(a, node, thread, threads);
    }
  }
  __syncthreads();
  return take;
}

// Writes each request's selected candidates ascending, then -1 padding (a warp per request).
__device__ void write_rows(const SelectArgs& a, const Workspace& ws, int64_t first,
                           int64_t group) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t n = a.shape.num_nodes;
  for (int64_t k = warp; k < group; k += kSelectWarps) {
    int64_t* row = a.io.out + (first + k) * a.shape.budget;
    int64_t written = 0;
    for (int64_t base = 0; base < n && written < a.shape.budget; base += 32) {
      const int64_t i = base + lane;
      const bool chosen = i < n && ws.selected[k * n + i];
      const unsigned mask = __ballot_sync(kFullMask, chosen);
      const int64_t at = written + __popc(mask & ((1u << lane) - 1));
      if (chosen && at < a.shape.budget) row[at] = i;
      written += __popc(mask);
    }
    const int64_t budget = a.shape.budget;
    for (int64_t at = (written < budget ? written : budget) + lane; at < budget; at += 32) {
      row[at] = -1;
    }
  }
}

// Grid: one block per group of requests_per_block requests (B blocks of 1, 1 block of B, or
// a cooperative grid of ceil(B / requests_per_block) blocks with round_sync).
__global__ void __launch_bounds__(kSelectThreads, 1) select_kernel(SelectArgs a) {
  SGL_ECOSPEC_DYNAMIC_SHARED(shared);
  const Workspace ws = workspace(a, shared);
  const int64_t first = blockIdx.x * a.requests_per_block, group = block_requests(a, first);
  setup(a, ws, first, group, ws.turn->frontier_counts);
  // The adaptive account: B x step_tokens and B x step_cost with one buffer for the batch.
  const double accounted = static_cast<double>(a.picks != nullptr ? a.shape.batch : group);
  double tokens = mul_rn(a.options.step_tokens, accounted);
  double cost = mul_rn(a.options.step_cost, accounted);
  int parity = 0;
  for (int64_t step = 0; step < a.shape.budget; ++step) {
    // round_sync: even and odd rounds publish into different halves of the picks, so a block
    // that starts the next round cannot overwrite picks another block is still merging.
    RoundPick* round = a.picks == nullptr ? nullptr : a.picks + (step % 2) * a.shape.batch;
    bool any = false;
    for (int64_t k = 0; k < group; ++k, parity ^= 1) {
      any |= take_turn(a, ws, first, k, (k + 1) % group, parity, &tokens, &cost, round);
    }
    if (round != nullptr) {
      SGL_ECOSPEC_GRID_SYNC();
      any = merge_round(a, ws, round, &tokens, &cost);  // the same in every block
    }
    // A round in which no request took a node changed nothing: the next ones would repeat it.
    if (!any) break;
  }
  write_rows(a, ws, first, group);
}

}  // namespace sgl_ecospec
