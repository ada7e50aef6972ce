// The state a block of select_kernel (selection_cuda.cuh) works on: the kernel's arguments,
// the views of its workspace, and how picks enter its expert buffer, one at a time (a turn)
// or a round_sync round's at once, after the grid met.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#include <cooperative_groups.h>
#endif

#include "selection_call.h"
#include "selection_core.h"
#include "selection_workspace.h"

namespace sgl_ecospec {

// The block's dynamic shared memory; test/ops/cuda_emulator.h defines its own.
#ifndef SGL_ECOSPEC_DYNAMIC_SHARED
#define SGL_ECOSPEC_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif
// Waits for every thread of a cooperative launch (round_sync); the emulation defines its own.
#ifndef SGL_ECOSPEC_GRID_SYNC
#define SGL_ECOSPEC_GRID_SYNC() cooperative_groups::this_grid().sync()
#endif

constexpr unsigned kFullMask = 0xffffffffu;

struct SelectArgs {
  SelectBuffers io;         // the call's inputs and output
  SelectShape shape;        // B, N, L, W, budget
  SelectOptions options;    // the checked scalars (policy, eps, step account, costs, floor)
  Placement placement;      // the EP ranks ([L_r, E]), or disabled
  unsigned char* scratch;   // [blocks, global_bytes] or nullptr
  int64_t requests_per_block;  // B (share_buffer), 1, or ceil(B / blocks) (round_sync)
  WorkspaceLayout layout;
  uint64_t* picked;  // [L, W]: round_sync: the union of every pick so far; else nullptr
  RoundPick* picks;  // [2, B]: round_sync: the picks of even and odd rounds; else nullptr
};

__device__ __forceinline__ Best better_of(Best a, Best b) {
  return is_better(b.priority, b.index, a.priority, a.index) ? b : a;
}

// The block's view of its workspace.
struct Workspace {
  TurnState* turn;
  uint64_t* bitmaps;
  double* prob;
  uint64_t* staged;
  int64_t* taken;
  int32_t *peaks, *loads, *ranks;
  int64_t* parents;
  uint8_t* selected;
  int64_t* frontier;
  uint64_t* gained;
};

template <typename T>
__device__ T* region_ptr(const SelectArgs& a, unsigned char* shared, const Region& r) {
  unsigned char* base = r.in_shared
                            ? shared
                            : a.scratch + static_cast<int64_t>(blockIdx.x) * a.layout.global_bytes;
  return reinterpret_cast<T*>(base + r.offset);
}

__device__ Workspace workspace(const SelectArgs& a, unsigned char* shared) {
  const WorkspaceLayout& w = a.layout;
  return Workspace{region_ptr<TurnState>(a, shared, w.turn),
                   region_ptr<uint64_t>(a, shared, w.bitmaps),
                   region_ptr<double>(a, shared, w.prob),
                   region_ptr<uint64_t>(a, shared, w.staged),
                   region_ptr<int64_t>(a, shared, w.taken),
                   region_ptr<int32_t>(a, shared, w.peaks),
                   region_ptr<int32_t>(a, shared, w.loads),
                   region_ptr<int32_t>(a, shared, w.ranks),
                   region_ptr<int64_t>(a, shared, w.parents),
                   region_ptr<uint8_t>(a, shared, w.selected),
                   region_ptr<int64_t>(a, shared, w.frontier),
                   region_ptr<uint64_t>(a, shared, w.gained)};
}

// The requests of this block: requests_per_block, fewer in a round_sync grid's last block.
__device__ __forceinline__ int64_t block_requests(const SelectArgs& a, int64_t first) {
  const int64_t left = a.shape.batch - first;
  return left < a.requests_per_block ? left : a.requests_per_block;
}

// The ranks of one layer's experts from the workspace's table (-1: no rank), for the
// shared rules of selection_core.h.
struct TableLayer {
  const int32_t* row;  // [E]
  int64_t num_experts;
  __device__ int64_t operator()(int64_t e) const { return e < num_experts ? row[e] : -1; }
};

__device__ __forceinline__ TableLayer table_layer(const SelectArgs& a, const Workspace& ws,
                                                  int64_t layer) {
  return TableLayer{ws.ranks + layer * a.placement.layer_stride, a.placement.num_experts};
}

__device__ __forceinline__ bool needs_buffer(const SelectArgs& a) {
  return a.options.policy != Policy::kConfidence;
}

// `node`'s experts ([L, W]) enter the buffer: thread `thread` of `threads` takes layers
// thread, thread + threads, ..., so each layer's loads and peak have one writer. Loads
// only grow, so the peak is a running max.
__device__ void add_to_buffer(const SelectArgs& a, const Workspace& ws, const uint64_t* node,
                              int64_t thread, int64_t threads) {
  for (int64_t l = thread; l < a.shape.layers; l += threads) {
    int32_t peak = a.placement.enabled ? ws.peaks[l] : 0;
    for (int64_t w = 0; w < a.shape.words; ++w) {
      const int64_t j = l * a.shape.words + w;
      const uint64_t old = ws.bitmaps[j];
      if (a.placement.enabled) {
        const TableLayer ranks = table_layer(a, ws, l);
        for (uint64_t fresh = node[j] & ~old; fresh != 0; fresh &= fresh - 1) {
          const int64_t r = ranks(w * kBitsPerWord + lowest_bit(fresh));
          if (r >= 0) peak = max(peak, ++ws.loads[l * a.placement.num_ranks + r]);
        }
      }
      ws.bitmaps[j] = old | node[j];
    }
    if (a.placement.enabled) ws.peaks[l] = peak;
  }
}


// Reads a value another block wrote before the grid met: from L2, past this block's L1,
// which may still hold the line from two rounds earlier.
template <typename T>
__device__ __forceinline__ T load_from_grid(const T* p) {
  return __ldcg(p);
}

// round_sync: a block's pick `node` ([L, W]) joins the union of the picks (a.picked), a word
// per thread (thread `thread` of `threads`); the other blocks read it after the grid met.
__device__ void publish_pick(const SelectArgs& a, const uint64_t* node, int64_t thread,
                             int64_t threads) {
  for (int64_t j = thread; j < a.shape.layers * a.shape.words; j += threads) {
    const uint64_t bits = node[j];
    if (bits != 0) {
      atomicOr(reinterpret_cast<unsigned long long*>(a.picked + j),
               static_cast<unsigned long long>(bits));
    }
  }
}

// round_sync: after the grid met, every block merges the round into its copy of the buffer
// (the union of every pick so far: a word per thread, whatever B) and of the adaptive
// account (the round's picks, `round` [B], in request order: the same sums in every block,
// and as the reference's). Every thread returns whether any request took a node. Ends
// synchronised.
__device__ bool merge_round(const SelectArgs& a, const Workspace& ws, const RoundPick* round,
                            double* tokens, double* cost) {
  for (int64_t j = threadIdx.x; j < a.shape.layers * a.shape.words; j += blockDim.x) {
    const uint64_t word = load_from_grid(a.picked + j);
    // With EP the fresh experts enter through add_to_buffer, one writer per layer.
    if (a.placement.enabled) {
      ws.gained[j] = word;
    } else {
      ws.bitmaps[j] |= word;
    }
  }
  bool any = false;
  for (int64_t b = 0; b < a.shape.batch; ++b) {
    if (load_from_grid(&round[b].index) < 0) continue;
    any = true;
    if (a.options.policy == Policy::kAdaptive) {
      *tokens = add_rn(*tokens, load_from_grid(&round[b].tokens));
      *cost = add_rn(*cost, load_from_grid(&round[b].cost));
    }
  }
  if (a.placement.enabled) {
    __syncthreads();
    add_to_buffer(a, ws, ws.gained, threadIdx.x, blockDim.x);
  }
  __syncthreads();
  return any;
}

}  // namespace sgl_ecospec
