// CUDA kernels of the sgl_ecospec ops, registered for the same schemas as the CPU ops and
// behind the same argument checks (checks.h). No host syncs and no allocation beyond the
// outputs and scratch tensors, so the ops can be captured in a CUDA graph. Value checks
// (ids in range, parents in range, no NaN, EP ranks in range) are the Python API's job, on
// every backend: here, as on the CPU, an out-of-range id sets no bit, an out-of-range parent
// makes its node unreachable and an expert with an out-of-range rank adds no load.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "checks.h"
#include "ecospec_ops.h"
#include "selection_core.h"

namespace sgl_ecospec {

namespace {

constexpr int kThreads = 256;

template <typename index_t>
__global__ void topk_to_bitmap_kernel(const index_t* __restrict__ ids, int64_t* __restrict__ out,
                                      int64_t rows, int64_t k, int64_t words,
                                      int64_t num_experts) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  uint64_t* row_out = reinterpret_cast<uint64_t*>(out + r * words);
  for (int64_t w = 0; w < words; ++w) row_out[w] = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t e = static_cast<int64_t>(ids[r * k + j]);
    if (e >= 0 && e < num_experts) row_out[e / kBitsPerWord] |= uint64_t{1} << (e % kBitsPerWord);
  }
}

__global__ void popcount_kernel(const uint64_t* __restrict__ in, int64_t* __restrict__ out,
                                int64_t rows, int64_t words) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  int64_t c = 0;
  for (int64_t w = 0; w < words; ++w) c += popcount64(in[r * words + w]);
  out[r] = c;
}

struct Best {
  double priority;
  int64_t index;
  double delta;  // the node's DeltaCost (the adaptive policy adds it to the step's cost)
};

__device__ Best better_of(Best a, Best b) {
  return is_better(b.priority, b.index, a.priority, a.index) ? b : a;
}

__device__ Best shuffle_down(Best mine, int offset) {
  return Best{__shfl_down_sync(0xffffffff, mine.priority, offset),
              __shfl_down_sync(0xffffffff, mine.index, offset),
              __shfl_down_sync(0xffffffff, mine.delta, offset)};
}

// Block-wide argmax with the shared tie rule; every thread gets the result.
__device__ Best block_best(Best mine, Best* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) mine = better_of(mine, shuffle_down(mine, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) scratch[warp] = mine;
  __syncthreads();
  if (warp == 0) {
    mine = lane < blockDim.x / 32 ? scratch[lane] : Best{0.0, -1, 0.0};
    for (int offset = 16; offset > 0; offset /= 2) {
      mine = better_of(mine, shuffle_down(mine, offset));
    }
    if (lane == 0) scratch[0] = mine;
  }
  __syncthreads();
  Best result = scratch[0];
  __syncthreads();
  return result;
}

struct SelectArgs {
  const double* prob;        // [B, N]
  const int64_t* parents;    // [B, N]
  const uint64_t* experts;   // [B, N, L, W]
  const uint64_t* roots;     // [B, L, W] or nullptr
  const double* weights;     // [L] or nullptr
  uint8_t* selected;         // [B, N] scratch, zeroed by the kernel
  int32_t* loads;            // [B or 1, L * R + L] scratch with a placement: loads, then peaks
  int64_t* out;              // [B, budget]
  int64_t batch, num_nodes, layers, words, budget;
  Policy policy;
  double eps;
  Placement placement;
  double step_tokens, step_cost;
};

// The expert buffer of one request (or of the batch): bitmaps in shared memory, with a
// placement also its loads per rank and their per-layer peaks in global scratch.
struct Buffer {
  uint64_t* experts;  // [L, W]
  int32_t* loads;     // [L, R]
  int32_t* peaks;     // [L]
};

__device__ Buffer buffer_at(const SelectArgs& a, uint64_t* experts, int64_t slot) {
  const int64_t r = a.placement.num_ranks;
  int32_t* loads = a.placement.enabled ? a.loads + slot * (a.layers * r + a.layers) : nullptr;
  return Buffer{experts, loads, loads == nullptr ? nullptr : loads + a.layers * r};
}

// Counts `fresh` (bits of word j of the bitmaps, not yet in the buffer) into the loads.
__device__ void count_fresh(const SelectArgs& a, const Buffer& buf, int64_t j, uint64_t fresh) {
  const int64_t layer = j / a.words, w = j % a.words;
  for (; fresh != 0; fresh &= fresh - 1) {
    const int64_t r = rank_of(a.placement, layer, w * kBitsPerWord + lowest_bit(fresh));
    if (r >= 0) atomicAdd(buf.loads + layer * a.placement.num_ranks + r, 1);
  }
}

__device__ void update_peaks(const SelectArgs& a, const Buffer& buf) {
  const int64_t r = a.placement.num_ranks;
  for (int64_t l = threadIdx.x; l < a.layers; l += blockDim.x) {
    int32_t peak = 0;
    for (int64_t k = 0; k < r; ++k) peak = max(peak, buf.loads[l * r + k]);
    buf.peaks[l] = peak;
  }
  __syncthreads();
}

