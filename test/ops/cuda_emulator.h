// A CPU emulation of the CUDA features csrc/selection_cuda.cuh uses, so that the kernel's
// own source runs in the tests without a GPU (test/ops/test_cuda_emulated.py): every thread
// of a block is a fiber (ucontext), and blocks run one after another, or side by side in a
// cooperative launch, whose grid-wide barrier (grid_sync) every thread of every block meets.
//
// What it checks: the kernel's logic, indexing and arithmetic (compiled with
// -ffp-contract=off, so doubles round as on the GPU with mul_rn / add_rn), that every thread
// of a block reaches each __syncthreads (otherwise: "deadlock"), and that the 32 lanes of a
// warp meet at the same warp operation with a full mask (otherwise: "divergent"). What it
// cannot check: the GPU's memory model (fibers switch only at synchronisation points, so a
// missing barrier between a write and another thread's read may go unnoticed), timing,
// registers and shared-memory limits.
#pragma once

#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace emu {

struct Dim3 {
  unsigned x = 0, y = 1, z = 1;
};

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  Dim3 thread;
  bool done = false;
  const uint64_t* wait_on = nullptr;  // runnable again once *wait_on != wait_from
  uint64_t wait_from = 0;
};

// A barrier for `count` fibers: the generation moves on when the last one arrives.
struct Barrier {
  uint64_t arrived = 0, generation = 0;
};

struct Warp {
  Barrier barrier;
  const char* op = nullptr;  // the operation the lanes are meeting at
  uint64_t values[32];
};

struct Block {
  ucontext_t scheduler;
  std::vector<std::unique_ptr<Fiber>> fibers;
  Fiber* current = nullptr;
  Dim3 index, dim;
  std::vector<unsigned char> shared;
  Barrier barrier;
  std::vector<Warp> warps;
  std::function<void()> body;
  std::string failure;  // set when the emulation found a fault: launch() throws it
};

inline Block*& block() {
  static Block* running = nullptr;
  return running;
}

// Ends the launch with `what`: from a fiber, it never runs again (the kernel's locals are
// trivially destructible) and launch() throws.
inline void fail(const char* what) {
  Block* blk = block();
  if (blk->failure.empty()) blk->failure = what;
  if (blk->current != nullptr) {
    swapcontext(&blk->current->context, &blk->scheduler);
    std::abort();  // never resumed
  }
}

inline void wait(Barrier& b, uint64_t count) {
  Fiber* self = block()->current;
  const uint64_t generation = b.generation;
  if (++b.arrived == count) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  self->wait_on = &b.generation;
  self->wait_from = generation;
  swapcontext(&self->context, &block()->scheduler);
}

inline void trampoline() {
  block()->body();
  block()->current->done = true;  // returns to the scheduler through uc_link
}

inline std::unique_ptr<Fiber> make_fiber(Block& blk, unsigned t, size_t stack) {
  auto f = std::make_unique<Fiber>();
  f->thread.x = t;
  f->stack.reset(new char[stack]);
  getcontext(&f->context);
  f->context.uc_stack.ss_sp = f->stack.get();
  f->context.uc_stack.ss_size = stack;
  f->context.uc_link = &blk.scheduler;
  makecontext(&f->context, trampoline, 0);
  return f;
}

// The barrier of a cooperative launch's whole grid (grid_sync), and its thread count; the
// count is 0 outside a cooperative launch.
struct Grid {
  Barrier barrier;
  uint64_t threads = 0;
};

inline Grid& grid() {
  static Grid running;
  return running;
}

// Runs `blocks` side by side (a fiber of each in turn) until all are done; the failed
// block's index, or -1.
inline long run(std::vector<std::unique_ptr<Block>>& blocks) {
  for (size_t live = 1; live > 0;) {
    bool ran = false;
    live = 0;
    for (auto& blk : blocks) {
      for (auto& f : blk->fibers) {
        if (f->done) continue;
        ++live;
        if (f->wait_on != nullptr && *f->wait_on == f->wait_from) continue;
        f->wait_on = nullptr;
        block() = blk.get();
        blk->current = f.get();
        ran = true;
        swapcontext(&blk->scheduler, &f->context);
        blk->current = nullptr;
        block() = nullptr;
        if (!blk->failure.empty()) return static_cast<long>(blk->index.x);
      }
    }
    if (live > 0 && !ran) {
      blocks.front()->failure = "deadlock: threads wait at a barrier others never reach";
      return static_cast<long>(blocks.front()->index.x);
    }
  }
  return -1;
}

inline std::unique_ptr<Block> make_block(unsigned index, unsigned threads, size_t shared_bytes,
                                         std::function<void()> body) {
  constexpr size_t kStack = 256 * 1024;
  auto blk = std::make_unique<Block>();
  blk->index.x = index;
  blk->dim.x = threads;
  blk->shared.assign(shared_bytes + 16, 0xA5);  // garbage, as on a GPU
  blk->warps.resize(threads / 32);
  blk->body = std::move(body);
  for (unsigned t = 0; t < threads; ++t) blk->fibers.push_back(make_fiber(*blk, t, kStack));
  return blk;
}

