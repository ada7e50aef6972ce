// CUDA kernels of the sgl_ecospec ops, registered for the same schemas as the CPU ops.
// No host syncs and no allocation beyond the outputs and one scratch tensor, so the ops can
// be captured in a CUDA graph. Value checks (ids in range, parents in range, no NaN) are
// the Python API's job: here an out-of-range id sets no bit and an out-of-range parent
// makes its node unreachable.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "selection_core.h"

namespace sgl_ecospec {

namespace {

constexpr int64_t kWordBits = 64;
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
    if (e >= 0 && e < num_experts) row_out[e / kWordBits] |= uint64_t{1} << (e % kWordBits);
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
};

__device__ Best better_of(Best a, Best b) {
  return is_better(b.priority, b.index, a.priority, a.index) ? b : a;
}

// Block-wide argmax with the shared tie rule; every thread gets the result.
__device__ Best block_best(Best mine, Best* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) {
    Best other{__shfl_down_sync(0xffffffff, mine.priority, offset),
               __shfl_down_sync(0xffffffff, mine.index, offset)};
    mine = better_of(mine, other);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) scratch[warp] = mine;
  __syncthreads();
  if (warp == 0) {
    mine = lane < blockDim.x / 32 ? scratch[lane] : Best{0.0, -1};
    for (int offset = 16; offset > 0; offset /= 2) {
      Best other{__shfl_down_sync(0xffffffff, mine.priority, offset),
                 __shfl_down_sync(0xffffffff, mine.index, offset)};
      mine = better_of(mine, other);
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
  int64_t* out;              // [B, budget]
  int64_t batch, num_nodes, layers, words, budget;
  Policy policy;
  double eps;
};

// One step for request b: picks its best frontier node against `buffer` and adds it.
// Returns false when the request has no node left.
__device__ bool pick_and_add(const SelectArgs& a, int64_t b, uint64_t* buffer, Best* scratch) {
  const int64_t n = a.num_nodes, lw = a.layers * a.words;
  uint8_t* selected = a.selected + b * n;
  Best mine{0.0, -1};
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (!is_available(selected, a.parents + b * n, i, n)) continue;
    const double priority = node_priority(a.policy, a.prob[b * n + i],
                                          a.experts + (b * n + i) * lw, buffer, a.layers,
                                          a.words, a.weights, a.eps);
    mine = better_of(mine, Best{priority, i});
  }
  const Best best = block_best(mine, scratch);
  if (best.index < 0) return false;
  if (a.policy == Policy::kEcoSpec) {
    const uint64_t* node = a.experts + (b * n + best.index) * lw;
    for (int64_t j = threadIdx.x; j < lw; j += blockDim.x) buffer[j] |= node[j];
  }
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

// Grid: one block per request; the buffer lives in shared memory.
__global__ void select_per_request_kernel(SelectArgs a) {
  extern __shared__ uint64_t buffer[];
  __shared__ Best scratch[kThreads / 32];
  const int64_t b = blockIdx.x, lw = a.layers * a.words;
  for (int64_t j = threadIdx.x; j < lw; j += blockDim.x) {
    buffer[j] = a.roots == nullptr ? 0 : a.roots[b * lw + j];
  }
  init_request(a, b);
  __syncthreads();
  for (int64_t step = 0; step < a.budget; ++step) {
    if (!pick_and_add(a, b, buffer, scratch)) break;
  }
  write_row(a, b);
}

// Grid: one block for the batch; one buffer seeded with every root; requests pick in turns.
__global__ void select_shared_kernel(SelectArgs a) {
  extern __shared__ uint64_t buffer[];
  __shared__ Best scratch[kThreads / 32];
  const int64_t lw = a.layers * a.words;
  for (int64_t j = threadIdx.x; j < lw; j += blockDim.x) {
    uint64_t word = 0;
    for (int64_t b = 0; a.roots != nullptr && b < a.batch; ++b) word |= a.roots[b * lw + j];
    buffer[j] = word;
  }
  for (int64_t b = 0; b < a.batch; ++b) init_request(a, b);
  __syncthreads();
  for (int64_t step = 0; step < a.budget; ++step) {
    for (int64_t b = 0; b < a.batch; ++b) pick_and_add(a, b, buffer, scratch);
  }
  for (int64_t b = 0; b < a.batch; ++b) write_row(a, b);
}

int64_t blocks_for(int64_t rows) { return std::max<int64_t>(1, (rows + kThreads - 1) / kThreads); }

}  // namespace

at::Tensor topk_to_bitmap_cuda(const at::Tensor& topk_ids, int64_t num_experts) {
  TORCH_CHECK(topk_ids.dim() >= 2, "topk_to_bitmap: topk_ids must be [..., L, K]");
  TORCH_CHECK(num_experts >= 1, "topk_to_bitmap: num_experts must be >= 1");
  const c10::cuda::CUDAGuard guard(topk_ids.device());
  const at::Tensor ids = topk_ids.contiguous();
  const int64_t k = ids.size(-1), words = (num_experts + kWordBits - 1) / kWordBits;
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
    TORCH_CHECK(ids.scalar_type() == at::kLong, "topk_to_bitmap: ids must be int32 or int64");
    topk_to_bitmap_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(
        ids.data_ptr<int64_t>(), out.data_ptr<int64_t>(), rows, k, words, num_experts);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor bitmap_popcount_cuda(const at::Tensor& bitmaps) {
  TORCH_CHECK(bitmaps.dim() >= 1 && bitmaps.scalar_type() == at::kLong,
              "bitmap_popcount: bitmaps must be int64 [..., W]");
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

at::Tensor select_verify_set_cuda(const at::Tensor& scores, const at::Tensor& parents,
                                  const at::Tensor& node_experts, int64_t budget,
                                  const std::optional<at::Tensor>& root_experts,
                                  const std::string& policy, double eps, bool share_buffer,
                                  const std::optional<at::Tensor>& layer_weights) {
  TORCH_CHECK(scores.dim() == 2 && parents.sizes() == scores.sizes(),
              "select_verify_set: scores and parents must be [B, N]");
  TORCH_CHECK(node_experts.dim() == 4 && node_experts.scalar_type() == at::kLong &&
                  node_experts.size(0) == scores.size(0) && node_experts.size(1) == scores.size(1),
              "select_verify_set: node_experts must be int64 [B, N, L, W]");
  TORCH_CHECK(budget >= 0 && eps > 0, "select_verify_set: need budget >= 0 and eps > 0");
  TORCH_CHECK(policy == "confidence" || policy == "ecospec",
              "select_verify_set: unknown policy ", policy);
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t batch = scores.size(0), n = scores.size(1);
  const int64_t layers = node_experts.size(2), words = node_experts.size(3);
  const int64_t smem = layers * words * static_cast<int64_t>(sizeof(uint64_t));
  TORCH_CHECK(smem <= 48 * 1024, "select_verify_set: L * W = ", layers * words,
              " words exceed the 48 KiB shared-memory buffer of the CUDA op");

  const at::Tensor prob = scores.to(at::kDouble).contiguous();
  const at::Tensor par = parents.to(at::kLong).contiguous();
  const at::Tensor experts = node_experts.contiguous();
  at::Tensor roots, weights;
  if (root_experts.has_value()) {
    TORCH_CHECK(root_experts->dim() == 3 && root_experts->size(0) == batch &&
                    root_experts->size(1) == layers && root_experts->size(2) == words,
                "select_verify_set: root_experts must be int64 [B, L, W]");
    roots = root_experts->to(at::kLong).contiguous();
  }
  if (layer_weights.has_value()) {
    TORCH_CHECK(layer_weights->dim() == 1 && layer_weights->size(0) == layers,
                "select_verify_set: layer_weights must be [L]");
    weights = layer_weights->to(at::kDouble).contiguous();
  }
  at::Tensor out = at::empty({batch, budget}, par.options());
  if (batch == 0) return out;
  at::Tensor selected = at::empty({batch, std::max<int64_t>(n, 1)}, par.options().dtype(at::kByte));

  SelectArgs args{prob.data_ptr<double>(),
                  par.data_ptr<int64_t>(),
                  reinterpret_cast<const uint64_t*>(experts.data_ptr<int64_t>()),
                  roots.defined() ? reinterpret_cast<const uint64_t*>(roots.data_ptr<int64_t>())
                                  : nullptr,
                  weights.defined() ? weights.data_ptr<double>() : nullptr,
                  selected.data_ptr<uint8_t>(),
                  out.data_ptr<int64_t>(),
                  batch,
                  n,
                  layers,
                  words,
                  budget,
                  policy == "ecospec" ? Policy::kEcoSpec : Policy::kConfidence,
                  eps};
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

TORCH_LIBRARY_IMPL(sgl_ecospec, CUDA, m) {
  m.impl("topk_to_bitmap", &sgl_ecospec::topk_to_bitmap_cuda);
  m.impl("bitmap_popcount", &sgl_ecospec::bitmap_popcount_cuda);
  m.impl("select_verify_set", &sgl_ecospec::select_verify_set_cuda);
}