// Adds `node` ([L, W]) to the buffer. Ends with the block synchronised.
__device__ void add_to_buffer(const SelectArgs& a, const Buffer& buf, const uint64_t* node) {
  for (int64_t j = threadIdx.x; j < a.layers * a.words; j += blockDim.x) {
    if (a.placement.enabled) count_fresh(a, buf, j, node[j] & ~buf.experts[j]);
    buf.experts[j] |= node[j];
  }
  __syncthreads();
  if (a.placement.enabled) update_peaks(a, buf);
}

// Seeds an empty buffer (its bitmaps already zeroed) with `roots` ([L, W]).
__device__ void seed_buffer(const SelectArgs& a, const Buffer& buf, const uint64_t* roots) {
  if (a.placement.enabled) {
    for (int64_t k = threadIdx.x; k < a.layers * (a.placement.num_ranks + 1); k += blockDim.x) {
      buf.loads[k] = 0;  // loads and peaks are contiguous
    }
  }
  __syncthreads();
  add_to_buffer(a, buf, roots);
}

// One turn of request b: picks its best frontier node against the buffer and takes it,
// unless the adaptive policy finds that it lowers the step's tokens per cost (`tokens`,
// `cost`: the step's account, the same in every thread). False when nothing was taken.
__device__ bool take_turn(const SelectArgs& a, int64_t b, const Buffer& buf, Best* scratch,
                          double* tokens, double* cost) {
  const int64_t n = a.num_nodes, lw = a.layers * a.words;
  uint8_t* selected = a.selected + b * n;
  Best mine{0.0, -1, 0.0};
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (!is_available(selected, a.parents + b * n, i, n)) continue;
    const double delta = a.policy == Policy::kConfidence
                             ? 0.0
                             : delta_cost(a.experts + (b * n + i) * lw, buf.experts, a.layers,
                                          a.words, a.weights, a.placement, buf.loads, buf.peaks);
    mine = better_of(mine, Best{node_priority(a.policy, a.prob[b * n + i], delta, a.eps), i, delta});
  }
  const Best best = block_best(mine, scratch);
  if (best.index < 0) return false;
  if (a.policy == Policy::kAdaptive) {
    if (!raises_throughput(best.priority, *tokens, *cost)) return false;
    *tokens = add_rn(*tokens, a.prob[b * n + best.index]);
    *cost = add_rn(*cost, add_rn(best.delta, a.eps));
  }
  if (a.policy != Policy::kConfidence) add_to_buffer(a, buf, a.experts + (b * n + best.index) * lw);
  if (threadIdx.x == 0) selected[best.index] = 1;
  __syncthreads();
  return true;
}

__device__ void write_row(const SelectArgs& a, int64_t b) {
  if (threadIdx.x != 0) return;
  const uint8_t* selected = a.selected + b * a.num_nodes;
  int64_t k = 0;
  for (int64_t i = 0; i < a.num_nodes && k < a.budget; ++i) {
    if (selected[i]) a.out[b * a.budget + k++] = i;
  }
  for (; k < a.budget; ++k) a.out[b * a.budget + k] = -1;
}

__device__ void init_request(const SelectArgs& a, int64_t b) {
  for (int64_t i = threadIdx.x; i < a.num_nodes; i += blockDim.x) {
    a.selected[b * a.num_nodes + i] = 0;
  }
}

// Grid: one block per request; the buffer's bitmaps live in shared memory.
__global__ void select_per_request_kernel(SelectArgs a) {
  extern __shared__ uint64_t bitmaps[];
  __shared__ Best scratch[kThreads / 32];
  const int64_t b = blockIdx.x, lw = a.layers * a.words;
  for (int64_t j = threadIdx.x; j < lw; j += blockDim.x) bitmaps[j] = 0;
  init_request(a, b);
  const Buffer buf = buffer_at(a, bitmaps, b);
  seed_buffer(a, buf, a.roots == nullptr ? bitmaps : a.roots + b * lw);
  double tokens = a.step_tokens, cost = a.step_cost;
  // A request that takes nothing this turn never will: its state did not change.
  for (int64_t step = 0; step < a.budget; ++step) {
    if (!take_turn(a, b, buf, scratch, &tokens, &cost)) break;
  }
  write_row(a, b);
}

// Grid: one block for the batch; one buffer seeded with every root and one account for
// the step; requests take turns.
__global__ void select_shared_kernel(SelectArgs a) {
  extern __shared__ uint64_t bitmaps[];
  __shared__ Best scratch[kThreads / 32];
  const int64_t lw = a.layers * a.words;
  for (int64_t j = threadIdx.x; j < lw; j += blockDim.x) bitmaps[j] = 0;
  for (int64_t b = 0; b < a.batch; ++b) init_request(a, b);
  const Buffer buf = buffer_at(a, bitmaps, 0);
  // Zeroes the loads, then adds the roots one request at a time (each add synchronises).
  seed_buffer(a, buf, bitmaps);
  for (int64_t b = 0; a.roots != nullptr && b < a.batch; ++b) add_to_buffer(a, buf, a.roots + b * lw);
  const double requests = static_cast<double>(a.batch);
  double tokens = mul_rn(a.step_tokens, requests), cost = mul_rn(a.step_cost, requests);
  for (int64_t step = 0; step < a.budget; ++step) {
    for (int64_t b = 0; b < a.batch; ++b) take_turn(a, b, buf, scratch, &tokens, &cost);
  }
  for (int64_t b = 0; b < a.batch; ++b) write_row(a, b);
}

