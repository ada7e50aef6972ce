// Where the selection kernel (selection_cuda.cuh) keeps its per-block workspace, and how a
// call is split into blocks: plain C++, used by the CUDA launcher (ops_cuda.cu) and by the
// CPU emulation of the tests alike, so both plan a call the same way.
#pragma once

#include <cstdint>

#include "selection_core.h"

namespace sgl_ecospec {

constexpr int kSelectThreads = 512;
constexpr int kSelectWarps = kSelectThreads / 32;

// A candidate and its priority, as the warps of a turn compare them.
struct Best {
  double priority;
  int64_t index;  // -1: no node
  double delta;   // the node's DeltaCost (the adaptive policy adds it to the step's cost)
};

// What a block's turns share besides the workspace arrays: each warp's best candidate and
// the two frontier lists' lengths. In the workspace rather than static __shared__, so that
// the CPU emulation can run a round_sync grid's blocks side by side.
struct TurnState {
  Best slots[kSelectWarps];
  int64_t frontier_counts[2];
};

// A request's pick of one round_sync round, published for every block (global memory):
// the node (-1: none taken), and what taking it adds to the adaptive account.
struct RoundPick {
  int64_t index;
  double tokens, cost;
};

// Where one workspace array lives: byte offset into dynamic shared memory, or into this
// block's slice of the global scratch tensor.
struct Region {
  int64_t offset = 0, bytes = 0;
  bool in_shared = true;
};

// The workspace of one block (G = requests of the block, R = EP ranks, L_r = L or 1).
struct WorkspaceLayout {
  Region turn;      // TurnState
  Region bitmaps;   // uint64 [L, W]: the expert buffer
  Region prob;      // double [G, N]: the block's scores
  Region staged;    // uint64 [warps, L, W]: each warp's candidate of the turn
  Region taken;     // int64 [G]: candidates each request has taken
  Region peaks;     // int32 [L]: max over ranks of loads (EP)
  Region loads;     // int32 [L, R]: the buffer's experts per rank (EP)
  Region ranks;     // int32 [L_r, E]: rank of each expert, -1 outside [0, R) (EP)
  Region parents;   // int64 [G, N]
  Region selected;  // uint8 [G, N]
  Region frontier;  // int64 [2, N]: available candidates of this turn's and the next request
  Region gained;    // uint64 [L, W]: the experts a round_sync round's picks add (EP)
  int64_t shared_bytes = 0, global_bytes = 0;  // global_bytes: per block
};

// Places the selection kernel's workspace arrays in shared memory while they fit (at most
// `shared_limit` bytes), in the order the turns use them most, and the rest in a global
// scratch slice per block. `group`: requests per block; `buffer`: the policy reads the
// expert buffer; `ep`: with a placement of `rank_rows` x E ranks over R ranks; `rounds`: the
// blocks merge each round's picks (round_sync).
inline WorkspaceLayout plan_workspace(int64_t group, int64_t n, int64_t layers, int64_t words,
                                      bool buffer, bool ep, int64_t rank_rows, int64_t experts,
                                      int64_t ranks, bool rounds, int64_t shared_limit) {
  WorkspaceLayout w;
  auto place = [&w, shared_limit](Region& r, int64_t bytes) {
    const int64_t size = (bytes + 15) / 16 * 16;
    r.bytes = bytes;
    r.in_shared = w.shared_bytes + size <= shared_limit;
    int64_t& used = r.in_shared ? w.shared_bytes : w.global_bytes;
    r.offset = used;
    used += size;
  };
  const bool with_ep = buffer && ep;
  place(w.turn, sizeof(TurnState));
  place(w.frontier, 2 * n * 8);
  place(w.bitmaps, buffer ? layers * words * 8 : 0);
  place(w.prob, group * n * 8);
  place(w.taken, group * 8);
  place(w.selected, group * n);
  place(w.parents, group * n * 8);
  place(w.staged, buffer ? kSelectWarps * layers * words * 8 : 0);
  place(w.peaks, with_ep ? layers * 4 : 0);
  place(w.loads, with_ep ? layers * ranks * 4 : 0);
  place(w.ranks, with_ep ? rank_rows * experts * 4 : 0);
  place(w.gained, rounds && with_ep ? layers * words * 8 : 0);
  return w;
}

// How one call runs: `blocks` blocks of up to `group` requests each (the last block may
// have fewer), and their workspace. `rounds`: a cooperative launch whose blocks meet after
// every round (round_sync), exchanging their picks through global scratch placed after the
// blocks' slices: the union of every pick so far (uint64 [L, W], `union_bytes`, which must
// be zero at launch), then the picks of even and odd rounds (RoundPick [2, B]). The launcher
// (ops_cuda.cu) and the CPU emulation of the tests both plan a call with it.
struct SelectLaunch {
  int64_t blocks, group;
  bool rounds;
  WorkspaceLayout layout;
  int64_t union_bytes, picks_bytes;
  int64_t union_offset() const { return blocks * layout.global_bytes; }
  int64_t scratch_bytes() const { return union_offset() + union_bytes + picks_bytes; }
};

// "confidence" reads no buffer, so its picks are the same with or without share_buffer: it
// always runs one block per request. The other policies with share_buffer run one block
// (turn by turn), or with round_sync a cooperative grid of at most `max_blocks` blocks
// (the device's co-resident blocks), ceil(B / max_blocks) requests each.
inline SelectLaunch plan_select(int64_t batch, int64_t n, int64_t layers, int64_t words,
                                Policy policy, bool share_buffer, bool round_sync, bool ep,
                                int64_t rank_rows, int64_t experts, int64_t ranks,
                                int64_t shared_limit, int64_t max_blocks) {
  const bool buffer = policy != Policy::kConfidence;
  const bool rounds = share_buffer && round_sync && buffer;
  const bool one_block = share_buffer && buffer && !rounds;
  int64_t group = one_block ? batch : 1;
  if (rounds && max_blocks >= 1 && batch > max_blocks) {
    group = (batch + max_blocks - 1) / max_blocks;
  }
  const int64_t blocks = one_block ? 1 : (batch + group - 1) / group;
  return SelectLaunch{blocks,
                      group,
                      rounds,
                      plan_workspace(group, n, layers, words, buffer, ep, rank_rows, experts,
                                     ranks, rounds, shared_limit),
                      rounds ? layers * words * 8 : 0,
                      rounds ? 2 * batch * static_cast<int64_t>(sizeof(RoundPick)) : 0};
}

}  // namespace sgl_ecospec