// Runs `kernel(args)` on a grid of `grid_size` blocks of `threads` threads, one block after
// another, or all side by side when `cooperative` (as cudaLaunchCooperativeKernel, which
// grid_sync needs); throws std::runtime_error when the emulation finds a fault.
template <typename Args>
void launch(void (*kernel)(Args), unsigned grid_size, unsigned threads, size_t shared_bytes,
            const Args& args, bool cooperative = false) {
  if (threads % 32 != 0) throw std::runtime_error("threads must be a multiple of 32");
  if (grid_size == 0) return;
  const auto body = [&] { kernel(args); };
  grid() = Grid{};
  grid().threads = cooperative ? static_cast<uint64_t>(grid_size) * threads : 0;
  const unsigned batches = cooperative ? 1 : grid_size;
  for (unsigned first = 0; first < grid_size; first += grid_size / batches) {
    std::vector<std::unique_ptr<Block>> blocks;
    for (unsigned b = first; b < first + grid_size / batches; ++b) {
      blocks.push_back(make_block(b, threads, shared_bytes, body));
    }
    const long failed = run(blocks);
    if (failed >= 0) {
      grid() = Grid{};
      throw std::runtime_error("cuda emulator: block " + std::to_string(failed) + ": " +
                               blocks[failed - first]->failure);
    }
  }
  grid() = Grid{};
}

// The grid-wide barrier of a cooperative launch.
inline void grid_sync() {
  if (grid().threads == 0) fail("grid sync outside a cooperative launch");
  wait(grid().barrier, grid().threads);
}

// All 32 lanes of the calling warp deposit a value; each gets every lane's value.
inline void exchange(const char* op, unsigned mask, uint64_t mine, uint64_t out[32]) {
  if (mask != 0xffffffffu) fail("warp operation without a full mask");
  Block* blk = block();
  const unsigned lane = blk->current->thread.x % 32;
  Warp& w = blk->warps[blk->current->thread.x / 32];
  if (w.barrier.arrived == 0) {
    w.op = op;
  } else if (std::strcmp(w.op, op) != 0) {
    fail("divergent: lanes of a warp at different warp operations");
  }
  w.values[lane] = mine;
  wait(w.barrier, 32);
  std::memcpy(out, w.values, sizeof(w.values));
  wait(w.barrier, 32);  // nobody deposits again before every lane has read
}

template <typename T>
uint64_t bits_of(T v) {
  static_assert(sizeof(T) <= 8);
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

template <typename T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

}  // namespace emu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)
#define threadIdx (::emu::block()->current->thread)
#define blockIdx (::emu::block()->index)
#define blockDim (::emu::block()->dim)
#define SGL_ECOSPEC_DYNAMIC_SHARED(name) unsigned char* name = ::emu::block()->shared.data()
#define SGL_ECOSPEC_GRID_SYNC() ::emu::grid_sync()

inline void __syncthreads() { ::emu::wait(::emu::block()->barrier, ::emu::block()->dim.x); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  uint64_t all[32];
  ::emu::exchange("syncwarp", mask, 0, all);
}

inline unsigned __ballot_sync(unsigned mask, bool predicate) {
  uint64_t all[32];
  ::emu::exchange("ballot", mask, predicate, all);
  unsigned out = 0;
  for (int lane = 0; lane < 32; ++lane) out |= (all[lane] != 0 ? 1u : 0u) << lane;
  return out;
}

template <typename T>
T __shfl_sync(unsigned mask, T value, int source) {
  uint64_t all[32];
  ::emu::exchange("shfl", mask, ::emu::bits_of(value), all);
  return ::emu::from_bits<T>(all[source % 32]);
}

template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta) {
  uint64_t all[32];
  ::emu::exchange("shfl_down", mask, ::emu::bits_of(value), all);
  const unsigned source = threadIdx.x % 32 + delta;
  return source < 32 ? ::emu::from_bits<T>(all[source]) : value;
}

inline unsigned __reduce_add_sync(unsigned mask, unsigned value) {
  uint64_t all[32];
  ::emu::exchange("reduce_add", mask, value, all);
  unsigned sum = 0;
  for (int lane = 0; lane < 32; ++lane) sum += static_cast<unsigned>(all[lane]);
  return sum;
}

template <typename T>
T __ldcg(const T* address) {  // one memory: no cache to bypass
  return *address;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int atomicAdd(int* address, int value) {  // fibers never run at the same time
  const int old = *address;
  *address = old + value;
  return old;
}
inline unsigned long long atomicOr(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  *address = old | value;
  return old;
}
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