int64_t blocks_for(int64_t rows) { return std::max<int64_t>(1, (rows + kThreads - 1) / kThreads); }

}  // namespace

at::Tensor topk_to_bitmap_cuda(const at::Tensor& topk_ids, int64_t num_experts) {
  const int64_t words = check_topk_to_bitmap_args(topk_ids, num_experts);
  const c10::cuda::CUDAGuard guard(topk_ids.device());
  const at::Tensor ids = topk_ids.contiguous();
  const int64_t k = ids.size(-1);
  auto shape = ids.sizes().vec();
  shape.back() = words;
  at::Tensor out = at::empty(shape, ids.options().dtype(at::kLong));
  const int64_t rows = out.numel() / words;
  if (rows == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (ids.scalar_type() == at::kInt) {
    topk_to_bitmap_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(
        ids.data_ptr<int32_t>(), out.data_ptr<int64_t>(), rows, k, words, num_experts);
  } else {
    topk_to_bitmap_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(
        ids.data_ptr<int64_t>(), out.data_ptr<int64_t>(), rows, k, words, num_experts);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor bitmap_popcount_cuda(const at::Tensor& bitmaps) {
  check_bitmap_popcount_args(bitmaps);
  const c10::cuda::CUDAGuard guard(bitmaps.device());
  const at::Tensor bm = bitmaps.contiguous();
  auto shape = bm.sizes().vec();
  const int64_t words = shape.back();
  shape.pop_back();
  at::Tensor out = at::empty(shape, bm.options());
  const int64_t rows = out.numel();
  if (rows == 0) return out;
  popcount_kernel<<<blocks_for(rows), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint64_t*>(bm.data_ptr<int64_t>()), out.data_ptr<int64_t>(), rows,
      words);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor select_verify_set_cuda(SGL_ECOSPEC_SELECT_VERIFY_SET_PARAMS) {
  const SelectSizes sizes = check_select_verify_set_args(SGL_ECOSPEC_SELECT_VERIFY_SET_ARGS);
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t batch = sizes.batch, n = sizes.num_nodes;
  const int64_t layers = sizes.layers, words = sizes.words;
  // A limit of this kernel, not of the op: the buffer's bitmaps live in shared memory.
  const int64_t smem = layers * words * static_cast<int64_t>(sizeof(uint64_t));
  TORCH_CHECK_VALUE(smem <= 48 * 1024, "select_verify_set: L * W = ", layers * words,
                    " words exceed the 48 KiB shared-memory buffer of the CUDA op");

  const at::Tensor prob = scores.to(at::kDouble).contiguous();
  const at::Tensor par = parents.to(at::kLong).contiguous();
  const at::Tensor experts = node_experts.contiguous();
  at::Tensor roots, weights, ranks;
  if (root_experts.has_value()) roots = root_experts->contiguous();
  if (layer_weights.has_value()) weights = layer_weights->to(at::kDouble).contiguous();
  const Placement placement = make_placement(expert_rank, sizes, num_ranks, total_weight, ranks);
  at::Tensor out = at::empty({batch, budget}, par.options());
  if (batch == 0) return out;
  at::Tensor selected = at::empty({batch, std::max<int64_t>(n, 1)}, par.options().dtype(at::kByte));
  // Rank loads and per-layer peaks of each buffer: one per request, or one for the batch.
  at::Tensor loads;
  if (placement.enabled) {
    loads = at::empty({share_buffer ? 1 : batch, std::max<int64_t>(layers * (num_ranks + 1), 1)},
                      par.options().dtype(at::kInt));
  }

  SelectArgs args{prob.data_ptr<double>(),
                  par.data_ptr<int64_t>(),
                  reinterpret_cast<const uint64_t*>(experts.data_ptr<int64_t>()),
                  roots.defined() ? reinterpret_cast<const uint64_t*>(roots.data_ptr<int64_t>())
                                  : nullptr,
                  weights.defined() ? weights.data_ptr<double>() : nullptr,
                  selected.data_ptr<uint8_t>(),
                  loads.defined() ? loads.data_ptr<int32_t>() : nullptr,
                  out.data_ptr<int64_t>(),
                  batch,
                  n,
                  layers,
                  words,
                  budget,
                  sizes.policy,
                  eps,
                  placement,
                  step_tokens,
                  step_cost};
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (share_buffer) {
    select_shared_kernel<<<1, kThreads, smem, stream>>>(args);
  } else {
    select_per_request_kernel<<<batch, kThreads, smem, stream>>>(args);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace sgl_ecospec

TORCH_LIBRARY_IMPL(sgl_ecospec, CUDA, m) { SGL_ECOSPEC_REGISTER_OPS(m, cuda); }
